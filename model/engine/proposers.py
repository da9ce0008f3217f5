"""Who proposes a step's drafts (docs/design.md §3): a `DraftProposer` drafts a block per row (the
Domino/DFlash drafter, or a test's or benchmark's oracle in its place), and `NgramProposer` copies
what followed the row's latest n-gram earlier in its own prompt and output (prompt lookup).

The engine asks both each step (model/engine/policy.py then chooses, per row, which proposal to verify and
how much of it); neither touches the target or the rows' state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from model.engine.row import Row
from model.engine.sampling import SamplingBatch
from model.kv.draft_cache import DraftContextCache
from model.nn.drafter import Drafter, DraftResult

if TYPE_CHECKING:
    from model.engine.static import StaticSteps


@dataclass
class Proposal:
    """Drafts one proposer offers a run of rows: the one type every proposer returns, whatever it is
    (the drafter's block, an n-gram copy, a test's oracle). Row i here is the i-th row it was asked
    about."""

    tokens: torch.Tensor  # [R, k] draft ids (on the device from a drafter, on the host for copies)
    token_probs: torch.Tensor | None = None  # [R, k] its probability of each draft (None: 1, a copy)
    draft_probs: torch.Tensor | None = None  # [R, k, V] its distribution per slot (sampling rows; V: draft vocab)
    confidence: torch.Tensor | None = None  # [R, k] its own estimate that each draft is right, before the draw
    counts: list[int] | None = None  # drafts offered per row, on the host (None: k for every row)
    match_lens: list[int] | None = None  # copies: the length of the n-gram each row matched

    def count(self, i: int) -> int:
        """Drafts offered to row i."""
        return self.tokens.shape[1] if self.counts is None else self.counts[i]

    def select(self, a: int, b: int, k: int) -> Proposal:
        """Rows a..b-1 and their first k drafts."""

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[a:b, :k]

        return Proposal(
            self.tokens[a:b, :k],
            cut(self.token_probs),
            cut(self.draft_probs),
            cut(self.confidence),
            None if self.counts is None else [min(n, k) for n in self.counts[a:b]],
            None if self.match_lens is None else self.match_lens[a:b],
        )

    @classmethod
    def of_draft(cls, draft: DraftResult) -> Proposal:
        """The drafter network's block (model/nn/drafter.py) as a proposal."""
        return cls(draft.tokens, draft.token_probs, draft.draft_probs, draft.confidence)


