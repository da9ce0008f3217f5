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
    drafter's distributions where it drafted and a one-hot for copies. Which rows are greedy is known
    on the host, so no device read decides which branch runs."""
    drafts, sampling = step.drafts, step.sampling
    assert drafts is not None
    choice = drafts.choice
    r, k = drafts.tokens.shape
    dev = scores.device
    if len(drafts.greedy_rows) == r:  # all greedy: no scatter into place
        return verify_greedy(scores, drafts.tokens, drafts.counts)
    accepted = torch.zeros(r, dtype=torch.long, device=dev)
    bonus = torch.zeros(r, dtype=torch.long, device=dev)
    if drafts.greedy_rows:
        g = drafts.greedy_index
        accepted[g], bonus[g] = verify_greedy(scores[g], drafts.tokens[g], drafts.counts[g])
    s, rows = drafts.sampled_index, drafts.sampled_rows
    params = None if sampling.host_params is None else [sampling.host_params[i] for i in rows]
    p = processed_probs(scores[s], sampling.temperature[s], sampling.top_k[s], sampling.top_p[s], params)
    uniforms = step.uniforms[s]
    dists = draft_dists(step.draft, rows, s, step.draft_span, k)
    if dists is None and any(choice.counts[i] and not choice.use_ngram[i] for i in rows):
        raise ValueError("sampling rows that verify the drafter's drafts need its distributions")
    accepted[s], bonus[s] = verify_sampling(
        p,
        drafts.tokens[s],
        drafts.token_probs[s],
        dists,
        drafts.counts[s],
        step.draws.acceptance_tests(uniforms, k),
        step.draws.final_token(uniforms),
        draft_vocab_ids,
        onehot=drafts.from_ngram[s] if any(choice.use_ngram[i] for i in rows) else None,
    )
    return accepted, bonus


def draft_dists(
    draft: Proposal | None, idx: list[int], s: torch.Tensor, span: tuple[int, int], k: int
) -> torch.Tensor | None:
    """The drafter's distributions [S, k, Vd] for sampling rows idx (on the device: s); rows it did
    not draft get zeros."""
    if draft is None or draft.draft_probs is None or k == 0:
        return None
    a, b = span
    d = draft.tokens.shape[1]
    if k <= d and all(a <= i < b for i in idx):
        return draft.draft_probs[s - a, :k]
    full = draft.draft_probs.new_zeros(len(idx), k, draft.draft_probs.shape[-1])
    kd = min(k, d)
    for j, i in enumerate(idx):
        if a <= i < b:
            full[j, :kd] = draft.draft_probs[i - a, :kd]
    return full
