"""The rejection sampler (docs/design.md §1.4): the drafts each row verifies, assembled from its
chosen proposal, and which of them the target accepts, greedy or by speculative sampling, with the
token after the last accepted one. Pure tensor work over one step: no caches, no state.
"""

from __future__ import annotations

import numpy as np
import torch

from model.engine.proposers import Proposal
from model.engine.sampling import processed_probs, verify_greedy, verify_sampling
from model.engine.step import DecodeStep, Drafts


def choice_arrays(step: DecodeStep) -> list[np.ndarray]:
    """What the choice adds from the host, for the step's one copy (`DecodeStep.load`): the counts,
    which rows copy, their copies [R, k] (k = 0 when none does) and the greedy and sampling rows'
    indices."""
    choice = step.choice
    assert choice is not None
    r, k = len(choice.counts), max(choice.counts, default=0)
    copying = k > 0 and any(choice.use_ngram)
    copied = np.zeros((r, k if copying else 0), dtype=np.int64)
    if copying:
        assert step.copies is not None
        for i in range(r):
            n = choice.counts[i]
            if choice.use_ngram[i] and step.copies.count(i) and n:
                copied[i, :n] = step.copies.tokens[i, :n].numpy()  # a host tensor (copies are made there)
    greedy, sampled = step.row_kinds
    return [
        np.array(choice.counts, dtype=np.int64),
        np.array(choice.use_ngram, dtype=np.bool_),
        copied,
        np.array(greedy, dtype=np.int64),
        np.array(sampled, dtype=np.int64),
    ]


def assemble_drafts(step: DecodeStep, chosen: list[torch.Tensor]) -> Drafts:
    """The drafts each row verifies, from its chosen proposer: the drafter's block for rows
    step.draft_span, else the row's n-gram copy. `chosen`: `choice_arrays(step)` on the device."""
    choice = step.choice
    assert choice is not None
    counts, from_ngram, copied, greedy_index, sampled_index = chosen
    r, k = len(choice.counts), max(choice.counts, default=0)
    draft, (a, b) = step.draft, step.draft_span
    device = counts.device
    tokens = torch.zeros(r, k, dtype=torch.long, device=device)
    token_probs = torch.ones(r, k, device=device)
    if draft is not None and k > 0:
        kd = min(k, step.drafter_slots)
        tokens[a:b, :kd] = draft.tokens[:, :kd]
        if draft.token_probs is not None:
            token_probs[a:b, :kd] = draft.token_probs[:, :kd].float()
    if choice.threshold is not None and draft is not None and draft.confidence is not None and k > 0:
        # The fixed policy: each drafter row up to its first doubtful draft, cut here on the device
        # (the counts come back with the step's results).
        kd = min(k, step.drafter_slots)
        confident = (draft.confidence[:, :kd] >= choice.threshold).long().cumprod(-1).sum(-1)
        counts[a:b] = torch.minimum(counts[a:b], confident)
    if copied.shape[1]:
        mask = from_ngram[:, None]
        tokens = torch.where(mask, copied, tokens)
        token_probs = torch.where(mask, torch.ones_like(token_probs), token_probs)
    greedy, sampled = step.row_kinds
    return Drafts(tokens, token_probs, counts, from_ngram, choice, greedy, greedy_index, sampled, sampled_index)


def accept(
    scores: torch.Tensor, step: DecodeStep, draft_vocab_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [R], token after them [R]) from the target's processed scores [R, k + 1, V].

    Greedy rows accept while the draft is the argmax; sampling rows run the speculative-sampling
    test with the row's uniforms (`step.draws`: one per test, one for the final token), against the
    drafter's distributions where it drafted and a one-hot for copies. Both tests run over every
    row and each row takes its kind's result: fixed shapes, no gather of rows by kind and no device
    read (which a CUDA graph could not hold); a batch of one kind, known on the host, skips the
    other's work."""
    drafts, sampling = step.drafts, step.sampling
    assert drafts is not None
    choice = drafts.choice
    r, k = drafts.tokens.shape
    if len(drafts.greedy_rows) == r:
        return verify_greedy(scores, drafts.tokens, drafts.counts)
    rows = drafts.sampled_rows
    dists = draft_dists(step.draft, r, step.draft_span, k)
    if dists is None and any(choice.counts[i] and not choice.use_ngram[i] for i in rows):
        raise ValueError("sampling rows that verify the drafter's drafts need its distributions")
    # Greedy rows go through the sampling test at temperature 1 (their result is replaced); whether
    # top-k/top-p run is the sampling rows' call.
    temperature = torch.where(sampling.greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    params = None if sampling.host_params is None else [sampling.host_params[i] for i in rows]
    p = processed_probs(scores, temperature, sampling.top_k, sampling.top_p, params)
    accepted, bonus = verify_sampling(
        p,
        drafts.tokens,
        drafts.token_probs,
        dists,
        drafts.counts,
        step.draws.acceptance_tests(step.uniforms, k),
        step.draws.final_token(step.uniforms),
        draft_vocab_ids,
        onehot=drafts.from_ngram if any(choice.use_ngram[i] for i in rows) else None,
    )
    if drafts.greedy_rows:
        greedy_accepted, greedy_bonus = verify_greedy(scores, drafts.tokens, drafts.counts)
        greedy = sampling.greedy
        accepted = torch.where(greedy, greedy_accepted, accepted)
        bonus = torch.where(greedy, greedy_bonus, bonus)
    return accepted, bonus


def draft_dists(draft: Proposal | None, rows: int, span: tuple[int, int], k: int) -> torch.Tensor | None:
    """The drafter's distributions [rows, k, Vd] for every row of the step (the drafter drafted rows
    span[0]..span[1]-1; the others get zeros), or None when it gave none."""
    if draft is None or draft.draft_probs is None or k == 0:
        return None
    a, b = span
    probs = draft.draft_probs
    d = probs.shape[1]
    if a == 0 and b == rows and k <= d:
        return probs[:, :k]
    full = probs.new_zeros(rows, k, probs.shape[-1])
    kd = min(k, d)
    full[a:b, :kd] = probs[:, :kd]
    return full
