"""bench.interference on the tiny target: both budgets run; chunked, the long prompt goes in by
several chunks and the streams keep emitting while it does."""

from __future__ import annotations

from pathlib import Path

from bench.interference import main


def test_interference_runs_whole_and_chunked(tiny_target_dir: Path) -> None:
    argv = ["--target", str(tiny_target_dir), "--streams", "2", "--prompt-tokens", "200", "--budgets", "whole,32"]
    result = main([*argv, "--warm-steps", "3", "--reps", "1", "--dtype", "float32"])
    whole, chunked = result["median_over_reps"]["whole"], result["median_over_reps"]["32"]
    assert whole["prefill_chunks"] == 0 and chunked["prefill_chunks"] >= 200 // 32
    assert chunked["ttft_long_s"] > 0 and whole["median_gap_before_ms"] > 0


def test_served_scenario_measures_stream_gaps_around_the_long_prompt(server_factory) -> None:  # noqa: ANN001
    srv = server_factory(max_batch_size=3, max_num_batched_tokens=16)
    argv = ["--url", srv.url, "--streams", "2", "--stream-tokens", "40", "--prompt-tokens", "200", "--delay", "0.3"]
    result = main([*argv, "--reps", "1", "--label", "chunked16", "--stream-chars", "200"])
    (run,) = result["runs"]
    assert run["gaps_during"] >= 1 and run["median_gap_outside_ms"] > 0 and run["ttft_long_s"] > 0
    assert result["median_over_reps"]["p99_over_median"] == run["p99_over_median"]
