"""How many drafts to verify per step: the drafter's own confidence against measured step costs.

A verify forward over T tokens per row costs more than one over a single token (a little where the
target's matmuls are bound by reading weights: GPUs, bf16 on a CPU with native bf16; a lot for fp32
on a CPU). A block only pays when enough of it is accepted, so
each step picks the draft count k that maximises expected committed tokens per second:

    rate(k) = sum_r (1 + E_r(k)) / (t_draft(R) + t_verify(R, k + 1)),
    E_r(k)  = sum_{i<=k} prod_{j<=i} c_{r,j}   (c = the drafter's probability of its own draft j),

and compares it with plain decoding, rate_ar = R / t_verify(R, 1). The choice is made
from the host before this step's drafts exist (the confidences of each row's previous block), so
it is lossless for sampling rows too: greedy rows and sampling rows without a seed choose together,
each kind with its own calibration of confidence against acceptance. A seeded sampling row uses a
row-local stopping rule (`stopping_drafts`) on the prior curve instead, independent of the batch
and of measured timings, so that its seed gives the same text in any batch.

N-gram copies (model/engine/ngram.py) are a second, free proposal: `NgramAcceptance` learns their
acceptance per match length and slot from verify steps, which gives their E_r(k) in the same
formula; rows take the better proposal at the chosen width (`DraftPolicy.choose`).

The measured side (step costs, calibration, copy acceptance) is in model/engine/costs.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
from model.engine.proposers import Proposal
from model.engine.row import Row
from model.engine.step import DecodeStep, StepChoice, StepPlan

PAUSE_MIN, PAUSE_MAX = 8, 64  # steps of plain decoding after drafting stopped paying
# Per decode step, the engine-wide record of n-gram acceptance ages by this factor (half-life
# ~350 steps without copies), so a match length written off on old text is tried again.
NGRAM_FADE = 0.998
# The confidence per slot expected of a row the drafter has not drafted for yet: the start of the
# policy's running average over rows, and a seeded row's forecast (which must not depend on others).
UNSEEN_CONFIDENCE = 0.6
RECENT_WEIGHT = 0.2  # weight of a step's rows in the running average of the drafter's confidence


class DraftPolicy:
    """Which rows run the drafter and how many drafts each row verifies, step by step.

    `adaptive` weighs expected accepted drafts against measured step costs (module docstring);
    `fixed` verifies every drafter draft up to the first below `draft_threshold`, else the copy.
    The engine asks (`plan`, `copy_estimates`, `drafter_rows`, `choose`: queries that change nothing)
    and then tells it what happened (`observe`, `on_admit`, and the measured costs in `costs`);
    everything it learns lives here.
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
        self.calibration = AcceptanceCalibration()  # greedy rows: is a draft the target's argmax?
        self.sampling_calibration = AcceptanceCalibration()  # sampling rows: does the speculative test pass?
        # Observed acceptance of greedy rows' copies, by match length and slot (engine-wide).
        self.ngram_acceptance = NgramAcceptance(ngram_max_n, max(ngram_max_drafts, 1))
        self.ngram_prior = NGRAM_PRIOR  # acceptance assumed before any copy was verified
        self.drafter_gain: float | None = None  # recent expected accepted drafts per drafted row
        self.skip_steps = 0  # steps left to decode without drafting, after drafting stopped paying
        self.no_gain_streak = 0
        self.pause_len = PAUSE_MIN  # doubles while probes keep finding that drafting does not pay
        self.draft_width = num_drafts  # slots drafted per step under the adaptive policy
        self.plain_probes: dict[int, int] = {}  # plain steps taken per batch size to measure them
        # The drafter's confidence per slot, averaged over the rows it drafted lately (`forecast`).
        self.recent_confidence = np.full(num_drafts, UNSEEN_CONFIDENCE, dtype=np.float32)

    def on_admit(self) -> None:
        """New requests joined: their text may suit the drafter better, so probe again soon. The
        pause's length stays: one drafting step that pays resets it, one that does not pauses
        again at once for longer. (Reset here, every admission cost three drafting steps that did
        not pay before the next pause: at concurrency 8, where requests join every few steps and
        drafts cost a step's worth, `domino` ran 7 % below `ar` with 8 % of its steps drafting.)"""
        self.skip_steps = min(self.skip_steps, PAUSE_MIN)

    # -- plans: queries, no state changes ---------------------------------------------------------
    def plan(self, greedy_rows: list[bool], any_seeded: bool) -> StepPlan:
        """What a step does before anything is proposed: a plain probe, or drafter slots to run."""
        full = any_seeded or not self.adaptive
        probe = self._plain_probe(len(greedy_rows), any_seeded)
        slots = 0 if probe else (self.num_drafts if full or not self.adaptive else self.draft_width)
        return StepPlan(probe=probe, drafter_slots=slots, full=full, any_seeded=any_seeded)

    def _plain_probe(self, batch: int, any_seeded: bool) -> bool:
        """Decode this step without drafts, to measure a plain step at this batch size. Every width
        is judged against it, and a cost never measured is a prior's guess that drafting may never
        correct (it keeps drafting, so never measures the plain step). Not under a seeded row, whose
        draft counts must not depend on the batch."""
        if not self.adaptive or any_seeded:
            return False
        if self.costs.verify_n.get((batch, 1), 0) >= TRUSTED_SAMPLES:
            return False
        return self.plain_probes.get(batch, 0) < TRUSTED_SAMPLES

    def copy_estimates(self, rows: Sequence[Row], copies: Proposal | None, width: int) -> list[np.ndarray | None]:
        """Each row's n-gram copy's expected acceptance per slot: greedy rows shrink their own record
        towards the engine-wide one (as aged by this step, `observe`); sampling rows use their own
        record only, so a seeded row decides the same in any batch."""
        out: list[np.ndarray | None] = []
        fade = NGRAM_FADE if width else None
        for i, row in enumerate(rows):
            record = row.ngram_acceptance
            slots = copies.count(i) if copies is not None else 0
            if slots == 0 or record is None:
                out.append(None)
                continue
            assert copies is not None and copies.match_lens is not None
            n = copies.match_lens[i]
            if not row.params.greedy:
                est = record.estimate(n, slots, self.ngram_prior)
            else:
                est = record.estimate(n, slots, self.ngram_acceptance.estimate(n, slots, self.ngram_prior, fade))
            out.append(est.astype(np.float32))
        return out

    def drafter_rows(self, step: DecodeStep) -> tuple[int, int] | None:
        """Rows a..b-1 that run the drafter this step (one contiguous span of slots), or None."""
        if step.plan.drafter_slots == 0:
            return None
        if step.plan.any_seeded:
            # A seeded row's choice must not depend on the batch: draft every row, never pause.
            return 0, len(step.rows)
        if self.skip_steps > 0:
            return None
        if not self.adaptive or self.drafter_gain is None:
            return 0, len(step.rows)
        # Rows whose n-gram match is expected to accept at least what the drafter lately did skip it.
        want = [
            i
            for i, est in enumerate(step.copy_accept)
            if est is None or float(expected_accepted(est[None])[0, -1]) < self.drafter_gain
        ]
        return (min(want), max(want) + 1) if want else None

    def choose(self, step: DecodeStep) -> StepChoice:
        """Drafts per row, from the host alone: the step's copies and, for rows step.draft_span
        that the drafter is about to draft, their drafter's confidences at their previous block
        (`forecast`). Nothing of this step's device values is read, so the step's results are its
        one device->host copy; the drafter's confidence moves slowly from block to block."""
        r = len(step.rows)
        a, b = step.draft_span
        d = step.drafter_slots if b > a else 0
        conf = self.forecast(step.rows[a:b], d)
        copy_len = [step.copies.count(i) if step.copies is not None else 0 for i in range(r)]
        in_span = [a <= i < b and d > 0 for i in range(r)]
        if not self.adaptive:
            choice = self._choose_fixed(d, in_span, copy_len, step.budgets)
        else:
            choice = StepChoice([0] * r, [False] * r)
            seeded = [row.params.seeded for row in step.rows]
            self._choose_seeded_rows(choice, step, conf, in_span, seeded)
            self._choose_batch_rows(choice, step, conf, copy_len, d > 0, seeded)
        if d > 0:
            choice.drafter_used = max([choice.counts[i] for i in range(a, b) if not choice.use_ngram[i]], default=0)
        return choice

    def forecast(self, rows: Sequence[Row], d: int) -> np.ndarray:
        """[R, d] the confidences expected of the drafter's next block for `rows`: each row's own at
        its last block (slots past it, and rows with none yet, from the recent average of all
        rows; a seeded row's from a constant, so that it decides the same in any batch)."""
        out = np.empty((len(rows), d), dtype=np.float32)
        for i, row in enumerate(rows):
            out[i] = UNSEEN_CONFIDENCE if row.params.seeded else self.recent_confidence[:d]
            own = row.draft_confidence
            if own is not None:
                n = min(d, own.shape[0])
                out[i, :n] = own[:n]
        return out

    def _choose_fixed(self, d: int, in_span: list[bool], copy_len: list[int], budgets: list[int]) -> StepChoice:
        """The drafter's block wherever it runs, cut on the device at the first draft below the
        threshold (`StepChoice.threshold`), else the copy."""
        r = len(in_span)
        choice = StepChoice([0] * r, [False] * r, threshold=self.draft_threshold)
        for i in range(r):
            if in_span[i]:
                choice.counts[i] = min(d, budgets[i])
            elif copy_len[i]:
                choice.counts[i], choice.use_ngram[i] = copy_len[i], True
        return choice

    def _choose_seeded_rows(
        self, choice: StepChoice, step: DecodeStep, conf: np.ndarray, in_span: list[bool], seeded: list[bool]
    ) -> None:
        """Seeded sampling rows, by a row-local rule on the prior curve: the count of each proposer
        comes from the row's forecast (`stopping_drafts`), the choice between them from the copy's
        estimates and the forecast's first slot, nothing from the batch or measured timings."""
        a = step.draft_span[0]
        for i, est in enumerate(step.copy_accept):
            if not seeded[i]:
                continue
            n_count, rate_n = 0, 0.0
            if est is not None:
                n_count = int(stopping_drafts(est[None], np.array([est.shape[0]]), 0.0, self.prior)[0])
                rate_n = float(prior_rate(est[None], np.array([n_count]), 0.0, self.prior)[0])
            if in_span[i]:
                c = conf[i - a]
                budget = step.budgets[i]
                geometric = np.broadcast_to(c[:1], c.shape)[None]
                g_count = stopping_drafts(geometric, np.array([budget]), 0.0, self.prior)
                rate_d = float(prior_rate(geometric, g_count, 0.0, self.prior)[0])
                if est is not None and n_count > 0 and rate_n > rate_d:
                    choice.counts[i], choice.use_ngram[i] = n_count, True
                else:
                    choice.counts[i] = int(stopping_drafts(c[None], np.array([budget]), curve=self.prior)[0])
            elif n_count > 0:
                choice.counts[i], choice.use_ngram[i] = n_count, True

    def _choose_batch_rows(
        self,
        choice: StepChoice,
        step: DecodeStep,
        conf: np.ndarray,
        copy_len: list[int],
        drafted: bool,
        seeded: list[bool],
    ) -> None:
        """Greedy rows and sampling rows without a seed choose for the batch: the shared width with
        the best expected token rate at the measured costs, each row taking the better proposer there."""
        idx = [i for i in range(len(step.rows)) if not seeded[i]]
        if not idx:
            return
        r, d = len(step.rows), conf.shape[1]
        width = max([d, *copy_len])
        gain_d = np.zeros((r, width + 1))
        a, b = step.draft_span
        if drafted:
            greedy_span = np.array(step.greedy_rows[a:b])[:, None]
            calibrated = np.where(
                greedy_span, self.calibration.calibrate(conf), self.sampling_calibration.calibrate(conf)
            ).astype(np.float64)
            expected = expected_accepted(calibrated)
            gain_d[a:b] = capped_gain(expected, width, np.array(step.budgets[a:b]))
            # What the drafter is expected to add per row at full width (`observe` keeps its average:
            # rows whose copy promises more skip the next drafter forward, `drafter_rows`).
            choice.drafter_gain = float(expected[:, -1].mean())
        gain_n = np.zeros((r, width + 1))
        for i, est in enumerate(step.copy_accept):
            if est is not None:
                gain_n[i] = capped_gain(expected_accepted(est[None].astype(np.float64)), width, np.array([width]))[0]
        draft_cost = self.costs.draft(b - a) if drafted else 0.0
        best = np.maximum(gain_d[idx], gain_n[idx])
        shared, _rate = best_shared_width(best, self.costs, draft_cost)
        # Seeded rows may widen the forward: the others use the padded width for free.
        k = max([shared, *choice.counts])
        if k == 0:
            return
        for i in idx:
            if gain_n[i, k] > gain_d[i, k]:
                choice.counts[i], choice.use_ngram[i] = min(k, copy_len[i]), True
            elif gain_d[i, k] > 0:
                choice.counts[i] = min(k, d, step.budgets[i])

    # -- what happened ------------------------------------------------------------------------------
    def observe(self, step: DecodeStep) -> None:
        """Learn from a finished step: the plan it ran, the choice it made and what was accepted."""
        plan, choice, results = step.plan, step.choice, step.results
        assert choice is not None and results is not None and step.drafts is not None
        if plan.probe:
            self.plain_probes[len(step.rows)] = self.plain_probes.get(len(step.rows), 0) + 1
        if plan.drafter_slots and not plan.any_seeded and self.skip_steps > 0:
            self.skip_steps -= 1  # a paused step (`drafter_rows`)
        if step.ngram_width:
            self.ngram_acceptance.fade(NGRAM_FADE)
        if choice.drafter_gain is not None:
            gain = choice.drafter_gain
            self.drafter_gain = gain if self.drafter_gain is None else 0.8 * self.drafter_gain + 0.2 * gain
        if step.draft is not None:
            self._adapt_drafting(choice.drafter_used, plan.drafter_slots, plan.full)
            self._observe_drafter(step)
        if step.copies is not None and step.copies.match_lens is not None:
            for i, row in enumerate(step.rows):
                if choice.use_ngram[i] and choice.counts[i] > 0 and step.copy_accept[i] is not None:
                    match_len, verified, accepted = step.copies.match_lens[i], choice.counts[i], results.accepted[i]
                    if row.ngram_acceptance is not None:
                        row.ngram_acceptance.observe(match_len, verified, accepted)
                    if row.params.greedy:
                        self.ngram_acceptance.observe(match_len, verified, accepted)

    def _observe_drafter(self, step: DecodeStep) -> None:
        """Keep the drafter's confidences as its rows' forecasts, and calibrate them on the rows
        that verified its drafts, greedy and sampling rows apart (all on the host: read with the
        step's results)."""
        assert step.draft is not None and step.choice is not None and step.results is not None
        results = step.results
        confidence = results.confidence
        assert confidence is not None  # the engine checks every proposal for it (`Engine._draft`)
        a, b = step.draft_span
        host = confidence
        for i in range(a, b):
            step.rows[i].draft_confidence = host[i - a]
        d = host.shape[1]
        if d and b > a:
            recent = self.recent_confidence[:d]
            recent += RECENT_WEIGHT * (host.mean(0) - recent)
        assert step.drafts is not None
        k = step.drafts.tokens.shape[1]
        if k == 0:
            return
        for greedy, calibration in ((True, self.calibration), (False, self.sampling_calibration)):
            mine = [i for i in range(a, b) if step.greedy_rows[i] == greedy and not step.choice.use_ngram[i]]
            if mine:
                rows = np.array([i - a for i in mine])
                counts = np.array([results.counts[i] for i in mine])
                accepted = np.array([results.accepted[i] for i in mine])
                calibration.observe(confidence[rows, : min(k, d)], counts, accepted)

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


