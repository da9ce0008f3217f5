"""How many drafts to verify per step: the drafter's own confidence against measured step costs.

A verify forward over T tokens per row costs more than one over a single token (a little where the
target's matmuls are bound by reading weights: GPUs, bf16 on a CPU with native bf16; a lot for fp32
on a CPU). A block only pays when enough of it is accepted, so
each step picks the draft count k that maximises expected committed tokens per second:

    rate(k) = sum_r (1 + E_r(k)) / (t_draft(R) + t_verify(R, k + 1)),
    E_r(k)  = sum_{i<=k} prod_{j<=i} c_{r,j}   (c = the drafter's probability of its own draft j),

and compares it with plain decoding, rate_ar = R / t_verify(R, 1). That look-ahead choice is only
used for greedy rows, whose output does not depend on how many drafts are verified. Sampling rows
use a row-local stopping rule (`stopping_drafts`) that is lossless and independent of the batch.

N-gram copies (model/engine/ngram.py) are a second, free proposal: `NgramAcceptance` learns their
acceptance per match length and slot from verify steps, which gives their E_r(k) in the same
formula; greedy rows take the better proposal at the chosen width, sampling rows choose from what
is known before their first draft is drawn (`DraftPolicy.choose`).

The measured side (step costs, calibration, copy acceptance) is in model/engine/costs.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model.engine.costs import (
    NGRAM_PRIOR,
    PRIOR_DRAFT_FRACTION,
    PRIOR_VERIFY_CURVE,
    TRUSTED_SAMPLES,
    AcceptanceCalibration,
    NgramAcceptance,
    StepCosts,
    VerifyCurve,
    prior_verify,
)
from model.engine.ngram import NgramProposal
from model.engine.row import Row

PAUSE_MIN, PAUSE_MAX = 8, 64  # steps of plain decoding after drafting stopped paying
# Per decode step, the engine-wide record of n-gram acceptance ages by this factor (half-life
# ~350 steps without copies), so a match length written off on old text is tried again.
NGRAM_FADE = 0.998


@dataclass
class NgramPlan:
    tokens: list[int]  # the copy proposed
    match_len: int
    accept: torch.Tensor  # [len(tokens)] estimated acceptance of each slot once reached


@dataclass
class StepChoice:
    """Drafts verified per row this step, and whether they are the row's n-gram copy (else the drafter's)."""

    counts: list[int]
    use_ngram: list[bool]


class DraftPolicy:
    """Which rows run the drafter and how many drafts each row verifies, step by step.

    `adaptive` weighs expected accepted drafts against measured step costs (module docstring);
    `fixed` verifies every drafter draft up to the first below `draft_threshold`, else the copy.
    The engine tells it what happened (`observe_*`); everything it learns lives here.
    """

    def __init__(
        self,
        adaptive: bool,
        num_drafts: int,
        draft_threshold: float,
        ngram_max_n: int,
        ngram_max_drafts: int,
        prior: VerifyCurve = PRIOR_VERIFY_CURVE,
    ) -> None:
        self.adaptive = adaptive
        self.num_drafts = num_drafts  # drafter slots per block (the most it can propose)
        self.draft_threshold = draft_threshold
        self.prior = prior
        self.costs = StepCosts(prior=prior)
        self.calibration = AcceptanceCalibration()
        # Observed acceptance of greedy rows' copies, by match length and slot (engine-wide).
        self.ngram_acceptance = NgramAcceptance(ngram_max_n, max(ngram_max_drafts, 1))
        self.ngram_prior = NGRAM_PRIOR  # acceptance assumed before any copy was verified
        self.drafter_gain: float | None = None  # recent expected accepted drafts per drafted row
        self.skip_steps = 0  # steps left to decode without drafting, after drafting stopped paying
        self.no_gain_streak = 0
        self.pause_len = PAUSE_MIN  # doubles while probes keep finding that drafting does not pay
        self.draft_width = num_drafts  # slots drafted per step under the adaptive policy
        self.plain_probes: dict[int, int] = {}  # plain steps taken per batch size to measure them

    def on_admit(self) -> None:
        """New requests joined: their text may suit the drafter better, so probe again soon."""
        self.pause_len = PAUSE_MIN
        self.skip_steps = min(self.skip_steps, PAUSE_MIN)

    def plain_probe(self, batch: int, greedy_rows: list[bool]) -> bool:
        """Decode this step without drafts, to measure a plain step at this batch size. Every width
        is judged against it, and a cost never measured is a prior's guess that drafting may never
        correct (it keeps drafting, so never measures the plain step). Greedy batches only: their
        output does not depend on it."""
        if not (self.adaptive and all(greedy_rows)):
            return False
        if self.costs.verify_n.get((batch, 1), 0) >= TRUSTED_SAMPLES:
            return False
        if self.plain_probes.get(batch, 0) >= TRUSTED_SAMPLES:
            return False
        self.plain_probes[batch] = self.plain_probes.get(batch, 0) + 1
        return True

    def slots_to_draft(self, full: bool) -> int:
        """Drafter slots to run this step (`full`: every slot, e.g. under a seeded row)."""
        return self.num_drafts if full or not self.adaptive else self.draft_width

    def ngram_plans(
        self, rows: Sequence[Row], proposals: Sequence[NgramProposal | None], width: int
    ) -> list[NgramPlan | None]:
        """Each row's n-gram proposal (model/engine/proposers.py) with its expected acceptance per slot:
        greedy rows shrink their own record towards the engine-wide one; sampling rows use their own
        record only, so a seeded row decides the same in any batch."""
        if width:
            self.ngram_acceptance.fade(NGRAM_FADE)
        plans: list[NgramPlan | None] = []
        for row, proposal in zip(rows, proposals):
            record = row.ngram_acceptance
            if proposal is None or record is None:
                plans.append(None)
                continue
            n, slots = proposal.match_len, len(proposal.tokens)
            if not row.params.greedy:
                est = record.estimate(n, slots, self.ngram_prior)
            else:
                est = record.estimate(n, slots, self.ngram_acceptance.estimate(n, slots, self.ngram_prior))
            plans.append(NgramPlan(proposal.tokens, n, est.float()))
        return plans

    def drafter_rows(self, r: int, d: int, any_seeded: bool, plans: list[NgramPlan | None]) -> tuple[int, int] | None:
        """Rows a..b-1 that run the drafter this step (one contiguous span of slots), or None."""
        if d == 0:
            return None
        if any_seeded:
            # A seeded row's choice must not depend on the batch: draft every row, never pause.
            return 0, r
        if self.skip_steps > 0:
            self.skip_steps -= 1
            return None
        if not self.adaptive or self.drafter_gain is None:
            return 0, r
        # Rows whose n-gram match is expected to accept at least what the drafter lately did skip it.
        want = [
            i
            for i, plan in enumerate(plans)
            if plan is None or float(expected_accepted(plan.accept[None])[0, -1]) < self.drafter_gain
        ]
        return (min(want), max(want) + 1) if want else None

    def choose(
        self,
        plans: list[NgramPlan | None],
        confidence: torch.Tensor | None,
        span: tuple[int, int],
        budgets: list[int],
        greedy_rows: list[bool],
        full: bool,
    ) -> StepChoice:
        """Drafts per row: `confidence` [b - a, d] of the drafter's block for rows span = (a, b), or
        None when the drafter did not run this step."""
        r = len(plans)
        a, b = span
        d = confidence.shape[1] if confidence is not None else 0
        conf = confidence.float().cpu() if confidence is not None else torch.zeros(0, 0)
        ngram_len = [len(p.tokens) if p is not None else 0 for p in plans]
        in_span = [confidence is not None and a <= i < b for i in range(r)]
        if not self.adaptive:
            choice = self._choose_fixed(conf, in_span, a, ngram_len, budgets)
        else:
            choice = StepChoice([0] * r, [False] * r)
            self._choose_sampling_rows(choice, plans, conf, in_span, a, budgets, greedy_rows)
            self._choose_greedy_rows(
                choice, plans, conf, span if confidence is not None else None, budgets, greedy_rows
            )
        if confidence is not None:
            used = max([choice.counts[i] for i in range(a, b) if not choice.use_ngram[i]], default=0)
            self._adapt_drafting(used, d, full)
        return choice

    def _choose_fixed(
        self, conf: torch.Tensor, in_span: list[bool], a: int, ngram_len: list[int], budgets: list[int]
    ) -> StepChoice:
        """The drafter's block wherever it ran (up to the first doubtful slot), else the copy."""
        r = len(in_span)
        choice = StepChoice([0] * r, [False] * r)
        confident = (conf >= self.draft_threshold).long().cumprod(-1).sum(-1).tolist()
        for i in range(r):
            if in_span[i]:
                choice.counts[i] = min(confident[i - a], budgets[i])
            elif ngram_len[i]:
                choice.counts[i], choice.use_ngram[i] = ngram_len[i], True
        return choice

    def _choose_sampling_rows(
        self,
        choice: StepChoice,
        plans: list[NgramPlan | None],
        conf: torch.Tensor,
        in_span: list[bool],
        a: int,
        budgets: list[int],
        greedy_rows: list[bool],
    ) -> None:
        """A row-local, lossless rule. The count of each proposer is a stopping time of its own
        draft sequence (`stopping_drafts`); which proposer is chosen depends only on what is known
        before the first draft is drawn: the copy and its estimates, and the drafter's first-slot
        confidence (later slots may depend on drawn drafts)."""
        for i, plan in enumerate(plans):
            if greedy_rows[i]:
                continue
            n_count, rate_n = 0, 0.0
            if plan is not None:
                n_count = int(stopping_drafts(plan.accept[None], torch.tensor([len(plan.tokens)]), 0.0, self.prior)[0])
                rate_n = float(prior_rate(plan.accept[None], torch.tensor([n_count]), 0.0, self.prior)[0])
            if in_span[i]:
                c = conf[i - a]
                geometric = c[:1].expand(c.shape[0])[None]
                g_count = stopping_drafts(geometric, torch.tensor([budgets[i]]), 0.0, self.prior)
                rate_d = float(prior_rate(geometric, g_count, 0.0, self.prior)[0])
                if plan is not None and n_count > 0 and rate_n > rate_d:
                    choice.counts[i], choice.use_ngram[i] = n_count, True
                else:
                    choice.counts[i] = int(stopping_drafts(c[None], torch.tensor([budgets[i]]), curve=self.prior)[0])
            elif n_count > 0:
                choice.counts[i], choice.use_ngram[i] = n_count, True

    def _choose_greedy_rows(
        self,
        choice: StepChoice,
        plans: list[NgramPlan | None],
        conf: torch.Tensor,
        span: tuple[int, int] | None,
        budgets: list[int],
        greedy_rows: list[bool],
    ) -> None:
        """Greedy rows never change their output with the drafts, so choose for the batch: the
        shared width with the best expected token rate, each row taking the better proposer there."""
        greedy_idx = [i for i, g in enumerate(greedy_rows) if g]
        if not greedy_idx:
            return
        r, d = len(plans), conf.shape[1]
        ngram_len = [len(p.tokens) if p is not None else 0 for p in plans]
        width = max([d, *ngram_len])
        budget_t = torch.tensor(budgets)
        gain_d = torch.zeros(r, width + 1, dtype=torch.float64)
        if span is not None:
            a, b = span
            calibrated = self.calibration.calibrate(conf).double()
            gain_d[a:b] = capped_gain(expected_accepted(calibrated), width, budget_t[a:b])
            # What the drafter is expected to add per row at full width: rows whose copy promises
            # more skip the next drafter forward (`drafter_rows`).
            mean_gain = float(expected_accepted(calibrated)[:, -1].mean())
            self.drafter_gain = mean_gain if self.drafter_gain is None else 0.8 * self.drafter_gain + 0.2 * mean_gain
        gain_n = torch.zeros(r, width + 1, dtype=torch.float64)
        for i, plan in enumerate(plans):
            if plan is not None:
                gain_n[i] = capped_gain(expected_accepted(plan.accept[None].double()), width, torch.tensor([width]))[0]
        best = torch.maximum(gain_d[greedy_idx], gain_n[greedy_idx])
        draft_cost = self.costs.draft(span[1] - span[0]) if span is not None else 0.0
        shared, _rate = best_shared_width(best, self.costs, draft_cost)
        # Sampling rows may widen the forward: greedy rows use the padded width for free.
        k = max([shared, *choice.counts])
        if k == 0:
            return
        for i in greedy_idx:
            if gain_n[i, k] > gain_d[i, k]:
                choice.counts[i], choice.use_ngram[i] = min(k, ngram_len[i]), True
            elif gain_d[i, k] > 0:
                choice.counts[i] = min(k, d, budgets[i])

    def _adapt_drafting(self, used: int, d: int, full: bool) -> None:
        """After a drafter forward that had `used` of its `d` slots verified (at most, over rows)."""
        if not self.adaptive:
            return
        if used == 0:
            # Speculation did not pay for several steps running: decode plainly for a while.
            # (A decision from past steps only, so it is lossless for sampling rows too.)
            # The first pause needs 3 such steps; a probe after a pause needs one, and
            # each failed probe doubles the next pause (a drafter that never pays costs
            # one draft every PAUSE_MAX steps).
            self.no_gain_streak += 1
            if self.no_gain_streak >= (3 if self.pause_len == PAUSE_MIN else 1):
                self.skip_steps, self.no_gain_streak = self.pause_len, 0
                self.pause_len = min(2 * self.pause_len, PAUSE_MAX)
        else:
            self.no_gain_streak = 0
            self.pause_len = PAUSE_MIN
        # Draft only as many slots as the policy has lately used (logits and head steps
        # for slots that are never verified are wasted): grow when all were used.
        if used >= d and self.draft_width < self.num_drafts:
            self.draft_width += 1
        elif used <= d - 2 and not full:
            self.draft_width = max(1, self.draft_width - 1)

    # -- what happened ------------------------------------------------------------------------
    def observe_drafter(self, confidence: torch.Tensor, num_drafts: torch.Tensor, accepted: torch.Tensor) -> None:
        """Greedy rows that verified the drafter's drafts: confidence [R, k], verified [R], accepted [R]."""
        self.calibration.observe(confidence, num_drafts, accepted)

    def observe_ngram(self, row: Row, plan: NgramPlan, verified: int, accepted: int, greedy: bool) -> None:
        """A row verified `verified` drafts of its copy and accepted the first `accepted`."""
        if row.ngram_acceptance is not None:
            row.ngram_acceptance.observe(plan.match_len, verified, accepted)
        if greedy:
            self.ngram_acceptance.observe(plan.match_len, verified, accepted)


