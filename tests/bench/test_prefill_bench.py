"""bench.prefill on the tiny target: both comparisons run, the prompts' shared chat-template
beginning is served from the prefix cache, and a ratio comes out per repetition."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.prefill import main


@pytest.mark.parametrize("layouts", [None, "slots,paged"])
def test_prefill_bench_compares_two_engines(tiny_target_dir: Path, layouts: str | None) -> None:
    argv = ["--target", str(tiny_target_dir), "--batch", "2", "--batches", "5", "--repetitions", "2"]
    result = main(argv + (["--layouts", layouts] if layouts else []))
    assert (result["a"], result["b"]) == (("slots", "paged") if layouts else ("with_cache", "without"))
    assert result["cached_tokens_a"] > 0 and result["prompts"] == 8
    assert len(result["ratios"]) == 2 and all(r > 0 for r in result["ratios"])
