"""The scheduler (first come, first served into free rows) and the n-gram proposer on their own."""

from __future__ import annotations

import numpy as np

from model.engine.ngram import NgramIndex
from model.engine.proposers import NgramProposer
from model.engine.requests import SamplingParams
from model.engine.row import Row
from model.engine.scheduler import Scheduler
from model.kv.blocks import BlockPool, BlockTables


def _row(request_id: str, prompt: list[int], output: list[int] | None = None, ngram: bool = False) -> Row:
    return Row(
        request_id, prompt, SamplingParams(max_new_tokens=8), np.random.default_rng(0), frozenset(),
        output_ids=list(output or []), ngram=NgramIndex() if ngram else None,
    )  # fmt: skip


def _scheduler(max_running: int, num_blocks: int = 100, block_size: int = 4, lookahead: int = 2) -> Scheduler:
    return Scheduler(max_running, BlockTables(BlockPool(num_blocks, block_size)), lookahead)


def test_scheduler_admits_oldest_first_into_the_free_rows() -> None:
    s = _scheduler(max_running=3)
    rows = [_row(str(i), [i]) for i in range(5)]
    for r in rows:
        s.add(r)
    running = [_row("x", [1], [2])]
    assert [r.request_id for r in s.admit(running)] == ["0", "1"]  # two rows free
    assert s.admit(running * 3) == [] and len(s) == 3
    rows[3].aborted = True
    assert s.drop_aborted() == [rows[3]]
    assert [r.request_id for r in s] == ["2", "4"]
    assert [r.request_id for r in s.admit([])] == ["2", "4"] and len(s) == 0
    assert [r.admitted for r in (rows[0], rows[1], rows[2], rows[4])] == [1, 2, 3, 4]


def test_scheduler_admits_while_kv_blocks_fit_and_nothing_passes_the_oldest() -> None:
    """Rows free but blocks short: the oldest request waits at the front, and a smaller one behind it
    does not pass it (first come, first served). Blocks the running rows need for their next step
    are not given away."""
    s = _scheduler(max_running=4, num_blocks=6)  # 24 tokens
    s.add(_row("big0", [1] * 9))
    assert [r.request_id for r in s.admit([])] == ["big0"]  # 9 + 2 lookahead: 3 blocks
    for rid, prompt in (("big1", [1] * 9), ("small", [1])):
        s.add(_row(rid, prompt))
    big0 = _row("big0", [1] * 9, [5, 6, 7, 8])  # decoded since: 12 + 2 positions, one block more
    assert s.admit([big0]) == []  # big1's 3 blocks would leave big0's next step short; small waits
    assert [r.request_id for r in s] == ["big1", "small"] and s.blocks.pool.num_free == 3
    s.release(big0)
    assert [r.request_id for r in s.admit([])] == ["big1", "small"]


def test_the_newest_rows_are_preempted_when_a_step_runs_out_of_blocks() -> None:
    s = _scheduler(max_running=4, num_blocks=8)  # 32 tokens
    rows = [_row(str(i), [1] * 5) for i in range(3)]
    for r in rows:
        s.add(r)
    assert len(s.admit([])) == 3 and s.blocks.pool.num_free == 2  # 5 + 2: two blocks each
    for r in rows:
        r.output_ids = [7] * 14  # 18 + 2 positions cached and ahead: five blocks each
    preempted = s.preempt_for_step(rows)
    assert preempted == [rows[2], rows[1]]  # newest first, until the oldest fits
    assert [r.request_id for r in s] == ["1", "2"]  # back at the front, oldest first
    assert len(s.blocks.table("0")) == 5 and "1" not in s.blocks and "2" not in s.blocks
    assert s.preempt_for_step(rows[:1]) == []


def test_ngram_proposer_copies_what_followed_the_last_match_within_budget() -> None:
    # Prompt "5 6 7 8 5 6", output "7": the suffix "5 6 7" was followed by 8, 5, 6 before.
    row = _row("a", [5, 6, 7, 8, 5, 6], [7], ngram=True)
    plain = _row("b", [1, 2, 3])  # no index: no copy
    proposer = NgramProposer()
    copies = proposer.propose([row, plain], budgets=[8, 8], width=3)
    assert copies is not None and copies.counts == [3, 0]  # the plain row has no index: no copy
    assert copies.tokens[0].tolist() == [8, 5, 6] and copies.match_lens is not None and copies.match_lens[0] == 3
    # The index caught up with the prompt and output; a tighter budget or width cuts the copy.
    assert len(row.ngram) == 7
    short = proposer.propose([row], budgets=[2], width=3)
    assert short is not None and short.counts == [2] and short.tokens[0, :2].tolist() == [8, 5]
    none = proposer.propose([row], budgets=[0], width=3)
    assert none is not None and none.counts == [0]
    assert proposer.propose([row], budgets=[5], width=0) is None