def expected_accepted(confidence: torch.Tensor) -> torch.Tensor:
    """E_r(k) for k = 0..D from per-slot confidences [R, D]: returns [R, D + 1]."""
    survive = confidence.clamp(0, 1).cumprod(-1)
    zeros = torch.zeros(confidence.shape[0], 1, dtype=survive.dtype, device=survive.device)
    return torch.cat([zeros, survive.cumsum(-1)], dim=-1)


def capped_gain(gain: torch.Tensor, width: int, limit: torch.Tensor) -> torch.Tensor:
    """E_r(min(k, limit_r)) for k = 0..width from gains [R, D + 1]: [R, width + 1]."""
    ks = torch.arange(width + 1, device=gain.device)
    idx = torch.minimum(ks[None, :], limit[:, None].clamp(0, gain.shape[1] - 1))
    return gain.gather(1, idx)


def best_shared_width(gain: torch.Tensor, costs: StepCosts, draft_cost: float) -> tuple[int, float]:
    """The shared verify width k with the highest expected token rate given each row's expected
    accepted drafts at width k, gain [R, W + 1] (already capped by budget and proposal length)."""
    r, w1 = gain.shape
    tokens = (r + gain.sum(0)).tolist()
    rates = [tokens[k] / (draft_cost + costs.verify(r, k + 1)) for k in range(w1)]
    best = max(range(w1), key=lambda k: rates[k])
    return best, rates[best]


