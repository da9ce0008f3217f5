"""Decoding streams while a long prompt arrives: `python -m bench.interference`.

N streams decode held-out chat prompts (greedy, `ignore_eos`, budgets that outlast the run). Once
all of them run and W steps have passed, a P-token prompt arrives. A stream's gap is the wall time
between two steps that gave it tokens. Per step token budget (`max_num_batched_tokens`; `whole`:
unset, the prompt prefilled in a step of its own as before chunked prefill) it reports the streams'
median gap before the prompt arrived, their p99 and largest gap while it went in (from its arrival
until every stream has emitted after the prompt's first token), p99 over that median, and the
prompt's time to first token. The budgets run in turns (A B A B ...), each on a fresh engine over
the same target and drafter, so machine drift hits them alike.

`--url`: the same scenario served (issue 53's): against a running server, N completion streams
(SSE, greedy, `ignore_eos`, `--stream-tokens` each, prompts from the held-out file as text) start
together; `--delay` seconds in, a P-token prompt (held-out text tokenized by the server's /tokenize,
sent as token ids, one token asked for) arrives. A stream's gap is the wall time between two of its
SSE chunks. Reported: the streams' median gap outside the long prompt's prefill (from its sending
to its answer), their p99 and largest gap inside it, p99 over that median, and the prompt's TTFT.
Start the server with and without DOMINO_MAX_NUM_BATCHED_TOKENS to compare:
`scripts/bench_interference_served.sh` runs two servers in turns and `--summarize` puts their
records together (per label: every run and the medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench import common
from bench.report import write_json
from model.engine.engine import Engine
from model.engine.requests import SamplingParams
from model.load.loading import DEFAULT_TARGET, build_engine
from model.load.prompts import load_prompt_file


def long_prompt(prompts: list[list[int]], tokens: int) -> list[int]:
    """`tokens` prompt tokens: held-out prompts one after another (real text, not one repeated)."""
    out: list[int] = []
    for p in prompts:
        out += p
        if len(out) >= tokens:
            return out[:tokens]
    raise ValueError(f"the prompt file holds {len(out)} tokens, {tokens} asked for")


def run_once(engine: Engine, streams: list[list[int]], prompt: list[int], warm_steps: int) -> dict[str, Any]:
    """One run: the streams' gaps before and during the long prompt's prefill, and its TTFT."""
    for i, p in enumerate(streams):
        engine.add_request(f"s{i}", p, SamplingParams(max_new_tokens=4096 - len(p) - 64, ignore_eos=True))
    last: dict[str, float] = {}
    before: list[float] = []
    during: list[float] = []

    def step(window: list[float] | None) -> list[Any]:
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id.startswith("s") and out.new_token_ids:
                if window is not None and out.request_id in last:
                    window.append(now - last[out.request_id])
                last[out.request_id] = now
        return outputs

    while len(engine.rows) < len(streams):
        step(None)
    for _ in range(warm_steps):
        step(before)
    engine.add_request("long", prompt, SamplingParams(max_new_tokens=1))
    chunks = engine.num_prefill_chunks
    t0 = time.perf_counter()
    while not any(o.request_id == "long" for o in step(during)):
        pass
    ttft = time.perf_counter() - t0
    # Until every stream has emitted again: a prompt prefilled whole stalls them in a step that
    # emits nothing, and the gap shows on their next emission.
    mark = time.perf_counter()
    while any(last.get(f"s{i}", 0.0) < mark for i in range(len(streams))):
        step(during)
    for i in range(len(streams)):
        engine.abort(f"s{i}")
    while engine.has_unfinished():
        engine.step()
    median = statistics.median(before)
    p99 = float(np.percentile(during, 99))
    return {
        "median_gap_before_ms": round(1e3 * median, 1),
        "p99_gap_during_ms": round(1e3 * p99, 1),
        "max_gap_during_ms": round(1e3 * max(during), 1),
        "p99_over_median": round(p99 / median, 2),
        "ttft_long_s": round(ttft, 3),
        "prefill_chunks": engine.num_prefill_chunks - chunks,
    }


def medians(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each field's median over the repetitions' records."""
    return {key: statistics.median(r[key] for r in records) for key in records[0]}


def held_out_texts(path: Path) -> list[str]:
    """The first user message of every held-out conversation."""
    texts = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        texts.append(next(m["content"] for m in messages if m["role"] == "user"))
    return texts


