"""bench.kv_layout on tiny models: both layouts run the same requests, in fp32 with the fixed policy
to the same tokens, and the report has a ratio per repetition."""

from __future__ import annotations

from bench.kv_layout import measure
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target


def test_measure_runs_both_layouts_to_the_same_tokens() -> None:
    prompts = [[3, 5, 7, 11, 13][: 2 + i] for i in range(4)]
    r = measure(TargetModel(tiny_target()), tiny_drafter(domino=True), prompts, 2, 12, 2, [], draft_policy="fixed")
    assert r["same_tokens"] and r["requests"] == 4 and r["concurrency"] == 2
    assert len(r["paged_over_slots"]) == 2 and all(x > 0 for x in r["paged_over_slots"])
    assert set(r["tokens_per_s"]) == {"slots", "paged"}
    assert r["kv_bytes_read"]["slots"] == r["kv_bytes_read"]["paged"] > 0