def best_shared_drafts(confidence: torch.Tensor, budget: torch.Tensor, costs: StepCosts) -> tuple[int, float]:
    """The draft count k (shared by the batch) with the highest expected token rate, and that rate."""
    r, d = confidence.shape
    gain = capped_gain(expected_accepted(confidence), d, budget)  # a row can't use more than its budget
    return best_shared_width(gain, costs, costs.draft(r))


def prior_rate(
    confidence: torch.Tensor, count: torch.Tensor, draft_cost: float, curve: VerifyCurve = PRIOR_VERIFY_CURVE
) -> torch.Tensor:
    """Expected tokens per unit of prior batch-1 step cost [R] when verifying count [R] drafts."""
    gain = expected_accepted(confidence).gather(1, count[:, None].long()).squeeze(1)
    cost = torch.tensor([draft_cost + prior_verify(int(k) + 1, curve) for k in count.tolist()], dtype=gain.dtype)
    return (1 + gain) / cost.to(gain.device)


def stopping_drafts(
    confidence: torch.Tensor,
    budget: torch.Tensor,
    draft_cost: float = PRIOR_DRAFT_FRACTION,
    curve: VerifyCurve = PRIOR_VERIFY_CURVE,
) -> torch.Tensor:
    """Per-row draft count by a stopping rule, for sampling rows.

    Slot i is verified only while the expected rate (prior batch-1 costs) does not drop by adding
    it; the test at slot i uses confidences of slots <= i only, all known before draft i is drawn.
    That makes the count a stopping time of the draft sequence, which keeps speculative sampling
    lossless, and it depends on the row alone, so a seeded request decides the same in any batch.
    """
    r, d = confidence.shape
    gain = expected_accepted(confidence)  # [R, D + 1]
    cost = torch.tensor([draft_cost + prior_verify(k + 1, curve) for k in range(d + 1)], dtype=gain.dtype)
    rate = (1 + gain) / cost.to(gain.device)
    keeps_paying = (rate[:, 1:] >= rate[:, :-1]).long().cumprod(-1)
    return torch.minimum(keeps_paying.sum(-1), budget.clamp_min(0))
