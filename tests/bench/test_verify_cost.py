"""bench.verify_cost: a short run over a tiny target in both dtypes and packed int4, through the engine's cache."""

from __future__ import annotations

import json
from pathlib import Path

from bench.verify_cost import main


def test_times_every_dtype_and_width(tmp_path: Path, tiny_target_dir: Path) -> None:
    out = tmp_path / "cost.json"
    result = main(
        ["--target", str(tiny_target_dir), "--dtypes", "float32,bfloat16,int4", "--tokens", "1,3"]
        + ["--context", "16", "--repeats", "3", "--json", str(out)]
    )
    saved = json.loads(out.read_text())
    assert set(saved["seconds"]) == {"float32", "bfloat16", "int4"}
    assert all(float(s) > 0 for per_t in saved["seconds"].values() for s in per_t.values())
    assert set(result["seconds"]["float32"]) == {1, 3}
    assert "T=3" in out.with_suffix(".md").read_text()