def expected_accepted(confidence: np.ndarray) -> np.ndarray:
    """E_r(k) for k = 0..D from per-slot confidences [R, D]: returns [R, D + 1]."""
    survive = np.clip(confidence, 0, 1).cumprod(-1)
    return np.concatenate([np.zeros((confidence.shape[0], 1), dtype=survive.dtype), survive.cumsum(-1)], axis=-1)


def capped_gain(gain: np.ndarray, width: int, limit: np.ndarray) -> np.ndarray:
    """E_r(min(k, limit_r)) for k = 0..width from gains [R, D + 1]: [R, width + 1]."""
    idx = np.minimum(np.arange(width + 1)[None, :], np.clip(limit, 0, gain.shape[1] - 1)[:, None])
    return gain[np.arange(gain.shape[0])[:, None], idx]


def best_shared_width(gain: np.ndarray, costs: StepCosts, draft_cost: float) -> tuple[int, float]:
    """The shared verify width k with the highest expected token rate given each row's expected
    accepted drafts at width k, gain [R, W + 1] (already capped by budget and proposal length)."""
    r, w1 = gain.shape
    rates = (r + gain.sum(0)) / (draft_cost + costs.verify_row(r, w1))
    best = int(np.argmax(rates))  # the first of equals: the narrowest
    return best, float(rates[best])


