"""What the draft policy (model/engine/policy.py) knows from measurement: step costs and acceptance.

- `StepCosts`: verify and draft times by batch size and width, with a prior curve per device and
  dtype until cells are measured.
- `AcceptanceCalibration`: P(a drafter draft is accepted | the drafter's confidence).
- `NgramAcceptance`: P(an n-gram copy's slot is accepted | the match length).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

# Verify cost relative to T = 1, used until the engine has measured its own (and always for sampling
# rows, whose draft counts must not depend on timings). Where the target's matmuls are bound by
# reading the weights (bf16 on a GPU, or on a CPU with native bf16) a forward over up to ~17 tokens
# per row costs about one over a single token; fp32 GEMMs on a CPU slow down with every row
# (bench.verify_cost; the fp32 curve is a 135M target on a 2-core CPU at context 300).
# A curve is keyed by the tokens in one forward (batch x T): at batch 1 that is T; a same-batch
# estimate scales by it too, since a forward's cost follows its total tokens. The CPU bf16 curve
# is bench.verify_cost on a 2-core AVX512-BF16 CPU with the folded grouped-query attention
# (model/nn/attention.py), fitted to batches 1, 4 and 8 (bench/results/verify_cost_batch*_round6.md):
# batch 8 at T = 2 costs 1.14x T = 1 (1.67x before the attention stopped copying the cache).
CPU_FP32_VERIFY_CURVE = {1: 1.0, 2: 1.09, 4: 1.48, 8: 1.77, 9: 1.84, 16: 1.94, 17: 2.12}
CPU_BF16_VERIFY_CURVE = {1: 1.0, 2: 1.01, 4: 1.07, 8: 1.2, 16: 1.38, 24: 1.56, 40: 1.97, 72: 2.85}
BANDWIDTH_BOUND_VERIFY_CURVE = {1: 1.0, 2: 1.02, 4: 1.05, 9: 1.12, 17: 1.3, 33: 1.9}
# Packed int4 weights (DOMINO_DTYPE=int4, model/nn/packed.py), the embedded default at context 300,
# one thread. The int4 kernel's time grows with its rows where bf16's stayed flat. With native bf16
# (AVX-512 BF16): T = 2 1.17x, T = 3 1.35x (served), T = 5-8 42-49 ms against ~21.7 ms (the
# docs' int4 section). Without (AVX2 only, bench.verify_cost --dtypes float32,int4): the kernel
# works in blocks of 4 rows (T = 4 1.3x, T = 5 1.8x), past 11 rows the float32 copy.
CPU_INT4_VERIFY_CURVE = {1: 1.0, 2: 1.17, 3: 1.35, 5: 1.94, 8: 2.26, 12: 3.2}
CPU_INT4_FP32_VERIFY_CURVE = {1: 1.0, 2: 1.08, 3: 1.15, 4: 1.3, 5: 1.85, 8: 2.1, 12: 2.95, 16: 3.45, 24: 4.3}
PRIOR_VERIFY_CURVE = CPU_FP32_VERIFY_CURVE
PRIOR_DRAFT_FRACTION = 0.15  # drafter step cost relative to a T = 1 verify

VerifyCurve = dict[int, float]


def prior_curve_for(device: torch.device | str, dtype: torch.dtype, int4: bool = False) -> VerifyCurve:
    """The prior verify-cost curve of a target on `device` in `dtype` (activations'; `int4`: its
    decoder on packed int4 weights)."""
    if str(device).startswith("cuda"):
        return BANDWIDTH_BOUND_VERIFY_CURVE
    if int4:
        return CPU_INT4_VERIFY_CURVE if dtype in (torch.bfloat16, torch.float16) else CPU_INT4_FP32_VERIFY_CURVE
    return CPU_BF16_VERIFY_CURVE if dtype in (torch.bfloat16, torch.float16) else CPU_FP32_VERIFY_CURVE


def prior_verify(tokens: int, curve: VerifyCurve = PRIOR_VERIFY_CURVE) -> float:
    """Piecewise-linear interpolation of a prior curve (linear extrapolation past its last point)."""
    xs = sorted(curve)
    if tokens <= xs[0]:
        return curve[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if tokens <= hi:
            w = (tokens - lo) / (hi - lo)
            return curve[lo] * (1 - w) + curve[hi] * w
    lo, hi = xs[-2], xs[-1]
    slope = (curve[hi] - curve[lo]) / (hi - lo)
    return curve[hi] + slope * (tokens - hi)


TRUSTED_SAMPLES = 3  # measurements of a (batch, T) cell before it is believed over the prior's shape


class StepCosts:
    """Measured verify and draft times by batch size and T.

    Each cell's estimate is a low quantile of its last `window` samples: on a shared machine
    interference only ever adds time, so a low quantile follows the machine's own speed where a
    moving average follows every stall (and one stall of a T = 3 forward would make drafting look
    dear for many steps)."""

    def __init__(self, window: int = 16, quantile: float = 0.25, prior: VerifyCurve = PRIOR_VERIFY_CURVE) -> None:
        self.prior = prior
        self.window = window
        self.quantile = quantile
        self.verify_s: dict[tuple[int, int], float] = {}
        self.draft_s: dict[int, float] = {}
        self.verify_n: dict[tuple[int, int], int] = {}  # samples per cell (all time)
        self.draft_n: dict[int, int] = {}
        self._recent_verify: dict[tuple[int, int], deque[float]] = {}  # the last `window` samples per cell
        self._recent_draft: dict[int, deque[float]] = {}
        # `verify_row`'s answers until an estimate moves: the policy asks for a batch's whole row
        # of widths every step, and most steps leave every cell's low quantile where it was.
        self._rows: dict[tuple[int, int], np.ndarray] = {}

    def _observe(self, table: dict, counts: dict, samples: dict, key: object, seconds: float) -> None:
        counts[key] = counts.get(key, 0) + 1
        recent = samples.setdefault(key, deque(maxlen=self.window))
        recent.append(seconds)
        ordered = sorted(recent)
        value = ordered[int(self.quantile * (len(ordered) - 1))]
        if table.get(key) != value:
            table[key] = value
            self._rows.clear()

    def observe_verify(self, batch: int, tokens: int, seconds: float) -> None:
        self._observe(self.verify_s, self.verify_n, self._recent_verify, (batch, tokens), seconds)

    def observe_draft(self, batch: int, seconds: float) -> None:
        self._observe(self.draft_s, self.draft_n, self._recent_draft, batch, seconds)

    def seed(self, verify: dict[tuple[int, int], list[float]], draft: dict[int, list[float]]) -> None:
        """Cells measured before serving (model/engine/cost_probe.py): batch 1 and the largest batch
        at every verify width, so that every cell in between is interpolated (`_verify_estimate`)."""
        for (batch, tokens), samples in verify.items():
            for seconds in samples:
                self.observe_verify(batch, tokens, seconds)
        for batch, samples in draft.items():
            for seconds in samples:
                self.observe_draft(batch, seconds)

    def verify(self, batch: int, tokens: int) -> float:
        """Seconds for a verify forward; unmeasured cells scale a measured one by the prior curve.

        Never more than a measured forward over more tokens at this batch size: one noisy sample
        must not make a short verify look dearer than a long one (the policy would then never try,
        and never measure, the short one)."""
        longer = [s for (b, t), s in self.verify_s.items() if b == batch and t > tokens]
        estimate = self._verify_estimate(batch, tokens)
        if 0 < self.verify_n.get((batch, tokens), 0) < TRUSTED_SAMPLES:
            # A cell measured once or twice (maybe in a noisy moment) may not look dearer than a
            # well-measured one scaled by the prior curve: else it is never tried, never re-measured.
            trusted = [(t, s) for (b, t), s in self.verify_s.items() if b == batch and t != tokens]
            trusted = [(t, s) for t, s in trusted if self.verify_n[(batch, t)] >= TRUSTED_SAMPLES]
            if trusted:
                t, s = max(trusted, key=lambda ts: self.verify_n[(batch, ts[0])])
                estimate = min(estimate, s * self._prior_ratio(batch, tokens, t))
        return min([estimate, *longer])

    def verify_row(self, batch: int, widths: int) -> np.ndarray:
        """[widths] `verify(batch, t)` for t = 1..widths, kept until an estimate moves (not kept
        while a cell of this batch has fewer than TRUSTED_SAMPLES samples: `verify` then also
        weighs the cells' sample counts, which change every step)."""
        row = self._rows.get((batch, widths))
        if row is not None:
            return row
        row = np.array([self.verify(batch, t) for t in range(1, widths + 1)])
        if all(n >= TRUSTED_SAMPLES for (b, _), n in self.verify_n.items() if b == batch):
            self._rows[(batch, widths)] = row
        return row

    def _verify_estimate(self, batch: int, tokens: int) -> float:
        if (batch, tokens) in self.verify_s:
            return self.verify_s[(batch, tokens)]
        between = self._interpolated(batch, tokens)
        if between is not None:
            return between
        same_batch = [(t, s) for (b, t), s in self.verify_s.items() if b == batch]
        if same_batch:
            t, s = min(same_batch, key=lambda ts: abs(ts[0] - tokens))
            return s * self._prior_ratio(batch, tokens, t)
        if self.verify_s:
            # Another batch size: assume cost grows with the total tokens in the forward.
            (b, t), s = min(self.verify_s.items(), key=lambda kv: abs(kv[0][0] - batch))
            return s * prior_verify(batch * tokens, self.prior) / prior_verify(b * t, self.prior)
        return prior_verify(batch * tokens, self.prior)

    def _interpolated(self, batch: int, tokens: int) -> float | None:
        """Linear between measured cells around (batch, tokens): in the batch at a measured T, then in
        T between two such. A forward's cost grows about linearly in both (the weights read once,
        then per row and per token), where one curve by batch x T alone put a batch of 8 over
        3 tokens each at the cost of 24 tokens in one row (~1.25x too dear on a CPU). None unless
        measured cells surround the cell."""

        def at_width(t: int) -> float | None:
            measured = sorted(b for b, tt in self.verify_s if tt == t)
            below = [b for b in measured if b <= batch]
            above = [b for b in measured if b >= batch]
            if not below or not above:
                return None
            lo, hi = below[-1], above[0]
            if lo == hi:
                return self.verify_s[(lo, t)]
            w = (batch - lo) / (hi - lo)
            return self.verify_s[(lo, t)] * (1 - w) + self.verify_s[(hi, t)] * w

        here = at_width(tokens)
        if here is not None:
            return here
        widths = sorted({t for _, t in self.verify_s})
        below = [(t, c) for t in widths if t < tokens and (c := at_width(t)) is not None]
        above = [(t, c) for t in widths if t > tokens and (c := at_width(t)) is not None]
        if not below or not above:
            return None
        (t0, c0), (t1, c1) = below[-1], above[0]
        return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)

    def _prior_ratio(self, batch: int, tokens: int, measured: int) -> float:
        """Prior cost of T = tokens over T = measured at one batch size (by tokens per forward)."""
        return prior_verify(batch * tokens, self.prior) / prior_verify(batch * measured, self.prior)

    def draft(self, batch: int) -> float:
        if batch in self.draft_s:
            return self.draft_s[batch]
        if self.draft_s:
            b, s = min(self.draft_s.items(), key=lambda kv: abs(kv[0] - batch))
            return s * batch / b
        return PRIOR_DRAFT_FRACTION * self.verify(batch, 1)


