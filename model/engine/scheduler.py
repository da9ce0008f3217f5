"""Which requests run: the waiting queue and admission (first come, first served, as many as there
are free rows and KV blocks for). The room where block allocation, preemption and prefill chunks go as the engine
grows them (issue 37); the engine asks it each step and runs what it admits."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from model.engine.row import Row


class Scheduler:
    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.waiting: deque[Row] = deque()

    def __len__(self) -> int:
        return len(self.waiting)

    def __iter__(self) -> Iterator[Row]:
        return iter(self.waiting)

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def drop_aborted(self) -> list[Row]:
        """Waiting requests that were aborted, taken out of the queue."""
        gone = [r for r in self.waiting if r.aborted]
        for row in gone:
            self.waiting.remove(row)
        return gone

    def admit(self, num_running: int, reserve: Callable[[Row], bool]) -> list[Row]:
        """The requests to start this step, oldest first, filling the free rows while `reserve` finds
        each one its KV blocks. First come, first served: a request that does not fit waits at the
        front, and nothing behind it passes it."""
        admitted: list[Row] = []
        while self.waiting and num_running + len(admitted) < self.max_running and reserve(self.waiting[0]):
            admitted.append(self.waiting.popleft())
        return admitted