class DraftProposer(Protocol):
    def propose(
        self, lo: int, rows: Sequence[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> Proposal:
        """Drafts for the first `num_slots` slots of one block per row, for the rows in cache slots
        lo.. (`anchors` [R]: each row's last committed token)."""
        ...


class DrafterProposer:
    """The drafter's block: backbone over `[anchor, MASK, ...]` with the row's context, then the
    Domino head (or none, for DFlash). A full greedy block at slot 0 uses the static bucket when the
    engine built one (`static`, set after warm-up)."""

    def __init__(
        self, drafter: Drafter, cache: DraftContextCache, num_drafts: int, use_head: bool, device: torch.device
    ) -> None:
        self.drafter = drafter
        self.cache = cache
        self.num_drafts = num_drafts
        self.use_head = use_head
        self.device = device
        cfg = drafter.config
        self.mask_token_id = cfg.mask_token_id if cfg.mask_token_id is not None else 0
        self.static: StaticSteps | None = None
        # The sampling buckets' distributions [rows, D, V], one buffer for all of them (a step
        # replays one, and its distributions are read before the next step's): `reserve_dists`.
        self.dists: torch.Tensor | None = None

    def reserve_dists(self, max_rows: int) -> None:
        """The shared buffer of the sampling buckets' distributions, for up to `max_rows` rows."""
        shape = (max_rows, self.num_drafts, self.drafter.config.draft_vocab)
        self.dists = torch.empty(shape, dtype=torch.float32, device=self.device)

    def propose(
        self, lo: int, rows: Sequence[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> Proposal:
        if self.static is not None and lo == 0:
            positions = max(self.cache.host_lengths[: anchors.shape[0]]) + self.drafter.config.block_size
            if sampling.all_greedy and num_slots == self.num_drafts:
                drafted = self.static.run_propose(anchors, positions)
                if drafted is not None:
                    return Proposal(drafted[0], drafted[1], None, drafted[2])
            elif not sampling.all_greedy and sampling.uniforms is not None and sampling.host_params is not None:
                # Sampling rows: a full block in the bucket, its first `num_slots` slots kept (a slot's
                # draft depends on earlier slots and its own uniform only, so they are what
                # drafting `num_slots` would give).
                filters = sampling.needs_filters(self.drafter.config.draft_vocab)
                drafted = self.static.run_propose_sampled(anchors, sampling, positions, filters)
                if drafted is not None:
                    tokens, token_probs, confidence, dists = drafted
                    return Proposal(tokens, token_probs, dists, confidence).select(0, anchors.shape[0], num_slots)
        return Proposal.of_draft(self.draft_block(lo, anchors, sampling, num_slots))

    def draft_block(
        self,
        lo: int,
        anchors: torch.Tensor,
        sampling: SamplingBatch,
        num_slots: int,
        span: int | None = None,
        dists_out: torch.Tensor | None = None,
    ) -> DraftResult:
        """The drafter over `[anchor, MASK, ...]` blocks for slots lo.., then its draft choice."""
        block = torch.full(
            (anchors.shape[0], self.drafter.config.block_size), self.mask_token_id, dtype=torch.long, device=self.device
        )
        block[:, 0] = anchors
        # Hidden states up to the last slot drafted.
        needed = self.drafter.config.first_draft_position + num_slots
        hidden = self.drafter.forward_block(self.cache, lo, block, span=span, num_outputs=needed)
        return self.drafter.draft(
            hidden, anchors, sampling, num_slots=num_slots, use_head=self.use_head, dists_out=dists_out
        )

    def static_block(self, anchors: torch.Tensor, span: int) -> tuple[torch.Tensor, ...]:
        """Greedy drafts of a full block for slots 0..R-1 with fixed shapes, attending over `span`
        positions (the static bucket's body)."""
        greedy = SamplingBatch.all_greedy_rows(anchors.shape[0], anchors.device)
        draft = self.draft_block(0, anchors, greedy, self.num_drafts, span=span)
        return draft.tokens, draft.token_probs, draft.confidence

    def static_sampled_block(
        self,
        anchors: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        uniforms: torch.Tensor,
        span: int,
        filters: bool,
    ) -> tuple[torch.Tensor, ...]:
        """Drafts of a full block for sampling (and greedy: temperature 0) rows 0..R-1 with fixed
        shapes: the rows' parameters [R] and uniforms [R, D] are the bucket's inputs, `filters`
        fixes whether the top-k/top-p masks run. Returns tokens, their probabilities, confidences
        and the distributions (a view of the shared buffer, `reserve_dists`)."""
        assert self.dists is not None, "reserve_dists first"
        sampling = SamplingBatch(temperature, top_p, top_k, uniforms, host_all_greedy=False, filters=filters)
        out = self.dists[: anchors.shape[0]]
        draft = self.draft_block(0, anchors, sampling, self.num_drafts, span=span, dists_out=out)
        assert draft.draft_probs is not None
        return draft.tokens, draft.token_probs, draft.confidence, draft.draft_probs


class NgramProposer:
    """Prompt-lookup copies from each row's own prompt and output (model/engine/ngram.py)."""

    def propose(self, rows: Sequence[Row], budgets: list[int], width: int) -> Proposal | None:
        """Each row's copy of at most `width` tokens within its budget (a count of 0: none); None
        when no copy may be proposed this step. The tokens stay on the host until one is chosen."""
        if width == 0:
            return None
        tokens = [[0] * width for _ in rows]
        counts, match_lens = [0] * len(rows), [0] * len(rows)
        for i, (row, budget) in enumerate(zip(rows, budgets)):
            index = row.ngram
            if index is None or budget == 0:
                continue
            # Catch the index up with what was committed since (prompt first, then the output).
            seen, plen = len(index), len(row.prompt_ids)
            if seen < plen:
                index.extend(row.prompt_ids[seen:])
                seen = plen
            index.extend(row.output_ids[seen - plen :])
            copy = index.propose(min(width, budget))
            if copy is not None:
                tokens[i][: len(copy.tokens)] = copy.tokens
                counts[i], match_lens[i] = len(copy.tokens), copy.match_len
        return Proposal(torch.tensor(tokens, dtype=torch.long), counts=counts, match_lens=match_lens)
