"""The rejection sampler (docs/design.md §1.4): the drafts each row verifies, assembled from its
chosen proposal, and which of them the target accepts, greedy or by speculative sampling, with the
bonus token after the last accepted one. Pure tensor work over one step: no rows, no caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.engine.policy import NgramPlan, StepChoice
from model.engine.sampling import SamplingBatch, processed_probs, verify_greedy, verify_sampling
from model.nn.drafter import DraftResult


@dataclass
class Proposals:
    """One step's proposals: each row's n-gram copy, and the drafter's block for rows span[0]..span[1]-1."""

    plans: list[NgramPlan | None]
    draft: DraftResult | None  # None: the drafter did not run this step
    span: tuple[int, int]


@dataclass
class Drafts:
    """What one step verifies, per row."""

    tokens: torch.Tensor  # [R, k] drafts (padding past a row's count is verified but never counted)
    token_probs: torch.Tensor  # [R, k] the proposer's probability of each draft (1 for a copy)
    counts: torch.Tensor  # [R] drafts verified
    from_ngram: torch.Tensor  # [R] bool: the drafts are the row's n-gram copy


def assemble_drafts(proposals: Proposals, choice: StepChoice, d: int, device: torch.device) -> Drafts:
    """The drafts each row verifies, from its chosen proposer (`d`: the drafter's slots this step)."""
    r, k = len(choice.counts), max(choice.counts, default=0)
    draft, (a, b) = proposals.draft, proposals.span
    tokens = torch.zeros(r, k, dtype=torch.long, device=device)
    token_probs = torch.ones(r, k, device=device)
    if draft is not None and k > 0:
        kd = min(k, d)
        tokens[a:b, :kd] = draft.tokens[:, :kd]
        token_probs[a:b, :kd] = draft.token_probs[:, :kd].float()
    from_ngram = torch.tensor(choice.use_ngram, dtype=torch.bool)
    if k > 0 and bool(from_ngram.any()):
        copied = torch.zeros(r, k, dtype=torch.long)
        for i, plan in enumerate(proposals.plans):
            if choice.use_ngram[i] and plan is not None:
                copied[i, : choice.counts[i]] = torch.tensor(plan.tokens[: choice.counts[i]])
        mask = from_ngram.to(device)[:, None]
        tokens = torch.where(mask, copied.to(device), tokens)
        token_probs = torch.where(mask, torch.ones_like(token_probs), token_probs)
    counts = torch.tensor(choice.counts, dtype=torch.long, device=device)
    return Drafts(tokens, token_probs, counts, from_ngram.to(device))


def accept(
    scores: torch.Tensor,
    drafts: Drafts,
    sampling: SamplingBatch,
    uniforms: torch.Tensor,
    width: int,
    proposals: Proposals,
    any_greedy: bool,
    draft_vocab_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [R], bonus token [R]) from the target's processed scores [R, k + 1, V].

    Greedy rows accept while the draft is the argmax; sampling rows run the speculative-sampling
    test with the row's uniforms (`uniforms[:, width:width + k]` for the drafts, `[:, 2 * width]` for
    the final token), against the drafter's distributions where it drafted and a one-hot for copies.
    `any_greedy` is known on the host, so no device read decides which branch runs."""
    r, k = drafts.tokens.shape
    dev = scores.device
    accepted = torch.zeros(r, dtype=torch.long, device=dev)
    bonus = torch.zeros(r, dtype=torch.long, device=dev)
    greedy = sampling.greedy
    if any_greedy:
        g = greedy.nonzero().squeeze(1)
        accepted[g], bonus[g] = verify_greedy(scores[g], drafts.tokens[g], drafts.counts[g])
    if not sampling.all_greedy:
        s = (~greedy).nonzero().squeeze(1)
        draft, (a, b) = proposals.draft, proposals.span
        p = processed_probs(scores[s], sampling.temperature[s], sampling.top_k[s], sampling.top_p[s])
        accepted[s], bonus[s] = verify_sampling(
            p,
            drafts.tokens[s],
            drafts.token_probs[s],
            draft_dists(draft, s, a, b, draft.tokens.shape[1] if draft is not None else 0, k),
            drafts.counts[s],
            uniforms[s, width : width + k],
            uniforms[s, 2 * width],
            draft_vocab_ids,
            onehot=drafts.from_ngram[s],
        )
    return accepted, bonus


def draft_dists(draft: DraftResult | None, s: torch.Tensor, a: int, b: int, d: int, k: int) -> torch.Tensor | None:
    """The drafter's distributions [S, k, Vd] for sampling rows s (rows it did not draft: zeros)."""
    if draft is None or draft.draft_probs is None or k == 0:
        return None
    idx = s.tolist()
    if k <= d and all(a <= i < b for i in idx):
        return draft.draft_probs[s - a, :k]
    full = draft.draft_probs.new_zeros(len(idx), k, draft.draft_probs.shape[-1])
    kd = min(k, d)
    for j, i in enumerate(idx):
        if a <= i < b:
            full[j, :kd] = draft.draft_probs[i - a, :kd]
    return full
