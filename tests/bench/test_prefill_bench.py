"""bench.prefill on the tiny target: the prompts' shared chat-template beginning is served from
shared KV blocks, and a ratio comes out per repetition."""

from __future__ import annotations

from pathlib import Path

from bench.prefill import main


def test_prefill_bench_compares_two_engines(tiny_target_dir: Path) -> None:
    argv = ["--target", str(tiny_target_dir), "--batch", "2", "--batches", "5", "--repetitions", "2"]
    result = main([*argv, "--block-size", "8"])
    assert (result["a"], result["b"]) == ("with_cache", "without")
    assert result["cached_tokens_a"] > 0 and result["prompts"] == 8
    assert len(result["ratios"]) == 2 and all(r > 0 for r in result["ratios"])
