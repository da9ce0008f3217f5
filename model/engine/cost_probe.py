"""Step costs measured on the device at start-up, so that the draft policy decides by this machine's
costs from the first request (issue 54).

The prior curves (model/engine/costs.py) are one CPU's or a class of GPUs', extrapolated linearly
past their last point: at batch 16 a GPU's prior put a 17-token verify at ~11x a one-token step
where the device pays ~1.3-2.5x, and the policy under-drafted exactly where batching makes drafts
cheap. Before the engine serves, `probe_step_costs` times verify forwards at batch 1 and at the
largest batch over every verify width (the static buckets where the engine built them, eager
forwards otherwise) and a drafter block per batch, over empty slots whose tables point at the
trash block (nothing a row owns is written) with `context` positions to attend over. `StepCosts.seed`
takes them as measured cells, and their curve by tokens per forward replaces the prior for the
cells in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

PROBE_CONTEXT = 256  # positions each probed row attends over (a short chat's context)


@dataclass
class CostProbe:
    """Seconds per forward measured at start-up, `reps` samples per cell."""

    verify: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (batch, T) -> samples
    draft: dict[int, list[float]] = field(default_factory=dict)  # batch -> samples (a full block)
    seconds: float = 0.0  # what the probe took

    def summary(self) -> str:
        """The start-up log's line: the cheapest sample per cell, in ms."""

        def ms(samples: list[float]) -> str:
            return f"{1e3 * min(samples):.1f}"

        verify = ", ".join(f"{b}x{t} {ms(s)}" for (b, t), s in sorted(self.verify.items()))
        draft = ", ".join(f"{b} {ms(s)}" for b, s in sorted(self.draft.items()))
        return f"step costs measured in {self.seconds:.1f} s (ms; verify batch x T: {verify}; draft by batch: {draft})"


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    """`reps` timings of fn() after one untimed call (first calls pay for allocation and kernel
    choice); on a GPU each between two synchronizations (start-up only: a step never syncs so)."""
    fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - t)
    return samples


@torch.inference_mode()
def probe_step_costs(
    verify: Callable[[torch.Tensor], object],
    draft: Callable[[torch.Tensor], object] | None,
    set_context: Callable[[int, int], None],
    batches: list[int],
    widths: list[int],
    device: torch.device,
    reps: int,
    vocab_size: int,
    context: int = PROBE_CONTEXT,
) -> CostProbe:
    """Time `verify(tokens [b, T])` for every b in `batches` and T in `widths`, and `draft(anchors
    [b])` per batch, `reps` times each; `set_context(b, n)` gives slots 0..b-1 n positions of
    context (`context` while probing, 0 after)."""
    start = time.perf_counter()
    probe = CostProbe()
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        set_context(b, context)
        try:
            for t in widths:
                tokens = torch.randint(vocab_size, (b, t), generator=gen).to(device)
                probe.verify[(b, t)] = timed(lambda tokens=tokens: verify(tokens), device, reps)
            if draft is not None:
                anchors = torch.randint(vocab_size, (b,), generator=gen).to(device)
                probe.draft[b] = timed(lambda anchors=anchors: draft(anchors), device, reps)
        finally:
            set_context(b, 0)
    probe.seconds = time.perf_counter() - start
    return probe


# A step that carries a prompt chunk may cost up to this many decode steps more than decoding alone,
# so that running streams wait at most ~(1 + CHUNK_STALL)x their usual gap while a prompt goes in.
CHUNK_STALL = 1.5
# Each step that carries chunks is held to (1 + STEP_STALL)x the streams' usual step (Engine._chunk_budget):
# under CHUNK_STALL because a busy CPU's step times spread some 15 % around the plan, and the streams' worst
# gap, not the typical one, must stay within 3x their usual gap (issue 53's target).
STEP_STALL = 1.25
FIRST_CHUNK = 64  # the smallest chunk probed, and the budget if even it costs more