def best_shared_drafts(confidence: np.ndarray, budget: np.ndarray, costs: StepCosts) -> tuple[int, float]:
    """The draft count k (shared by the batch) with the highest expected token rate, and that rate."""
    r, d = confidence.shape
    gain = capped_gain(expected_accepted(confidence), d, budget)  # a row can't use more than its budget
    return best_shared_width(gain, costs, costs.draft(r))


def prior_rate(
    confidence: np.ndarray, count: np.ndarray, draft_cost: float, curve: VerifyCurve = PRIOR_VERIFY_CURVE
) -> np.ndarray:
    """Expected tokens per unit of prior batch-1 step cost [R] when verifying count [R] drafts."""
    gain = expected_accepted(confidence)[np.arange(confidence.shape[0]), count.astype(np.int64)]
    cost = np.array([draft_cost + prior_verify(int(k) + 1, curve) for k in count])
    return (1 + gain) / cost


def stopping_drafts(
    confidence: np.ndarray,
    budget: np.ndarray,
    draft_cost: float = PRIOR_DRAFT_FRACTION,
    curve: VerifyCurve = PRIOR_VERIFY_CURVE,
) -> np.ndarray:
    """Per-row draft count by a stopping rule, for sampling rows.

    Slot i is verified only while the expected rate (prior batch-1 costs) does not drop by adding
    it; the test at slot i uses confidences of slots <= i only, all known before draft i is drawn.
    That makes the count a stopping time of the draft sequence, which keeps speculative sampling
    lossless, and it depends on the row alone, so a seeded request decides the same in any batch.
    """
    r, d = confidence.shape
    gain = expected_accepted(confidence)  # [R, D + 1]
    cost = np.array([draft_cost + prior_verify(k + 1, curve) for k in range(d + 1)])
    rate = (1 + gain) / cost
    keeps_paying = (rate[:, 1:] >= rate[:, :-1]).astype(np.int64).cumprod(-1)
    return np.minimum(keeps_paying.sum(-1), np.maximum(budget, 0))
