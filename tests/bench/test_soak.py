"""bench.soak's smoke run: 12 s of mixed traffic against the tiny target it starts itself."""

from __future__ import annotations

import json
from pathlib import Path

from bench.soak import KINDS, main


def test_soak_smoke(tiny_target_dir: Path, tiny_drafter_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    result = main(
        [
            "--minutes", "0.2", "--concurrency", "4", "--max-tokens", "8", "--sample-s", "0.5",
            "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir),
            "--env", "DOMINO_DTYPE=float32", "--env", "DOMINO_DEVICE=cpu", "--env", "DOMINO_SERVED_MODEL_NAME=tiny",
            "--json", str(out),
        ]
    )  # fmt: skip
    assert result["ok"], (result["error_messages"], result["in_flight"], result["server_exit_code"])
    assert result["errors"] == 0 and result["server_exit_code"] == 0
    assert all(result["per_kind"][k]["requests"] > 0 for k in KINDS), result["per_kind"]
    assert result["in_flight"]["after_traffic"] == 0  # cancelled streams left the engine too
    windows = result["windows"]
    assert len(windows) >= 2 and sum(w["requests"] for w in windows) == result["requests"]
    assert all(w["p99_s"] is not None and w["p99_s"] >= w["p50_s"] > 0 for w in windows if w["requests"] >= 4)
    assert result["rss_mb"]["max"] > 0 and result["rss_drift_mb"] is not None
    assert json.loads(out.read_text())["requests"] == result["requests"]
