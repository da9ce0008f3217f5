"""Which requests run: the waiting queue, admission by free rows and free KV blocks (first come,
first served), the blocks each running row needs before a decode step, and preemption when they run
out. The engine asks it each step and runs what it decides; the block tables are the KV room's
(model/kv/blocks.py)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence

from model.engine.row import Row, cache_ids, cached_tokens
from model.kv.blocks import BlockTables


class Scheduler:
    def __init__(self, max_running: int, blocks: BlockTables, lookahead: int, share_prefixes: bool = False) -> None:
        """`lookahead`: positions a decode step may write past a row's cached tokens.
        `share_prefixes`: a new row begins with the indexed prompt blocks its tokens begin with."""
        self.max_running = max_running
        self.blocks = blocks
        self.lookahead = lookahead
        self.share_prefixes = share_prefixes
        self.waiting: deque[Row] = deque()
        self._admissions = itertools.count(1)

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

    def _needs(self, row: Row) -> int:
        return cached_tokens(row) + self.lookahead

    def admit(self, running: Sequence[Row]) -> list[Row]:
        """The requests to start this step, oldest first, filling the free rows while the KV blocks
        for what each one's prefill writes and a step's lookahead are free, beyond what the running
        rows need for their next step (so that admitting never forces a preemption at once). First
        come, first served: a request that does not fit waits at the front, and nothing passes it."""
        keep = sum(self.blocks.shortfall(r.request_id, self._needs(r)) for r in running)
        admitted: list[Row] = []
        while self.waiting and len(running) + len(admitted) < self.max_running:
            row = self.waiting[0]
            # A prompt scored for its logprobs is forwarded whole: shared positions have no logits.
            share = self.share_prefixes and (row.params.prompt_logprobs is None or bool(row.output_ids))
            row.shared_tokens = self.blocks.share_prefix(row.request_id, cache_ids(row)) if share else 0
            row.prefilled = row.shared_tokens
            if not self.blocks.reserve(row.request_id, self._needs(row), keep_free=keep):
                self.blocks.free(row.request_id)  # the shared blocks too
                row.shared_tokens = 0
                break
            row.admitted = row.admitted or next(self._admissions)
            admitted.append(self.waiting.popleft())
        return admitted

    def preempt_for_step(self, running: Sequence[Row]) -> list[Row]:
        """Before a decode step, each running row's blocks must cover what the step may write, oldest
        row first. When they run out the newest rows are preempted: their blocks are freed and they
        wait at the front of the queue, oldest first, to be recomputed when blocks free up (returned,
        for the engine to take out of the batch). The oldest row alone always fits (the budget holds a
        row at max_model_len)."""
        live = sorted(running, key=lambda r: r.admitted)
        preempted: list[Row] = []
        i = 0
        while i < len(live):
            if self.blocks.reserve(live[i].request_id, self._needs(live[i])):
                i += 1
                continue
            newest = live.pop()
            self.blocks.free(newest.request_id)
            preempted.append(newest)
        for row in preempted:  # newest first: the oldest ends up at the front
            self.waiting.appendleft(row)
        return preempted

    def release(self, row: Row) -> None:
        """A row left the batch (finished, aborted, failed): its blocks go back."""
        self.blocks.free(row.request_id)
