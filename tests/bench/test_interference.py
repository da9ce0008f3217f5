"""bench.interference on the tiny target: both budgets run; chunked, the long prompt goes in by
several chunks and the streams keep emitting while it does."""

from __future__ import annotations

import json
from pathlib import Path

from bench.interference import main


def test_interference_runs_whole_and_chunked(tiny_target_dir: Path) -> None:
    argv = ["--target", str(tiny_target_dir), "--streams", "2", "--prompt-tokens", "200", "--budgets", "whole,32"]
    result = main([*argv, "--warm-steps", "3", "--reps", "1", "--dtype", "float32"])
    whole, chunked = result["median_over_reps"]["whole"], result["median_over_reps"]["32"]
    assert whole["prefill_chunks"] == 0 and chunked["prefill_chunks"] >= 200 // 32
    assert chunked["ttft_long_s"] > 0 and whole["median_gap_before_ms"] > 0


def test_served_scenario_measures_stream_gaps_around_the_long_prompt(server_factory, tmp_path: Path) -> None:  # noqa: ANN001
    srv = server_factory(max_batch_size=3, max_num_batched_tokens=16)
    # Streams long enough to outlast the delay and the long prompt's prefill on any machine.
    argv = ["--url", srv.url, "--streams", "2", "--stream-tokens", "300", "--prompt-tokens", "200", "--delay", "0.3"]
    files = []
    for label in ["chunked16", "again"]:
        files.append(tmp_path / f"{label}.json")
        result = main([*argv, "--reps", "1", "--label", label, "--stream-chars", "100", "--json", str(files[-1])])
        (run,) = result["runs"]
        assert run["gaps_during"] >= 1 and run["median_gap_outside_ms"] > 0 and run["ttft_long_s"] > 0
        assert result["median_over_reps"]["p99_over_median"] == run["p99_over_median"]
    combined = main(["--summarize", ",".join(map(str, files + files[:1]))])
    assert [len(combined["runs"][label]) for label in ("chunked16", "again")] == [2, 1]
    assert combined["median_over_reps"]["chunked16"]["p99_over_median"] == run_of(files[0])["p99_over_median"]
    assert "| again | 1 |" in combined["table"]


def run_of(path: Path) -> dict:
    (run,) = json.loads(path.read_text())["runs"]
    return run