def served_run(
    url: str, texts: list[str], streams: int, stream_tokens: int, prompt_tokens: int, delay: float, chars: int = 1000
) -> dict:
    """Issue 53's served scenario against the server at `url` (see the module's docstring)."""
    client = httpx.Client(base_url=url, timeout=600)
    long_ids: list[int] = []
    for text in texts[streams:]:
        long_ids += client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        if len(long_ids) >= prompt_tokens:
            break
    long_ids = long_ids[:prompt_tokens]
    chunks: list[list[float]] = [[] for _ in range(streams)]

    def stream(i: int) -> None:
        body = {"prompt": texts[i][:chars], "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks[i].append(time.perf_counter())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    time.sleep(delay)
    sent = time.perf_counter()
    answer = client.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 1, "temperature": 0})
    answered = time.perf_counter()
    answer.raise_for_status()
    for t in threads:
        t.join()
    inside, outside = [], []
    for times in chunks:
        for a, b in zip(times, times[1:]):
            (inside if b > sent and a < answered else outside).append(b - a)
    median = statistics.median(outside)
    p99 = float(np.percentile(inside, 99))
    return {
        "median_gap_outside_ms": round(1e3 * median, 1),
        "p99_gap_during_ms": round(1e3 * p99, 1),
        "max_gap_during_ms": round(1e3 * max(inside), 1),
        "p99_over_median": round(p99 / median, 2),
        "ttft_long_s": round(answered - sent, 3),
        "gaps_during": len(inside),
    }


def summarize(files: list[Path]) -> dict[str, Any]:
    """Served records of several invocations (each `--url ... --json`) grouped by label: every run,
    the medians over them, and a table."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        record = json.loads(path.read_text())
        runs.setdefault(record["label"], []).extend(record["runs"])
    summary = {label: medians(records) for label, records in runs.items()}
    lines = [
        "| server | runs | streams' median gap outside, ms | p99 gap during, ms | p99 / median | its TTFT, s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, m in summary.items():
        lines.append(
            f"| {label} | {len(runs[label])} | {m['median_gap_outside_ms']:.0f} | {m['p99_gap_during_ms']:.0f} | "
            f"{m['p99_over_median']:.2f} | {m['ttft_long_s']:.2f} |"
        )
    return {"runs": runs, "median_over_reps": summary, "table": "\n".join(lines)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--budgets", default="whole,128", help="max_num_batched_tokens values; 'whole': unset")
    p.add_argument("--warm-steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--url", default=None, help="a running server: the served scenario instead")
    p.add_argument("--stream-tokens", type=int, default=160)
    p.add_argument("--delay", type=float, default=8.0, help="seconds after the streams start (served)")
    p.add_argument("--label", default="served", help="what the server runs with (served)")
    p.add_argument("--stream-chars", type=int, default=1000, help="characters of each stream's prompt (served)")
    p.add_argument("--summarize", default=None, help="comma-separated served results (--json) to put together")
    args = p.parse_args(argv)
    if args.summarize:
        combined = summarize([Path(f) for f in args.summarize.split(",")])
        print(combined["table"])
        if args.json:
            write_json(combined, Path(args.json))
        return combined
    if args.url:
        texts = held_out_texts(Path(args.prompts))
        scenario = (args.streams, args.stream_tokens, args.prompt_tokens, args.delay, args.stream_chars)
        runs = [served_run(args.url, texts, *scenario) for _ in range(args.reps)]
        for record in runs:
            print(f"{args.label}: {record}", flush=True)
        served = {"label": args.label, "config": vars(args), "runs": runs, "median_over_reps": medians(runs)}
        if args.json:
            write_json(served, Path(args.json))
        return served
    torch.set_num_threads(args.threads)
    base, tokenizer = build_engine(
        target=args.target, mode="domino", dtype=args.dtype, max_batch_size=args.streams + 1, max_model_len=4096
    )
    prompts = load_prompt_file(Path(args.prompts), tokenizer)
    streams = prompts[: args.streams]
    prompt = long_prompt(prompts[args.streams :], args.prompt_tokens)
    budgets = {b: None if b == "whole" else int(b) for b in args.budgets.split(",")}
    runs: dict[str, list[dict[str, Any]]] = {b: [] for b in budgets}
    for rep in range(args.reps):
        for label, tokens in budgets.items():
            engine = Engine(base.target, base.drafter, replace(base.config, max_num_batched_tokens=tokens))
            record = run_once(engine, streams, prompt, args.warm_steps)
            print(f"rep {rep} budget {label}: {record}", flush=True)
            runs[label].append(record)
            del engine
    result = {
        "environment": common.host_environment(torch.device("cpu"), base.target.dtype),
        "config": vars(args),
        "runs": runs,
        "median_over_reps": {label: medians(records) for label, records in runs.items()},
    }
    print(result["median_over_reps"])
    if args.json:
        write_json(result, Path(args.json))
    return result


if __name__ == "__main__":
    main()
