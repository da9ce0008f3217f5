"""The scheduler (first come, first served into free rows) and the n-gram proposer on their own."""

from __future__ import annotations

import numpy as np

from model.engine.ngram import NgramIndex
from model.engine.proposers import NgramProposer
from model.engine.requests import SamplingParams
from model.engine.row import Row
from model.engine.scheduler import Scheduler


def _row(request_id: str, prompt: list[int], output: list[int] | None = None, ngram: bool = False) -> Row:
    return Row(
        request_id, prompt, SamplingParams(max_new_tokens=8), np.random.default_rng(0), frozenset(),
        output_ids=list(output or []), ngram=NgramIndex() if ngram else None,
    )  # fmt: skip


def test_scheduler_admits_oldest_first_into_the_free_rows() -> None:
    s = Scheduler(max_running=3)
    rows = [_row(str(i), [i]) for i in range(5)]
    for r in rows:
        s.add(r)
    fits = lambda row: True  # noqa: E731
    assert [r.request_id for r in s.admit(num_running=1, reserve=fits)] == ["0", "1"]  # two rows free
    assert s.admit(num_running=3, reserve=fits) == [] and len(s) == 3
    rows[3].aborted = True
    assert s.drop_aborted() == [rows[3]]
    assert [r.request_id for r in s] == ["2", "4"]
    assert [r.request_id for r in s.admit(num_running=0, reserve=fits)] == ["2", "4"] and len(s) == 0


def test_scheduler_admits_while_kv_blocks_fit_and_nothing_passes_the_oldest() -> None:
    """Rows free but blocks short: the oldest request waits at the front, and a smaller one behind it
    does not pass it (first come, first served)."""
    s = Scheduler(max_running=4)
    for rid, prompt in (("big0", [1] * 9), ("big1", [1] * 9), ("small", [1])):
        s.add(_row(rid, prompt))
    free = [12]  # tokens the KV blocks have room for

    def reserve(row: Row) -> bool:
        if len(row.prompt_ids) > free[0]:
            return False
        free[0] -= len(row.prompt_ids)
        return True

    assert [r.request_id for r in s.admit(num_running=0, reserve=reserve)] == ["big0"]
    assert [r.request_id for r in s] == ["big1", "small"] and free == [3]
    free[0] = 10
    assert [r.request_id for r in s.admit(num_running=1, reserve=reserve)] == ["big1", "small"]


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
