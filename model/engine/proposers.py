"""Who proposes a step's drafts (docs/design.md §3): a `DraftProposer` drafts a block per row (the
Domino/DFlash drafter, or a test's or benchmark's oracle in its place), and `NgramProposer` copies
what followed the row's latest n-gram earlier in its own prompt and output (prompt lookup).

The engine asks both each step (model/engine/policy.py then chooses, per row, which proposal to verify and
how much of it); neither touches the target or the rows' state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from model.engine.ngram import NgramProposal
from model.engine.row import Row
from model.engine.sampling import SamplingBatch
from model.kv.draft_cache import DraftContextCache
from model.nn.drafter import Drafter, DraftResult

if TYPE_CHECKING:
    from model.engine.static import StaticSteps


class DraftProposer(Protocol):
    def propose(
        self, lo: int, rows: Sequence[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> DraftResult:
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

    def propose(
        self, lo: int, rows: Sequence[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> DraftResult:
        if self.static is not None and lo == 0 and sampling.all_greedy and num_slots == self.num_drafts:
            drafted = self.static.run_propose(anchors)
            if drafted is not None:
                return DraftResult(drafted[0], drafted[1], None, drafted[2])
        return self.draft_block(lo, anchors, sampling, num_slots)

    def draft_block(
        self, lo: int, anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int, static: bool = False
    ) -> DraftResult:
        """The drafter over `[anchor, MASK, ...]` blocks for slots lo.., then its draft choice."""
        block = torch.full(
            (anchors.shape[0], self.drafter.config.block_size), self.mask_token_id, dtype=torch.long, device=self.device
        )
        block[:, 0] = anchors
        # Hidden states up to the last slot drafted.
        needed = self.drafter.config.first_draft_position + num_slots
        hidden = self.drafter.forward_block(self.cache, lo, block, static=static, num_outputs=needed)
        return self.drafter.draft(hidden, anchors, sampling, num_slots=num_slots, use_head=self.use_head)

    def static_block(self, anchors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Greedy drafts of a full block for slots 0..R-1 with fixed shapes (the static bucket's body)."""
        greedy = SamplingBatch.all_greedy_rows(anchors.shape[0], anchors.device)
        draft = self.draft_block(0, anchors, greedy, self.num_drafts, static=True)
        return draft.tokens, draft.token_probs, draft.confidence


class NgramProposer:
    """Prompt-lookup copies from each row's own prompt and output (model/engine/ngram.py)."""

    def propose(self, rows: Sequence[Row], budgets: list[int], width: int) -> list[NgramProposal | None]:
        """Each row's copy of at most `width` tokens within its budget, or None."""
        out: list[NgramProposal | None] = []
        for row, budget in zip(rows, budgets):
            index = row.ngram
            if index is None or width == 0 or budget == 0:
                out.append(None)
                continue
            # Catch the index up with what was committed since (prompt first, then the output).
            seen, plen = len(index), len(row.prompt_ids)
            if seen < plen:
                index.extend(row.prompt_ids[seen:])
                seen = plen
            index.extend(row.output_ids[seen - plen :])
            out.append(index.propose(min(width, budget)))
        return out
