"""bench.plots draws the figures docs/benchmarks.md embeds, from the results kept in bench/results/."""

from __future__ import annotations

from pathlib import Path

from bench.plots import main


def test_plots_are_drawn_from_the_kept_results(tmp_path: Path) -> None:
    written = main(["--out", str(tmp_path)])
    names = {p.name for p in written}
    assert {"speedup_by_mode.png", "tau_per_slot.png", "serving_by_concurrency.png", "verify_cost.png"} <= names
    for path in written:
        assert path.parent == tmp_path and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    docs = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert all(f"img/{name}" in docs for name in names)  # every plot is embedded