class AcceptanceCalibration:
    """P(a greedy draft is accepted | the drafter's confidence), learned from this engine's verify steps.

    A drafter's top probability is an over-confident guess of acceptance when its training data is
    thin (the shipped SmolLM2 drafter reports ~0.6 where ~0.2 is accepted), and a look-ahead rule fed
    raw confidences keeps paying for rejected drafts. Each verified greedy slot that was reached (all
    earlier drafts accepted) adds one observation to its confidence bin; the estimate is the bin's
    acceptance rate, shrunk towards the raw confidence while the bin has few observations, and old
    observations fade so the estimate follows the traffic. Used for greedy rows only: their output
    does not depend on the draft count, so a batch-wide estimate cannot change what they emit.
    """

    def __init__(self, bins: int = 20, prior_weight: float = 2.0, decay: float = 0.998) -> None:
        self.bins = bins
        self.prior_weight = prior_weight
        self.decay = decay
        # Host arrays: the policy's arithmetic is a few dozen numbers per step, where a torch op's
        # dispatch costs more than the op (NumPy throughout the policy, issue 54).
        self.reached = np.zeros(bins)
        self.accepted = np.zeros(bins)

    def _bin(self, confidence: np.ndarray) -> np.ndarray:
        return np.minimum((np.clip(confidence.astype(np.float64), 0, 1) * self.bins).astype(np.int64), self.bins - 1)

    def observe(self, confidence: np.ndarray, num_drafts: np.ndarray, accepted: np.ndarray) -> None:
        """confidence [R, k] of the verified slots, num_drafts [R] verified per row, accepted [R]."""
        if confidence.size == 0:
            return
        slot = np.arange(confidence.shape[1])[None, :]
        reached = (slot < num_drafts[:, None]) & (slot <= accepted[:, None])
        hit = slot < accepted[:, None]
        bins = self._bin(confidence)[reached]
        self.reached *= self.decay
        self.reached += np.bincount(bins, minlength=self.bins)
        self.accepted *= self.decay
        self.accepted += np.bincount(bins, weights=hit[reached].astype(np.float64), minlength=self.bins)

    def calibrate(self, confidence: np.ndarray) -> np.ndarray:
        """Estimated acceptance probability for each confidence (same shape and dtype)."""
        raw = confidence.astype(np.float64)
        b = self._bin(raw)
        rate = (self.accepted[b] + self.prior_weight * raw) / (self.reached[b] + self.prior_weight)
        return rate.astype(confidence.dtype)


