"""bench.gpu_check.costs: shapes of the full-size models, and a short CPU run at 1/16 width."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench.common import VARIANTS, build_drafter, scaled_shapes
from bench.gpu_check.costs import MODES, main, parse_args, run
from bench.gpu_check.costs_report import costs_markdown


def test_full_size_shapes_are_the_published_ones() -> None:
    shapes = scaled_shapes(1)
    assert shapes["hidden_size"] == 4096 and shapes["target_layers"] == 36 and shapes["draft_layers"] == 5
    assert (shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["head_dim"]) == (32, 8, 128)
    assert (shapes["intermediate_size"], shapes["vocab_size"]) == (12288, 151936)
    assert (shapes["block_size"], shapes["mask_token_id"], shapes["gru_hidden_dim"], shapes["emb_dim"]) == (
        16,
        151669,
        1024,
        256,
    )
    # The drafter config is checked on the meta device: nothing is allocated.
    cfg = build_drafter(shapes, dtype=torch.bfloat16, device="meta").config
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.has_head and cfg.shift_label and cfg.num_drafts == 16


def test_scaled_shapes_keep_head_dim() -> None:
    s = scaled_shapes(16)
    assert (s["hidden_size"], s["intermediate_size"], s["vocab_size"]) == (256, 768, 9496)
    assert (s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]) == (2, 1, 128)
    assert (s["gru_hidden_dim"], s["emb_dim"], s["target_layers"]) == (64, 16, 36)
    assert s["mask_token_id"] < s["vocab_size"]
    assert scaled_shapes(16, layers_scale=4)["target_layers"] == 9


def test_cpu_run_at_scale_16(tmp_path: Path) -> None:
    """Every table, the graph-vs-eager one included (on the CPU its graph engine runs the static
    buckets eagerly: the same code path up to the capture)."""
    out_json, out_md = tmp_path / "costs.json", tmp_path / "costs.md"
    main(
        [
            "--scale", "16", "--layers-scale", "4", "--device", "cpu", "--contexts", "48", "--batch-sizes", "2",
            "--repeats", "1", "--warmup", "1", "--json", str(out_json), "--markdown", str(out_md),
        ]
    )  # fmt: skip
    result = json.loads(out_json.read_text())
    assert result["complete"]
    assert result["environment"]["dtype"] == "float32" and result["environment"]["device"] == "cpu"
    (row,) = result["rows"]
    assert (row["batch"], row["context"]) == (2, 48)
    assert set(row["target_ms"]) == {"1", "2", "4", "8", "16", "17"}
    measured = [*row["target_ms"].values(), row["backbone_ms"], row["draft_base_ms"], row["draft_domino_ms"]]
    measured += [row["append_ms"], *(row["engine"][m]["step_ms"] for m in MODES)]
    assert all(isinstance(t, float) and 0 < t < 60_000 for t in measured), measured
    # Differences of two medians (head, engine overhead) can dip below zero on a noisy CPU.
    assert math.isfinite(row["head_ms"]) and all(math.isfinite(row["engine_overhead_ms"][m]) for m in MODES)
    # A full block is verified in every speculative step (random drafts never shorten it).
    assert row["engine"]["ar"]["num_drafts"] == 0
    assert row["engine"]["domino"]["num_drafts"] == row["engine"]["dflash"]["num_drafts"] == 16
    for name in ("domino", "dflash"):
        proj = row["projection"][name]
        for key in ("speedup", "speedup_engine", "step_over_t1", "t_draft_ms", "t_verify_ms"):
            assert math.isfinite(proj[key]) and proj[key] > 0, (name, key, proj)
    assert row["projection"]["domino"]["tau"] == 7.17 and row["projection"]["dflash"]["tau"] == 6.06
    assert math.isfinite(row["projection"]["domino"]["head_overhead"])
    md = out_md.read_text()
    assert "### Projection" in md and "| published |" in md and "| 2 | 48 |" in md

    # Graph vs eager: every part under every variant, the eager column the engine table's own step.
    assert result["config"]["variants"] == list(VARIANTS)
    parts = row["graph_vs_eager"]
    assert set(parts) == {
        "verify_1", "verify_17", "propose_dflash", "propose_domino", "step_ar", "step_dflash", "step_domino", "head",
    }  # fmt: skip
    for part, times in parts.items():
        assert set(times) == set(VARIANTS), (part, times)
        if part != "head":  # a difference of two times: may be <= 0 on a noisy CPU
            assert all(0 < t < 60_000 for t in times.values()), (part, times)
    for v in VARIANTS:  # the JSON keeps 6 significant digits (bench.report.compact_json)
        assert parts["head"][v] == pytest.approx(parts["propose_domino"][v] - parts["propose_dflash"][v], abs=1e-4)
    # The static engines' capacity is reported beside the (eager) context.
    assert row["static_capacity"] == max(w["capacity"] for w in result["warmup"])
    assert all(parts[f"step_{m}"]["eager"] == row["engine"][m]["step_ms"] for m in MODES)
    assert row["engine"]["domino"]["verify_ms"] == {"17": parts["verify_17"]["eager"]}
    for name in ("domino", "dflash"):
        assert math.isfinite(row["projection"][name]["speedup_graph"])
    # One warm-up report per static engine; no CUDA graphs on the CPU, every bucket built eagerly.
    warm = result["warmup"]
    assert {(w["variant"], w["mode"]) for w in warm} == {(v, m) for v in ("static", "graph") for m in MODES}
    for w in warm:
        assert w["batch"] == 2 and w["graphs"] == 0 and w["memory_mib"] == w["pools_mib"] == 0
        # Buckets 1 and 2 rows; T = 1 only for ar, T in {1, 2, 3, 5, 9, 17} and three proposals
        # (greedy; sampling rows with and without top-k/top-p) per batch otherwise.
        assert w["eager"] == (2 if w["mode"] == "ar" else 2 * 6 + 2 * 3), w
    cap = row["static_capacity"]
    assert "### Graph vs eager" in md and f"| 2 | 48 | {cap} | engine step domino |" in md
    assert "### Static-shape warm-up" in md and "context (eager) | capacity (static, graph)" in md


def test_variants_eager_only_skips_the_static_engines() -> None:
    """--variants eager: no static engines; the results so far are handed out after each batch size."""
    args = parse_args(
        [
            "--scale", "32", "--layers-scale", "9", "--device", "cpu", "--contexts", "16", "--batch-sizes", "1,2",
            "--tokens", "1", "--repeats", "1", "--warmup", "0", "--variants", "eager",
        ]
    )  # fmt: skip
    seen: list[tuple[bool, list[int]]] = []
    result = run(args, lambda partial: seen.append((partial["complete"], [r["batch"] for r in partial["rows"]])))
    assert seen == [(False, [1]), (False, [1, 2])] and result["complete"]
    assert result["warmup"] == [] and set(result["rows"][0]["graph_vs_eager"]["step_domino"]) == {"eager"}
    assert "speedup_graph" not in result["rows"][0]["projection"]["domino"]
    assert "### Graph vs eager" not in costs_markdown(result)


def test_drafter_parameters_exclude_the_borrowed_target_embedding_and_head() -> None:
    # The published Qwen3-8B-Domino-b16 backbone has ~1.05 B parameters; the target's embedding and
    # LM head (2 x 151936 x 4096) it borrows must not count (an H200 report once said 2.29 B).
    from model.nn.drafter import count_parameters

    shapes = scaled_shapes(1)
    drafter = build_drafter(shapes, dtype=torch.bfloat16, device="meta")
    before = count_parameters(drafter)
    vocab, hidden = shapes["vocab_size"], shapes["hidden_size"]
    drafter.bind_target(torch.empty(vocab, hidden, device="meta"), torch.empty(vocab, hidden, device="meta"))
    assert count_parameters(drafter) == before
    assert 1.0e9 < before["backbone"] < 1.1e9 and 50e6 < before["head"] < 60e6
