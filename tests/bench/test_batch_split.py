"""bench.batch_split: the tiny target and drafter through every kind of setting, time split by step kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.batch_split import Split, engine_kwargs, main, summarize


def test_setting_names() -> None:
    assert engine_kwargs("ar") == {"mode": "ar"}
    assert engine_kwargs("domino-k2") == {"mode": "domino", "max_drafts": 2}
    assert engine_kwargs("domino-fixed-k1") == {
        "mode": "domino",
        "max_drafts": 1,
        "draft_policy": "fixed",
        "ngram": False,
    }
    with pytest.raises(ValueError):
        engine_kwargs("domino-k")


def test_ratios_follow_the_split() -> None:
    # ar: 2 s prefill + 8 s decode for 80 tokens; spec: same prefill, half the decode time.
    rows = summarize(
        {
            "ar": Split(prefill_s=2, decode_s=8, decode_steps=10, row_steps=80, tokens=80),
            "domino": Split(prefill_s=2, decode_s=4, draft_s=1, decode_steps=5, row_steps=40, tokens=80),
        }
    )
    assert rows["domino"]["decode_ratio"] == pytest.approx(2.0)
    assert rows["domino"]["total_ratio"] == pytest.approx(10 / 6)  # Amdahl: prefill does not shrink
    assert rows["domino"]["tokens_per_row_step"] == pytest.approx(2.0)
    assert rows["domino"]["draft_ms_per_step"] == pytest.approx(200.0)
    assert rows["ar"]["prefill_share"] == pytest.approx(0.2)


def test_runs_every_setting(tmp_path: Path, tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"def add(a, b):\n    return a + b  # {i}"}) for i in range(7)]
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "split.json"
    settings = "ar,domino,domino-k1,domino-fixed-k1,domino-full"
    result = main(
        [
            "--target", str(tiny_target_dir), "--drafter", str(tiny_drafter_dir), "--prompts", str(prompts),
            "--offset", "0", "--settings", settings, "--batch", "2", "--requests", "3", "--repeats", "2",
            "--max-new-tokens", "6", "--dtype", "float32", "--json", str(out),
        ]
    )  # fmt: skip
    rows = result["settings"]
    assert list(rows) == settings.split(",")
    for name, row in rows.items():
        assert row["prefill_s"] > 0 and row["decode_s"] > 0, name
        # 6 prompts × 6 new tokens; prefill emits each row's first token, decode the other 5.
        assert row["decode_tok_s"] * row["decode_s"] == pytest.approx(30), name
    assert rows["ar"]["tokens_per_row_step"] == pytest.approx(1.0)
    # The proposal phase of `ar` is only bookkeeping; the drafter ran every decode step of domino-full.
    assert rows["ar"]["draft_ms_per_step"] < rows["domino-full"]["draft_ms_per_step"]
    assert rows["domino-full"]["tokens_per_row_step"] >= 1.0
    assert rows["ar"]["decode_ratio"] == pytest.approx(1.0)
    assert "total × ar" in out.with_suffix(".md").read_text()