class NgramAcceptance:
    """P(n-gram draft at slot j is accepted | slot j reached, the match had length n), learned from
    verify steps with old observations fading, like `AcceptanceCalibration` for the drafter.

    An estimate shrinks towards `prior` (another `NgramAcceptance`, e.g. the engine-wide one under a
    row's own, or a constant while nothing was seen) in proportion to how little was observed.
    """

    def __init__(self, max_n: int, max_slots: int, prior_weight: float = 2.0, decay: float = 0.99) -> None:
        self.prior_weight = prior_weight
        self.decay = decay
        self.reached = np.zeros((max_n + 1, max_slots))
        self.accepted = np.zeros((max_n + 1, max_slots))

    def fade(self, factor: float) -> None:
        """Age the evidence without new observations (estimates drift back to their prior, so a
        match length that once failed is tried again later)."""
        self.reached *= factor
        self.accepted *= factor

    def observe(self, match_len: int, verified: int, accepted: int) -> None:
        """One verify step of one row: `verified` n-gram drafts, the first `accepted` accepted."""
        if verified <= 0:
            return
        reached = min(verified, accepted + 1)  # slots after the first rejection were never tested
        self.fade(self.decay)
        self.reached[match_len, :reached] += 1
        self.accepted[match_len, :accepted] += 1

    def estimate(self, match_len: int, slots: int, prior: np.ndarray | float, fade: float | None = None) -> np.ndarray:
        """Per-slot acceptance estimates [slots] for a match of length `match_len`; prior [slots] or a
        number. `fade`: as if `fade(fade)` had been called first (a query that leaves the record as it is)."""
        reached, acc = self.reached[match_len, :slots], self.accepted[match_len, :slots]
        if fade is not None:
            reached, acc = reached * fade, acc * fade
        return (acc + self.prior_weight * prior) / (reached + self.prior_weight)


NGRAM_PRIOR = 0.3  # acceptance of an n-gram draft before anything was observed (any value in (0, 1) is lossless)
