"""bench/llama_cpp.py without llama.cpp: what it asks llama-server, how it reads the answers and
what it reports (the benchmark itself needs scripts/build_llama_cpp.sh's build)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.llama_cpp import (
    Record,
    completion_request,
    llama_record,
    markdown,
    parse_args,
    parse_completion,
    server_command,
    summarize,
)

# The shape of a llama-server /completion answer (its fields as the server names them).
ANSWER = {
    "content": " Paris.",
    "tokens": [7042, 30],
    "stop": True,
    "timings": {
        "prompt_n": 31,
        "prompt_ms": 52.5,
        "prompt_per_token_ms": 1.69,
        "prompt_per_second": 590.4,
        "predicted_n": 2,
        "predicted_ms": 20.0,
        "predicted_per_token_ms": 10.0,
        "predicted_per_second": 100.0,
        "draft_n": 4,
        "draft_n_accepted": 3,
    },
}


def test_a_completion_is_read_from_the_servers_own_timings() -> None:
    c = parse_completion(ANSWER)
    assert (c.tokens, c.prompt_n, c.prompt_ms, c.predicted_n, c.predicted_ms) == ([7042, 30], 31, 52.5, 2, 20.0)
    assert (c.draft_n, c.draft_accepted) == (4, 3)
    r = llama_record(c)
    assert (r.decode_tokens, r.decode_s, r.ttft_s, r.draft_n, r.draft_accepted) == (2, 0.02, 0.0525, 4, 3)
    plain = {**ANSWER, "timings": {k: v for k, v in ANSWER["timings"].items() if not k.startswith("draft")}}
    assert parse_completion(plain).draft_n == 0
    with pytest.raises(ValueError, match="without timings"):
        parse_completion({"error": {"message": "bad"}})
    with pytest.raises(ValueError, match="predicted_ms"):
        parse_completion({"timings": {"prompt_n": 1, "prompt_ms": 1.0, "predicted_n": 1}})


def test_the_server_runs_one_greedy_slot_on_the_given_threads() -> None:
    cmd = server_command(Path("llama-server"), Path("m.gguf"), 2, 8123, 1024, None)
    assert cmd[:3] == ["llama-server", "-m", "m.gguf"] and "--spec-type" not in cmd
    for flag, value in (("-t", "2"), ("-tb", "2"), ("-c", "1024"), ("-np", "1"), ("--port", "8123")):
        assert cmd[cmd.index(flag) + 1] == value
    spec = server_command(Path("llama-server"), Path("m.gguf"), 2, 8123, 1024, "ngram-mod")
    assert spec[spec.index("--spec-type") + 1] == "ngram-mod"
    body = completion_request([1, 2, 3], 128)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 128 and body["temperature"] == 0
    assert body["cache_prompt"] is False and body["return_tokens"] is True


def test_the_report_gives_each_system_against_llama_cpps_plain_decoding() -> None:
    records = {
        "llama.cpp": [Record(100, 1.0, 0.05), Record(50, 1.0, 0.05)],  # 75 tok/s
        "llama.cpp ngram-mod": [Record(150, 1.5, 0.05, draft_n=10, draft_accepted=8)],  # 100 tok/s
        "domino": [Record(60, 1.0, 0.02, tau=[2, 3]), Record(60, 1.0, 0.02, tau=[1])],  # 60 tok/s
    }
    ttft = {"llama.cpp": 0.9, "domino": 0.3}
    summary = summarize(records, ttft, "llama.cpp")
    assert summary["llama.cpp"]["decode_tokens_per_s"] == pytest.approx(75.0)
    assert summary["llama.cpp ngram-mod"]["vs_anchor"] == pytest.approx(100 / 75)
    assert summary["llama.cpp ngram-mod"]["draft_acceptance"] == pytest.approx(0.8)
    assert summary["domino"]["vs_anchor"] == pytest.approx(60 / 75) and summary["domino"]["tau_mean"] == 2.0
    assert summary["llama.cpp ngram-mod"]["ttft_long_s"] is None
    meta = {
        "cpu": "AMD EPYC, AVX-512 BF16", "threads": 1, "dtype": "bfloat16", "prompts": 2,
        "prompts_file": "p.jsonl", "offset": 100, "max_new_tokens": 128, "ttft_tokens": 500, "commit": "abc",
    }  # fmt: skip
    md = markdown(summary, "llama.cpp", meta)
    assert "| llama.cpp | 75.0 | 1.00× | – | 150 | 900 ms |" in md
    assert "| llama.cpp ngram-mod | 100.0 | 1.33× | 80% | 150 | – |" in md
    assert "| domino | 60.0 | 0.80× | τ 2.00 | 120 | 300 ms |" in md


def test_a_missing_server_is_refused_with_how_to_build_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--server", str(tmp_path / "llama-server")])
    assert "scripts/build_llama_cpp.sh" in capsys.readouterr().err
    server = tmp_path / "llama-server"
    server.write_text("")
    with pytest.raises(SystemExit):
        parse_args(["--server", str(server), "--spec", "eagle"])
    args = parse_args(["--server", str(server), "--spec", "none", "--ours", "ar,domino"])
    assert args.spec == [] and args.ours == ["ar", "domino"]


def test_a_packed_target_is_named_by_its_weights_and_activations() -> None:
    from bench.common import dtype_label

    assert dtype_label("int4", torch.bfloat16) == "int4 weights, bfloat16 activations"
    assert dtype_label("auto", torch.bfloat16) == "bfloat16"
