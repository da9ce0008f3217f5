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
