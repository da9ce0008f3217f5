"""A decode step's phases timed the same way on every device (issue 54).

The policy weighs drafting against verifying by their measured costs, so both must be measured
alike. On the CPU a forward's work is done when its call returns: host clocks around the calls.
On a GPU a call returns once its kernels are queued, and synchronizing to time them stalls the host
once more per step. There CUDA events are recorded around each phase and read after the step's
results came back to the host: that copy waits for every kernel queued before it, so the events
are complete by then and reading them waits for nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class PhaseTimer:
    """Start and end marks of named phases: host clock values, or CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.events = device.type == "cuda"
        self.marks: dict[str, tuple[float | torch.cuda.Event, float | torch.cuda.Event]] = {}

    def _mark(self) -> float | torch.cuda.Event:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark the work queued inside the block as phase `name` (nothing is marked if it raises)."""
        start = self._mark()
        yield
        self.marks[name] = (start, self._mark())

    def seconds(self, name: str) -> float:
        """Phase `name`'s duration; on a GPU read it only after the step's results are on the host."""
        start, end = self.marks[name]
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return start.elapsed_time(end) / 1e3
        assert isinstance(start, float) and isinstance(end, float)
        return end - start
