"""One decode step as data: what the step works on, what each phase decided and what came of it.

The engine's phases (model/engine/engine.py: choose -> load -> draft -> verify -> accept -> emit) fill one
`DecodeStep`; the policy plans from it and observes it afterwards, the rejection sampler reads its
drafts and random draws. The layout of a row's random draws is named here, once (`DrawLayout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from model.engine.proposers import Proposal
from model.engine.requests import TokenLogprob
from model.engine.row import Row, draw_uniforms
from model.engine.sampling import SamplingBatch, host_params
from model.upload import upload


@dataclass(frozen=True)
class DrawLayout:
    """A row's uniforms for one step, `2 * width + 1` of them, in three parts: one per drafter slot
    (the drafter's own sampling), one per verified draft (the acceptance tests), one for the token
    drawn after the last accepted draft. A fixed count per step, whatever is verified, so a seeded
    row's stream is the same alone or in any batch."""

    width: int  # the most drafts a row may verify this step

    @property
    def per_row(self) -> int:
        return 2 * self.width + 1

    def draft_slots(self, uniforms: torch.Tensor, d: int) -> torch.Tensor:
        """[R, d] for the drafter's first d slots."""
        return uniforms[:, :d]

    def acceptance_tests(self, uniforms: torch.Tensor, k: int) -> torch.Tensor:
        """[R, k] for the tests of k verified drafts."""
        return uniforms[:, self.width : self.width + k]

    def final_token(self, uniforms: torch.Tensor) -> torch.Tensor:
        """[R] for the token after the last accepted draft."""
        return uniforms[:, 2 * self.width]


@dataclass
class StepPlan:
    """What the policy decided before anything was proposed (model/engine/policy.py: `plan`)."""

    probe: bool  # decode without drafts, to measure a plain step at this batch size
    drafter_slots: int  # slots the drafter runs (0: none)
    full: bool  # every slot drafted (a seeded sampling row, or the fixed policy)
    any_seeded: bool  # a seeded sampling row: its choices must not depend on the batch


@dataclass
class StepChoice:
    """Drafts verified per row this step, and whether they are the row's n-gram copy (else the drafter's),
    with what the policy will learn from the choice once the step is done."""

    counts: list[int]  # the most drafts each row verifies (exactly these unless `threshold` is set)
    use_ngram: list[bool]
    drafter_gain: float | None = None  # mean expected accepted drafts of the drafter's block
    drafter_used: int = 0  # the most drafter drafts any row verifies
    # The fixed policy: drafter rows verify their drafts up to the first whose confidence is below
    # this, cut on the device (model/engine/rejection.py); the counts come back with the results.
    threshold: float | None = None


@dataclass
class Drafts:
    """What one step verifies, per row, assembled from each row's chosen proposal."""

    tokens: torch.Tensor  # [R, k] drafts (padding past a row's count is verified but never counted)
    token_probs: torch.Tensor  # [R, k] the proposer's probability of each draft (1 for a copy)
    counts: torch.Tensor  # [R] drafts verified
    from_ngram: torch.Tensor  # [R] bool: the drafts are the row's n-gram copy
    choice: StepChoice  # the same counts and proposers on the host
    # Which rows are greedy and which sample, known on the host: index lists there and the same
    # indices on the device, so the acceptance test selects its rows without reading the device.
    greedy_rows: list[int]
    greedy_index: torch.Tensor  # [G] long
    sampled_rows: list[int]
    sampled_index: torch.Tensor  # [S] long


@dataclass
class StepResults:
    """A step's results on the host, per row: everything the engine and the policy learn from the
    step, read in one device->host copy."""

    accepted: list[int]
    bonus: list[int]
    counts: list[int]  # drafts verified
    new_tokens: list[list[int]] = field(default_factory=list)  # accepted drafts + bonus
    logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    confidence: np.ndarray | None = None  # [b - a, d] the drafter's confidences (float32), if it ran
    extra: list[int] = field(default_factory=list)  # the first tokens of the prompt chunks it carried

    @classmethod
    def read(
        cls,
        accepted: torch.Tensor,
        bonus: torch.Tensor,
        counts: torch.Tensor,
        drafts: torch.Tensor,
        confidence: torch.Tensor | None,
        extra: torch.Tensor | None = None,
    ) -> StepResults:
        """The results on the host in one copy: accepted, bonus, counts [R], drafts [R, k], the
        drafter's confidences [R', d] (rows 0..R'-1 of the span it drafted) and `extra` ids [E]
        (the first tokens of prompt chunks the step carried). Ids travel as float64, exact below
        2**53, so that one tensor holds them all."""
        ints = torch.cat([accepted[:, None], bonus[:, None], counts[:, None], drafts], dim=1)
        parts = [ints.double()]
        if confidence is not None:
            padded = confidence.new_zeros(ints.shape[0], confidence.shape[1], dtype=torch.float64)
            padded[: confidence.shape[0]] = confidence
            parts.append(padded)
        matrix = torch.cat(parts, dim=1)
        tail = extra.double() if extra is not None else matrix.new_zeros(0)
        flat = torch.cat([matrix.flatten(), tail]).cpu().numpy()
        host = flat[: matrix.numel()].reshape(matrix.shape)
        w = ints.shape[1]
        rows = host[:, :w].astype(np.int64).tolist()
        conf = host[: confidence.shape[0], w:].astype(np.float32) if confidence is not None else None
        return cls(
            accepted=[h[0] for h in rows],
            bonus=[h[1] for h in rows],
            counts=[h[2] for h in rows],
            new_tokens=[h[3 : 3 + h[0]] + [h[1]] for h in rows],
            confidence=conf,
            extra=flat[matrix.numel() :].astype(np.int64).tolist(),
        )


@dataclass
class DecodeStep:
    """Rows lo..hi-1 through one speculative step. The fields after `budgets` are filled phase by
    phase; the device side (anchors, sampling, uniforms) by `load`, once the choice is made."""

    lo: int
    hi: int
    rows: list[Row]
    draws: DrawLayout
    plan: StepPlan
    ngram_width: int  # most tokens an n-gram copy may propose
    greedy_rows: list[bool]
    budgets: list[int]  # tokens each row may still emit after this step's bonus
    # choose
    copies: Proposal | None = None  # each row's n-gram copy
    copy_accept: list[torch.Tensor | None] = field(default_factory=list)  # their estimated acceptance per slot
    draft_span: tuple[int, int] = (0, 0)  # the rows the drafter drafts
    choice: StepChoice | None = None
    # load
    anchors: torch.Tensor = field(init=False)  # [R] each row's last committed token
    sampling: SamplingBatch = field(init=False)  # the rows' parameters, with the drafter slots' uniforms
    uniforms: torch.Tensor = field(init=False)  # [R, draws.per_row]
    # draft
    draft: Proposal | None = None  # the drafter's block for rows draft_span (None: it did not run)
    drafts: Drafts | None = None
    # accept
    accepted: torch.Tensor | None = None  # [R] accepted drafts
    bonus: torch.Tensor | None = None  # [R] the token after them
    results: StepResults | None = None

    @classmethod
    def begin(cls, lo: int, hi: int, rows: list[Row], plan: StepPlan, ngram_width: int) -> DecodeStep:
        """Rows lo..hi-1 under `plan`, on the host."""
        return cls(
            lo=lo,
            hi=hi,
            rows=rows,
            draws=DrawLayout(max(plan.drafter_slots, ngram_width)),
            plan=plan,
            ngram_width=ngram_width,
            greedy_rows=[row.params.greedy for row in rows],
            budgets=[max(0, row.params.max_new_tokens - len(row.output_ids) - 1) for row in rows],
        )

    def load(self, device: torch.device, chosen: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Everything the step needs from the host, in one copy (model/upload.py): the anchors, the
        rows' random draws for the step (`DrawLayout`) and sampling parameters, and `chosen` (the
        choice's arrays, `rejection.choice_arrays`), which come back on the device."""
        params = [row.params for row in self.rows]
        anchors = np.array([row.anchor for row in self.rows], dtype=np.int64)
        uniforms = draw_uniforms(self.rows, self.draws.per_row)
        on_device = upload([anchors, uniforms, *host_params(params), *chosen], device)
        self.anchors, self.uniforms = on_device[0], on_device[1]
        slots = self.draws.draft_slots(self.uniforms, self.plan.drafter_slots)
        self.sampling = SamplingBatch.of_device_params(params, on_device[2:5], slots)
        return on_device[5:]

    @property
    def row_kinds(self) -> tuple[list[int], list[int]]:
        """The indices of the greedy rows and of the sampling rows."""
        greedy = [i for i, g in enumerate(self.greedy_rows) if g]
        return greedy, [i for i, g in enumerate(self.greedy_rows) if not g]

    @property
    def drafter_slots(self) -> int:
        return self.plan.drafter_slots
