"""bench.load against the shared tiny server: two concurrency levels, reports, --compare, loopback guard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.load import check_loopback_url, main
from bench.load_results import quantile
from tests.fixtures.servers import ServerProcess

MAX_TOKENS = 6
REQUESTS = 6


def write_prompts(path: Path) -> Path:
    # Both routes: text prompts go to /v1/completions, messages to /v1/chat/completions.
    lines = [
        {"prompt": "Hello world, hello"},
        {"messages": [{"role": "user", "content": "The quick brown fox"}]},
        {"prompt": "def add(a, b):"},
        {"messages": [{"role": "user", "content": "Speculative decoding drafts"}]},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_loopback_guard() -> None:
    for ok in ("http://127.0.0.1:8000", "http://127.9.8.7:1/", "http://[::1]:8000", "https://localhost"):
        assert check_loopback_url(ok) == ok.rstrip("/")
    for bad in (
        "http://10.0.0.1:8000",
        "http://0.0.0.0:8000",
        "http://example.com",
        "http://localhost.example.com",
        "http://[::ffff:127.0.0.1]:8000",
        "ftp://127.0.0.1",
    ):
        with pytest.raises(ValueError):
            check_loopback_url(bad)


def test_quantile() -> None:
    assert quantile([], 0.5) is None
    assert quantile([3.0], 0.99) == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)


def test_non_loopback_url_is_refused(tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl")
    with pytest.raises(SystemExit) as info:
        main(["--url", "http://192.0.2.1:8000", "--prompts", str(prompts), "--json", str(tmp_path / "x.json")])
    assert info.value.code == 2
    assert not (tmp_path / "x.json").exists()


def test_load_run_and_compare(server: ServerProcess, tmp_path: Path) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "run" / "domino.json"
    # ignore_eos: every request yields exactly MAX_TOKENS tokens, so the token count is exact.
    result = main(
        [
            "--url",
            server.url,
            "--prompts",
            str(prompts),
            "--concurrency",
            "1,4",
            "--requests",
            str(REQUESTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--ignore-eos",
            "--timeout",
            "60",
            "--deadline",
            "120",
            "--label",
            "domino",
            "--json",
            str(out),
        ]
    )
    assert result["model"] == "tiny" and result["label"] == "domino"
    assert set(result["levels"]) == {"1", "4"}
    for c, level in result["levels"].items():
        assert level["concurrency"] == int(c)
        assert level["errors"] == 0 and level["skipped"] == 0, level["error_messages"]
        assert level["completed"] == REQUESTS
        assert all(r["ok"] and r["completion_tokens"] == MAX_TOKENS for r in level["per_request"])
        assert level["output_tokens"] == REQUESTS * MAX_TOKENS
        assert level["output_tokens_per_s"] > 0 and level["requests_per_s"] > 0
        for key in ("ttft_s", "itl_s", "e2e_s"):
            d = level[key]
            assert d["n"] > 0 and 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
        assert level["ttft_s"]["p50"] <= level["e2e_s"]["p50"]
        # The tiny drafter is accepted sometimes: 1 <= tau <= 1 + drafts per step.
        assert level["mean_acceptance_length"] is not None and level["mean_acceptance_length"] >= 1.0
        # Draft tokens verified (num_drafts counts verify steps, which `ar` mode has too).
        assert level["spec_decode"]["num_draft_tokens"] > 0
        assert 0 < level["draft_step_share"] <= 1  # the server's fixed policy verifies drafts

    on_disk = json.loads(out.read_text())
    assert on_disk["levels"]["4"]["output_tokens"] == REQUESTS * MAX_TOKENS
    assert {"label", "url", "model", "levels"} <= set(on_disk)
    md = out.with_suffix(".md").read_text()
    assert "| 1 |" in md and "| 4 |" in md
    for suffix in ("_throughput.png", "_latency.png"):
        png = tmp_path / "run" / f"domino{suffix}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # A second run with half the throughput stands in for DOMINO_MODE=ar: the ratio is then 2.
    slower = json.loads(out.read_text())
    slower["label"] = "ar"
    for level in slower["levels"].values():
        level["output_tokens_per_s"] /= 2
    b_path = tmp_path / "run" / "ar.json"
    b_path.write_text(json.dumps(slower))
    cmp_out = tmp_path / "cmp" / "domino_vs_ar.json"
    cmp = main(["--compare", f"{out},{b_path}", "--json", str(cmp_out)])
    assert cmp["a"]["label"] == "domino" and cmp["b"]["label"] == "ar"
    for c in ("1", "4"):
        assert cmp["levels"][c]["output_tokens_per_s_ratio"] == pytest.approx(2.0)
    assert json.loads(cmp_out.read_text())["levels"]["4"]["output_tokens_per_s_ratio"] == pytest.approx(2.0)
    assert "2.00×" in cmp_out.with_suffix(".md").read_text()
    assert (tmp_path / "cmp" / "domino_vs_ar_throughput.png").read_bytes()[:4] == b"\x89PNG"

    # A second repetition where A ran at 4/3 of B's throughput: median ratio (2 + 4/3) / 2, range
    # 4/3–2, and the ratio of the mean throughputs.
    rep2 = json.loads(cmp_out.read_text())
    for level in rep2["levels"].values():
        level["b_output_tokens_per_s"] = level["a_output_tokens_per_s"] * 0.75
        level["output_tokens_per_s_ratio"] = 4 / 3
    rep2_path = tmp_path / "cmp" / "rep2.json"
    rep2_path.write_text(json.dumps(rep2))
    reps_out = tmp_path / "cmp" / "reps.json"
    reps = main(["--repetitions", f"{cmp_out},{rep2_path}", "--json", str(reps_out)])
    level = reps["levels"]["4"]
    assert level["ratios"] == pytest.approx([2.0, 4 / 3])
    assert level["ratio_median"] == pytest.approx(5 / 3)
    assert (level["ratio_min"], level["ratio_max"]) == pytest.approx((4 / 3, 2.0))
    # From the throughputs as written (six significant digits), not the in-memory ones.
    first = json.loads(cmp_out.read_text())["levels"]["4"]
    a, b = first["a_output_tokens_per_s"], first["b_output_tokens_per_s"]
    assert level["ratio_of_means"] == pytest.approx(a / ((b + 0.75 * a) / 2))
    assert "1.67×" in reps_out.with_suffix(".md").read_text()
