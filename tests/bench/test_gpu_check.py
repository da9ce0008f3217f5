"""bench.gpu_check.driver: the driver end to end at a tiny width on the CPU, its time boxes and deadline,
the pytest subprocess, and the cache argument model/nn/target.py passes to the HF decoder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu_check.driver import BOXES, PARTS, main, parse_args, part_boxes
from bench.gpu_check.parts import run_pytest
from bench.gpu_check.state import FILES, Check, Skip
from model.kv.target_cache import RaggedKVCache, check_cache_written
from model.nn.target import TargetModel, cache_argument
from tests.helpers import tiny_target


def read_records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def statuses(records: list[dict[str, Any]]) -> dict[str, str]:
    return {r["name"]: r["status"] for r in records if r["kind"] == "part"}


def test_driver_runs_every_part_at_a_tiny_scale(tmp_path: Path) -> None:
    """All five parts on the CPU within the deadline: 3 files, the records each part owes, and
    cuda_tests skipped with its reason. (The --scale 16 run is the documented CPU check.)"""
    t0 = time.monotonic()
    deadline = 240
    main(
        [
            "--scale", "32", "--layers-scale", "9", "--device", "cpu", "--out", str(tmp_path),
            "--capacities", "96,128", "--batch-sizes", "1,2", "--new-tokens", "8", "--repeats", "1",
            "--deadline", str(deadline), "--taus", "1,7.17",
        ]
    )  # fmt: skip
    assert time.monotonic() - t0 < deadline
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    records = read_records(tmp_path)
    assert statuses(records) == {
        "env": "ok",
        "correctness": "ok",
        "timings": "ok",
        "e2e": "ok",
        "cuda_tests": "skipped",
    }
    skipped = next(r for r in records if r["kind"] == "part" and r["name"] == "cuda_tests")
    assert "CUDA" in skipped["reason"]
    kinds = {r["kind"] for r in records}
    want = {"versions", "sdpa", "build", "teacher_forced", "buckets", "hf_generate", "greedy", "verify", "propose"}
    assert want | {"head", "e2e", "part", "done"} <= kinds
    versions = next(r for r in records if r["kind"] == "versions")
    assert versions["cache_kwarg"] in ("cache", "past_key_values")
    build = next(r for r in records if r["kind"] == "build")
    assert build["planted"]["greedy_is_copy"] == 1.0
    for r in records:
        if r["kind"] == "teacher_forced":
            assert r["copy_rule_hits"] == 1.0 and r["anchors_agree"] and r["cache_layers_written"], r
        if r["kind"] == "greedy":
            assert r["exact"] == r["total"] and r["copy_match"] == 1.0, r
        if r["kind"] in ("verify", "propose"):
            assert r["clock"] == "wall_time_cpu" and r["median_ms"] > 0, r  # labelled: not a GPU figure
        if r["kind"] == "e2e":
            assert r["copy_match"] == 1.0 and r["capacity"] >= 128 - 17, r
    verify = {(r["batch"], r["T"], r["capacity"], r["variant"]) for r in records if r["kind"] == "verify"}
    assert {(1, 17, 96, "static"), (2, 9, 96, "static"), (1, 17, 96, "eager"), (1, 1, 128, "static")} <= verify
    e2e = {(r["batch"], r["mode"], r["policy"], r["tau_target"]) for r in records if r["kind"] == "e2e"}
    assert e2e == {
        (1, "ar", "fixed", 1.0), (1, "domino", "fixed", 1.0), (1, "domino", "fixed", 7.17),
        (2, "ar", "fixed", 1.0), (2, "domino", "fixed", 1.0), (2, "domino", "fixed", 7.17),
        (2, "domino", "adaptive", 7.17),
    }  # fmt: skip
    summary = (tmp_path / "summary.md").read_text()
    assert "CPU run" in summary and "## Targets" in summary and "| cuda_tests | skipped |" in summary


def test_an_overrunning_part_is_timed_out_and_the_next_runs(tmp_path: Path) -> None:
    def env(check: Check) -> None:
        check.record("versions", device="cuda:0")  # as on the GPU: the targets get verdicts

    def slow(check: Check) -> None:
        check.record("verify", batch=1, T=1, capacity=8, variant="graph", median_ms=1.0, p10_ms=1.0, p90_ms=1.0)
        while True:  # a Python loop: the box's alarm interrupts it
            time.sleep(0.01)

    def broken(check: Check) -> None:
        raise ValueError("boom")

    def skipped(check: Check) -> None:
        raise Skip("not here")

    def fine(check: Check) -> None:
        check.record("head", batch=1, variant="graph", median_ms=0.5)

    parts = {"env": env, "correctness": slow, "timings": broken, "e2e": skipped, "cuda_tests": fine}
    t0 = time.monotonic()
    records = main(["--out", str(tmp_path), "--boxes", "correctness=0.5", "--deadline", "30"], parts=parts)
    assert time.monotonic() - t0 < 10
    assert statuses(records) == {
        "env": "ok", "correctness": "timed_out", "timings": "failed", "e2e": "skipped", "cuda_tests": "ok",
    }  # fmt: skip
    assert read_records(tmp_path) == json.loads(json.dumps(records))  # every record was appended as made
    part = {r["name"]: r for r in records if r["kind"] == "part"}
    assert part["correctness"]["seconds"] < 3 and "box" in part["correctness"]["reason"]
    assert "ValueError: boom" in part["timings"]["reason"] and part["e2e"]["reason"] == "not here"
    assert any(r["kind"] == "verify" and r["part"] == "correctness" for r in records)  # kept though timed out
    summary = (tmp_path / "summary.md").read_text()
    assert (
        "| correctness | timed_out |" in summary and "Domino head, batch 1, graph (ms) | 0.50 | ≤ 0.6 | met" in summary
    )
    assert "Traceback" in (tmp_path / "log.txt").read_text()  # the failed part's traceback is in the log
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)


def test_the_global_deadline_skips_the_parts_left(tmp_path: Path) -> None:
    def sleepy(check: Check) -> None:
        time.sleep(5)

    parts = dict.fromkeys(PARTS, sleepy)
    argv = ["--out", str(tmp_path), "--deadline", "1.5", "--boxes", "env=10", "--parts", "env,timings,e2e"]
    records = main(argv, parts=parts)  # env runs into the deadline: nothing is left for the others
    assert statuses(records) == {"env": "timed_out", "timings": "skipped", "e2e": "skipped"}
    assert all("deadline" in r["reason"] for r in records if r["kind"] == "part" and r["status"] == "skipped")


def test_parse_args_orders_parts_and_reads_boxes() -> None:
    args = parse_args(["--parts", "e2e,env", "--boxes", "e2e=90,env=5", "--out", "x"])
    assert args.parts == ["env", "e2e"] and args.boxes == {"e2e": 90.0, "env": 5.0}
    assert part_boxes(args) == {"env": 5.0, "e2e": 90.0}
    with pytest.raises(SystemExit):
        parse_args(["--boxes", "nope=3"])


def test_the_deadline_is_shared_among_the_selected_parts() -> None:
    assert part_boxes(parse_args(["--out", "x"])) == {k: float(v) for k, v in BOXES.items()}  # they add up to 420
    rerun = part_boxes(parse_args(["--out", "x", "--deadline", "170", "--parts", "timings,e2e"]))
    assert rerun == {"timings": 68.0, "e2e": 102.0}


def test_pytest_runs_in_its_own_process_and_is_killed_at_its_limit(tmp_path: Path) -> None:
    check = Check(parse_args(["--out", str(tmp_path)]))
    # Without CUDA the test is skipped: exit 0, its summary line parsed.
    run_pytest(check, "capture_failure", "capture_failure", 120)
    rec = check.records[-1]
    assert rec["rc"] == 0 and not rec["timed_out"], rec
    if not torch.cuda.is_available():
        assert rec["counts"].get("skipped") == 1, rec
    with pytest.raises(RuntimeError, match="exit"):
        run_pytest(check, "too_slow", "capture_failure", 0.2)
    assert check.records[-1]["timed_out"]
    check.close()


# -- the cache argument ------------------------------------------------------------------------


def test_cache_argument_picks_the_name_the_decoder_takes() -> None:
    def newer(input_ids: Any = None, cache: Any = None, **kwargs: Any) -> None: ...

    def older(input_ids: Any = None, past_key_values: Any = None, **kwargs: Any) -> None: ...

    def neither(input_ids: Any = None, **kwargs: Any) -> None: ...

    assert cache_argument(newer) == "cache" and cache_argument(older) == "past_key_values"
    with pytest.raises(TypeError):
        cache_argument(neither)
    # The installed transformers' Qwen3 decoder, whichever version this is.
    import inspect

    from transformers.models.qwen3.modeling_qwen3 import Qwen3Model

    takes_cache = "cache" in inspect.signature(Qwen3Model.forward).parameters
    assert cache_argument(Qwen3Model.forward) == ("cache" if takes_cache else "past_key_values")


def test_a_forward_whose_cache_was_not_written_is_an_error() -> None:
    target = TargetModel(tiny_target("qwen3"), lean=False)  # transformers' forward takes the cache by name
    cache = target.new_cache(2, 32)
    tokens = torch.randint(0, 128, (2, 3))
    target.forward(cache, 0, tokens)  # the right name: every layer wrote once
    assert sorted(cache.written) == list(range(target.num_layers))
    # A name the decoder does not take is swallowed by its **kwargs: it builds a cache of its own.
    target.cache_kwarg = "kv_cache"  # a name this decoder does not take (as `cache` is to 5.17)
    with pytest.raises(RuntimeError, match="wrote the KV cache"):
        target.forward(cache, 0, tokens)


def test_check_cache_written_needs_each_layer_once() -> None:
    cache = RaggedKVCache.contiguous(3, 1, 8, 1, 4, torch.float32, "cpu")
    cache.written = [0, 1, 2]
    check_cache_written(cache, 3)
    for wrong in ([0, 2], [0, 1, 1, 2], []):
        cache.written = wrong
        with pytest.raises(RuntimeError):
            check_cache_written(cache, 3)