@dataclass
class ChunkProbe:
    """The token budget chosen from one-row prompt chunks timed at start-up."""

    budget: int
    decode_seconds: float  # the decode step it was held against
    decode_shape: tuple[int, int]  # that step's rows x tokens
    chunk: dict[int, float] = field(default_factory=dict)  # tokens -> cheapest of the samples
    fixed_seconds: float = 0.0  # what any forward pays, extrapolated to a chunk of 0 tokens
    context: int = PROBE_CONTEXT  # positions before each probed chunk
    # The cost of a prompt token grows with the positions before it (its attention): FIRST_CHUNK
    # tokens timed after `far` positions too give the growth per position, relative to a token's
    # cost after `context` (0: not measured, chunks sized by tokens alone).
    far: int = 0
    growth: float = 0.0
    seconds: float = 0.0

    def summary(self) -> str:
        timed = ", ".join(f"{n} {1e3 * s:.0f}" for n, s in sorted(self.chunk.items()))
        rows, width = self.decode_shape
        return (
            f"chunked prefill: {self.budget} tokens a step (prompt chunks timed in {self.seconds:.1f} s, ms: {timed}; "
            f"the largest whose cost beyond the {1e3 * self.fixed_seconds:.0f} ms any forward pays is within "
            f"{CHUNK_STALL:g}x a decode step of {rows} rows x {width} tokens, {1e3 * self.decode_seconds:.0f} ms; "
            f"a token after {self.far} positions costs {1 + self.growth * (self.far - self.context):.2f}x one after "
            f"{self.context}, and chunks late in a long prompt are that much shorter)"
        )

    def cost(self, n: int, prefix: int) -> float:
        """What n prompt tokens after `prefix` positions cost, in tokens after the probe's context
        (what the budget counts): a chunk late in a long prompt attends over more, and costs more."""
        return n * (1.0 + self.growth * max(0.0, prefix + n / 2 - self.context))

    def tokens_within(self, budget: float, prefix: int) -> int:
        """The most tokens after `prefix` positions that `cost` puts within `budget` (at least 1)."""
        lo, hi = 1, max(1, int(budget))  # cost grows with n: the largest n in [lo, hi] that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost(mid, prefix) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def token_seconds(self) -> float:
        """What one more prompt token after the probe's context costs (the 64-128 line's slope)."""
        return max(1e-9, (self.chunk[2 * FIRST_CHUNK] - self.chunk[FIRST_CHUNK]) / FIRST_CHUNK)

    def seconds_of(self, tokens: float) -> float:
        """What `tokens` prompt tokens (counted as `cost` counts them) add to a forward; 0 where the
        slope was not timed."""
        return tokens * self.token_seconds if 2 * FIRST_CHUNK in self.chunk else 0.0

    def tokens_in(self, seconds: float) -> int:
        """Prompt tokens (counted as `cost` counts them) that `seconds` of a forward pay for."""
        if 2 * FIRST_CHUNK not in self.chunk:
            return self.budget
        return int(seconds / self.token_seconds)

    def within(self, n: int) -> bool:
        """Chunk n, carried in a decode step's forward, adds at most CHUNK_STALL decode steps."""
        return self.chunk[n] - self.fixed_seconds <= CHUNK_STALL * self.decode_seconds


@torch.inference_mode()
def probe_chunk_budget(
    prefill: Callable[[torch.Tensor], object],
    set_context: Callable[[int, int], None],
    decode: tuple[int, int, float],
    device: torch.device,
    vocab_size: int,
    room: int,
    context: int = PROBE_CONTEXT,
) -> ChunkProbe:
    """The largest power-of-two chunk, from FIRST_CHUNK up to `most` tokens, that a decode step
    (`decode`: rows, tokens, seconds, from the step-cost probe) can carry in its forward for at most
    CHUNK_STALL x its own cost. A chunk's cost there is its one-row prefill forward
    `prefill(tokens [1, n])` less what any forward pays (weights read, per-layer work: the line
    through the 64- and 128-token chunks at 0 tokens), which the decode pays already. Doubling stops
    at the first chunk over the line; chunks go up to `room` positions (context included). Then
    FIRST_CHUNK tokens after 4x the context (where `room` allows) give a token's cost growth per
    position before it (`ChunkProbe.cost`). `set_context` as for `probe_step_costs`."""
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(1)
    rows, width, seconds = decode
    probe = ChunkProbe(FIRST_CHUNK, seconds, (rows, width), context=context)
    most = room - context

    def measure(n: int) -> float:
        tokens = torch.randint(vocab_size, (1, n), generator=gen).to(device)
        return min(timed(lambda: prefill(tokens), device, 2))

    def measure_chunk(n: int) -> None:
        probe.chunk[n] = measure(n)

    far = min(4 * context, room - FIRST_CHUNK)
    if far >= 2 * context:
        set_context(1, far)
        try:
            late = measure(FIRST_CHUNK)
        finally:
            set_context(1, 0)
    set_context(1, context)
    try:
        if 2 * FIRST_CHUNK <= most:
            measure_chunk(FIRST_CHUNK)
            measure_chunk(2 * FIRST_CHUNK)
            probe.fixed_seconds = max(0.0, 2 * probe.chunk[FIRST_CHUNK] - probe.chunk[2 * FIRST_CHUNK])
            if far >= 2 * context:
                # Per token: (late - near) / FIRST_CHUNK over (far - context) positions, relative
                # to a token's own cost after `context` (the 64-128 line's slope).
                # A noisy pair of chunks with no slope between them says nothing of growth: none.
                per_token = (probe.chunk[2 * FIRST_CHUNK] - probe.chunk[FIRST_CHUNK]) / FIRST_CHUNK
                extra = (late - probe.chunk[FIRST_CHUNK]) / FIRST_CHUNK
                probe.far = far
                probe.growth = max(0.0, extra / per_token / (far - context)) if per_token > 0 else 0.0
        n = FIRST_CHUNK
        while n <= most:
            if n not in probe.chunk:
                measure_chunk(n)
            if not probe.within(n):
                break
            probe.budget = n
            n *= 2
    finally:
        set_context(1, 0)
    probe.seconds = time.perf_counter() - start
    return probe
