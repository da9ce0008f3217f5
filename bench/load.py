"""Load test of a running server over HTTP: N concurrent streaming clients, per concurrency level.

    python -m bench.load --concurrency 1,4,8,16 --requests 64 --max-tokens 256 --label domino
    python -m bench.load --compare bench/results/domino.json,bench/results/ar.json --json bench/results/cmp.json
    python -m bench.load --repetitions bench/results/cmp_1.json,bench/results/cmp_2.json --json bench/results/reps.json

Each level runs `--requests` streaming requests (`stream: true`, `stream_options.include_usage`)
through a pool of `concurrency` workers, cycling over the prompts of `--prompts` (JSONL lines
{"prompt": str} -> /v1/completions, {"messages": [...]} -> /v1/chat/completions, {"prompt_ids": [...]}
-> /v1/completions with token ids). Everything is bounded: the request count, a per-request timeout
and a per-level deadline (requests not started by then are skipped, running ones are cut off at it).

Per request: TTFT (request sent -> first chunk with non-empty content), e2e latency (request sent ->
`[DONE]`), completion tokens (from the final usage chunk), the `spec_decode` statistics, and the
gaps between content chunks. Under speculative decoding one chunk may carry several tokens and the
stream does not say how many, so the inter-token latency (ITL) of a gap is the gap divided by the
request's mean tokens per content chunk (usage.completion_tokens / content chunks): a per-token
latency that is comparable between speculative and plain (`DOMINO_MODE=ar`) servers. ITL quantiles
pool every gap of every request of a level; TTFT / e2e quantiles are over requests.

Per level: output tokens/s (completion tokens of successful requests / the level's wall time),
requests/s, TTFT / ITL / e2e p50 / p90 / p99, mean acceptance length ((accepted draft tokens + verify
steps) / verify steps, summed over requests; 1.00 under `DOMINO_MODE=ar`, none when the server sends no
`spec_decode`), and errors. Results go to `--json`, with a Markdown table (`.md`) and plots
(`_throughput.png`, `_latency.png`) beside it. `--compare A.json,B.json` writes JSON, Markdown and a
`_throughput.png` for two runs side by side (A / B ratio of output tokens/s per level).
`--repetitions C1.json,C2.json,...` summarises several such comparisons of the same two servers run
alternately (ABAB): per level, each repetition's ratio, their median and range, and the ratio of the
mean throughputs, so that one lucky or unlucky repetition does not decide.

Only loopback servers are accepted (127.0.0.0/8, ::1, localhost): this tool generates load.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_PROMPTS = "bench/prompts/sharegpt_heldout.jsonl"
DEFAULT_JSON = "bench/results/load.json"
DEFAULT_COMPARE_JSON = "bench/results/load_compare.json"
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
MAX_ERROR_TEXT = 300


# -- inputs ----------------------------------------------------------------------------------------


def check_loopback_url(url: str) -> str:
    """The URL without a trailing slash; ValueError unless it is http(s) to a loopback host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"--url must be http:// or https://, got {url!r}")
    host = parts.hostname or ""
    if host != "localhost":
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"--url host {host!r} is not loopback (use 127.0.0.1, ::1 or localhost)") from None
        # is_loopback is exactly 127.0.0.0/8 for IPv4 and ::1 for IPv6 (mapped addresses are refused).
        if not addr.is_loopback:
            raise ValueError(f"--url host {host!r} is not loopback (use 127.0.0.1, ::1 or localhost)")
    return url.rstrip("/")


@dataclass
class PromptItem:
    path: str  # the route: /v1/completions or /v1/chat/completions
    payload: dict[str, Any]  # {"prompt": ...} or {"messages": ...}


def load_prompts(path: Path) -> list[PromptItem]:
    """The prompt JSONL of model/prompts.py's load_prompt_file, kept as text for the server to tokenize."""
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        obj = json.loads(line)
        if "messages" in obj:
            items.append(PromptItem("/v1/chat/completions", {"messages": obj["messages"]}))
        elif "prompt_ids" in obj:
            items.append(PromptItem("/v1/completions", {"prompt": list(obj["prompt_ids"])}))
        elif "prompt" in obj:
            items.append(PromptItem("/v1/completions", {"prompt": obj["prompt"]}))
        else:
            raise ValueError(f"{path}:{n}: expected a 'prompt', 'messages' or 'prompt_ids' key")
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,8,16, got {text!r}")
    return levels


# -- one request -----------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    index: int
    prompt: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    content_chunks: int = 0
    spec_decode: dict[str, Any] | None = None
    itl_s: list[float] = field(default_factory=list)  # per-token gaps (not written to the JSON)


def _error_text(body: bytes) -> str:
    text = body.decode(errors="replace")
    try:
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return text[:MAX_ERROR_TEXT]


def _content(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def _stream_one(client: httpx.AsyncClient, item: PromptItem, body: dict[str, Any], rec: RequestRecord) -> None:
    chunk_times: list[float] = []
    usage: dict[str, Any] | None = None
    done = False
    t0 = time.perf_counter()
    async with client.stream("POST", item.path, json={**body, **item.payload}) as resp:
        if resp.status_code != 200:
            rec.error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            obj = json.loads(data)
            if "error" in obj:  # the server's in-stream error event
                err = obj["error"]
                rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                return
            if any(_content(c) for c in obj.get("choices") or []):
                chunk_times.append(now)
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("spec_decode"):
                rec.spec_decode = obj["spec_decode"]
    end = time.perf_counter()
    if not done:
        rec.error = "stream ended before [DONE]"
    elif usage is None:
        rec.error = "no usage chunk in the stream (stream_options.include_usage unsupported?)"
    if rec.error:
        return
    assert usage is not None
    rec.ok = True
    rec.e2e_s = end - t0
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    rec.content_chunks = len(chunk_times)
    if chunk_times:
        rec.ttft_s = chunk_times[0] - t0
        # Chunks may carry several tokens each: spread the request's tokens evenly over its chunks.
        per_chunk = max(rec.completion_tokens, len(chunk_times)) / len(chunk_times)
        rec.itl_s = [(b - a) / per_chunk for a, b in itertools.pairwise(chunk_times)]


async def run_request(
    client: httpx.AsyncClient, item: PromptItem, body: dict[str, Any], rec: RequestRecord, timeout: float
) -> RequestRecord:
    try:
        # httpx's timeout bounds each read; wait_for bounds the whole stream.
        await asyncio.wait_for(_stream_one(client, item, body, rec), timeout)
    except TimeoutError:
        rec.error = f"timeout after {timeout:g} s"
    except Exception as exc:  # a failed request is a result, never the end of the run
        rec.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_TEXT]
    if rec.error:
        rec.ok = False
    return rec


# -- one concurrency level -------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default): monotone in q."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {name: quantile(values, q) for name, q in QUANTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["n"] = len(values)
    return out


def summarize_level(concurrency: int, records: list[RequestRecord], skipped: int, wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    drafts = sum(int((r.spec_decode or {}).get("num_drafts") or 0) for r in ok)
    draft_tokens = sum(int((r.spec_decode or {}).get("num_draft_tokens") or 0) for r in ok)
    accepted = sum(int((r.spec_decode or {}).get("num_accepted_tokens") or 0) for r in ok)
    with_drafts = sum(int((r.spec_decode or {}).get("num_steps_with_drafts") or 0) for r in ok)
    errors = [r for r in records if not r.ok]
    return {
        "concurrency": concurrency,
        "requests": len(records) + skipped,
        "completed": len(ok),
        "errors": len(errors),
        "skipped": skipped,
        "error_messages": sorted({r.error or "" for r in errors})[:10],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([x for r in ok for x in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "mean_acceptance_length": (accepted + drafts) / drafts if drafts else None,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        # Share of verify steps that verified drafts: τ near 1 with a low share means the policy
        # kept speculation off, not that drafts failed.
        "draft_step_share": with_drafts / drafts if drafts else None,
        "spec_decode": {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted},
        "per_request": [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in records],
    }


async def run_level(
    client: httpx.AsyncClient,
    prompts: list[PromptItem],
    body: dict[str, Any],
    concurrency: int,
    num_requests: int,
    timeout: float,
    deadline_s: float,
) -> dict[str, Any]:
    next_index = itertools.count()  # shared by the workers; next() cannot interleave on one event loop
    records: list[RequestRecord] = []
    skipped = 0
    start = time.perf_counter()
    deadline = start + deadline_s

    async def worker() -> None:
        nonlocal skipped
        while (i := next(next_index)) < num_requests:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                skipped += 1
                continue
            rec = RequestRecord(index=i, prompt=i % len(prompts))
            records.append(await run_request(client, prompts[rec.prompt], body, rec, min(timeout, remaining)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    records.sort(key=lambda r: r.index)
    return summarize_level(concurrency, records, skipped, wall)


# -- the run ---------------------------------------------------------------------------------------


async def first_model_id(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {resp.status_code}: {_error_text(resp.content)}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no model")
    return str(data[0]["id"])


async def run_load(args: argparse.Namespace, url: str, prompts: list[PromptItem]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency), max_keepalive_connections=max(args.concurrency))
    # trust_env=False: an HTTP(S)_PROXY setting must not route loopback load elsewhere.
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=httpx.Timeout(args.timeout), limits=limits, trust_env=False
    ) as client:
        model = args.model or await first_model_id(client)
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.ignore_eos:
            body["ignore_eos"] = True
        # Warm-up outside the measurement: first calls allocate caches and pick kernels.
        for i in range(args.warmup):
            rec = await run_request(client, prompts[i % len(prompts)], body, RequestRecord(-1, i), args.timeout)
            if not rec.ok:
                raise RuntimeError(f"warm-up request failed: {rec.error}")
        levels: dict[str, Any] = {}
        for c in args.concurrency:
            level = await run_level(client, prompts, body, c, args.requests, args.timeout, args.deadline)
            levels[str(c)] = level
            print(
                f"concurrency {c:>3}: {level['completed']}/{level['requests']} ok, "
                f"{level['output_tokens_per_s']:.1f} tok/s, {level['requests_per_s']:.2f} req/s, "
                f"TTFT p50 {_ms(level['ttft_s']['p50'])} ms, ITL p50 {_ms(level['itl_s']['p50'])} ms, "
                f"errors {level['errors']}",
                flush=True,
            )
    return {
        "label": args.label,
        "url": url,
        "model": model,
        "levels": levels,
        "config": {
            "prompts_file": str(args.prompts),
            "prompts": len(prompts),
            "requests_per_level": args.requests,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "timeout_s": args.timeout,
            "deadline_s": args.deadline,
            "warmup": args.warmup,
            "itl": "chunk gap / (usage.completion_tokens / content chunks) of the request",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    }


# -- reports ---------------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _qs(dist: dict[str, Any]) -> str:
    return " / ".join(_ms(dist[name]) for name, _ in QUANTILES)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _levels(result: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return sorted(((int(k), v) for k, v in result["levels"].items()), key=lambda kv: kv[0])


def write_reports(result: dict[str, Any], json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    stem = json_path.with_suffix("")
    levels = _levels(result)
    lines = [
        f"Load test `{result['label'] or '-'}`: model `{result['model']}` at {result['url']}, "
        f"max_tokens {result['config']['max_tokens']}, temperature {result['config']['temperature']}. "
        "Latencies in ms, p50 / p90 / p99.",
        "",
        "| concurrency | ok / requests | errors | output tok/s | req/s | TTFT | ITL (per token) | e2e | τ mean "
        "| steps verifying drafts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, lv in levels:
        share = lv.get("draft_step_share")
        lines.append(
            f"| {c} | {lv['completed']} / {lv['requests']} | {lv['errors'] + lv['skipped']} | "
            f"{lv['output_tokens_per_s']:.1f} | {lv['requests_per_s']:.2f} | {_qs(lv['ttft_s'])} | "
            f"{_qs(lv['itl_s'])} | {_qs(lv['e2e_s'])} | {_num(lv['mean_acceptance_length'])} | "
            f"{'–' if share is None else f'{share:.0%}'} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")

    plt = _pyplot()
    xs = [c for c, _ in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [lv["output_tokens_per_s"] for _, lv in levels], marker="o", label=result["label"] or None)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(f"{stem}_throughput.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL (per token)", "end-to-end")):
        for name, _ in QUANTILES:
            ys = [lv[key][name] * 1000 if lv[key][name] is not None else math.nan for _, lv in levels]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"{stem}_latency.png", dpi=100)
    plt.close(fig)


def compare(path_a: Path, path_b: Path) -> dict[str, Any]:
    a, b = json.loads(path_a.read_text()), json.loads(path_b.read_text())
    name_a, name_b = a.get("label") or path_a.stem, b.get("label") or path_b.stem
    if name_a == name_b:  # keep the columns apart when both runs carry the same label
        name_a, name_b = f"{name_a} (A)", f"{name_b} (B)"
    common = sorted(set(a["levels"]) & set(b["levels"]), key=int)
    levels = {}
    for c in common:
        la, lb = a["levels"][c], b["levels"][c]
        ta, tb = la["output_tokens_per_s"], lb["output_tokens_per_s"]
        levels[c] = {
            "concurrency": int(c),
            "a_output_tokens_per_s": ta,
            "b_output_tokens_per_s": tb,
            "output_tokens_per_s_ratio": ta / tb if tb > 0 else None,
            "a_requests_per_s": la["requests_per_s"],
            "b_requests_per_s": lb["requests_per_s"],
            **{f"{side}_{key}": lv[key] for side, lv in (("a", la), ("b", lb)) for key in ("ttft_s", "itl_s", "e2e_s")},
            "a_mean_acceptance_length": la["mean_acceptance_length"],
            "b_mean_acceptance_length": lb["mean_acceptance_length"],
            "a_errors": la["errors"] + la["skipped"],
            "b_errors": lb["errors"] + lb["skipped"],
        }
    return {
        "a": {"label": name_a, "path": str(path_a), "model": a.get("model"), "url": a.get("url")},
        "b": {"label": name_b, "path": str(path_b), "model": b.get("model"), "url": b.get("url")},
        "levels": levels,
    }


def write_compare_reports(result: dict[str, Any], json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    stem = json_path.with_suffix("")
    na, nb = result["a"]["label"], result["b"]["label"]
    levels = sorted(result["levels"].values(), key=lambda lv: lv["concurrency"])
    lines = [
        f"A = `{na}` ({result['a']['path']}), B = `{nb}` ({result['b']['path']}). "
        "Latencies in ms (p50); ITL per token.",
        "",
        f"| concurrency | {na} tok/s | {nb} tok/s | A / B | TTFT A / B | ITL A / B | e2e A / B | "
        "τ A / B | errors A / B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        pairs = " | ".join(
            f"{_ms(lv[f'a_{k}']['p50'])} / {_ms(lv[f'b_{k}']['p50'])}" for k in ("ttft_s", "itl_s", "e2e_s")
        )
        ratio = lv["output_tokens_per_s_ratio"]
        lines.append(
            f"| {lv['concurrency']} | {lv['a_output_tokens_per_s']:.1f} | {lv['b_output_tokens_per_s']:.1f} | "
            f"{_num(ratio)}{'×' if ratio is not None else ''} | {pairs} | "
            f"{_num(lv['a_mean_acceptance_length'])} / {_num(lv['b_mean_acceptance_length'])} | "
            f"{lv['a_errors']} / {lv['b_errors']} |"
        )
    if not levels:
        lines.append("| (no concurrency level in common) | | | | | | | | |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")

    plt = _pyplot()
    xs = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [lv["a_output_tokens_per_s"] for lv in levels], marker="o", label=na)
    ax1.plot(xs, [lv["b_output_tokens_per_s"] for lv in levels], marker="s", label=nb)
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("output tokens/s")
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ratios = [lv["output_tokens_per_s_ratio"] or 0.0 for lv in levels]
    ax2.bar([str(x) for x in xs], ratios)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel(f"output tokens/s, {na} / {nb}")
    if xs:
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(xs, [str(x) for x in xs])
    fig.tight_layout()
    fig.savefig(f"{stem}_throughput.png", dpi=100)
    plt.close(fig)


def summarize_repetitions(paths: list[Path]) -> dict[str, Any]:
    """Per concurrency level over several `--compare` results of the same A and B: each
    repetition's A / B ratio and τ of A, the median ratio and range, and mean(A) / mean(B)."""
    runs = [json.loads(p.read_text()) for p in paths]
    common = sorted(set.intersection(*(set(r["levels"]) for r in runs)), key=int)
    levels = {}
    for c in common:
        per = [r["levels"][c] for r in runs]
        ratios = [lv["output_tokens_per_s_ratio"] for lv in per]
        known = sorted(x for x in ratios if x is not None)
        mean_a = sum(lv["a_output_tokens_per_s"] for lv in per) / len(per)
        mean_b = sum(lv["b_output_tokens_per_s"] for lv in per) / len(per)
        levels[c] = {
            "concurrency": int(c),
            "ratios": ratios,
            "ratio_median": quantile(known, 0.5) if known else None,
            "ratio_min": known[0] if known else None,
            "ratio_max": known[-1] if known else None,
            "mean_a_output_tokens_per_s": mean_a,
            "mean_b_output_tokens_per_s": mean_b,
            "ratio_of_means": mean_a / mean_b if mean_b > 0 else None,
            "a_mean_acceptance_length": [lv["a_mean_acceptance_length"] for lv in per],
            "errors": sum(lv["a_errors"] + lv["b_errors"] for lv in per),
        }
    return {
        "a": runs[0]["a"]["label"],
        "b": runs[0]["b"]["label"],
        "repetitions": [str(p) for p in paths],
        "levels": levels,
    }


def write_repetition_reports(result: dict[str, Any], json_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    na, nb, n = result["a"], result["b"], len(result["repetitions"])
    lines = [
        f"`{na}` / `{nb}` output tokens/s over {n} alternating repetitions ({', '.join(result['repetitions'])}).",
        "",
        f"| concurrency | per repetition | median | range | mean {na} / mean {nb} tok/s | ratio of means | "
        f"τ {na} per repetition | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lv in sorted(result["levels"].values(), key=lambda lv: lv["concurrency"]):
        per = ", ".join(f"{_num(x)}×" for x in lv["ratios"])
        taus = ", ".join(_num(x) for x in lv["a_mean_acceptance_length"])
        lines.append(
            f"| {lv['concurrency']} | {per} | {_num(lv['ratio_median'])}× | "
            f"{_num(lv['ratio_min'])}–{_num(lv['ratio_max'])}× | "
            f"{lv['mean_a_output_tokens_per_s']:.1f} / {lv['mean_b_output_tokens_per_s']:.1f} | "
            f"{_num(lv['ratio_of_means'])}× | {taus} | {lv['errors']} |"
        )
    json_path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench.load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=DEFAULT_URL, help="server base URL (loopback only)")
    p.add_argument("--prompts", type=Path, default=Path(DEFAULT_PROMPTS), help="prompt JSONL")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 4, 8, 16], help="levels, run in turn")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens per request")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=1800.0, help="seconds per concurrency level")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level")
    p.add_argument(
        "--api-key", default=os.environ.get("DOMINO_API_KEY"), help="bearer token (default: $DOMINO_API_KEY)"
    )
    p.add_argument("--label", default="", help="free text stored in the JSON, e.g. the server's DOMINO_MODE")
    p.add_argument("--json", type=Path, default=None, help=f"output (default {DEFAULT_JSON}, {DEFAULT_COMPARE_JSON})")
    p.add_argument("--compare", default=None, metavar="A.json,B.json", help="compare two runs instead of running")
    p.add_argument(
        "--repetitions",
        default=None,
        metavar="C1.json,C2.json,...",
        help="summarise several --compare results of the same two servers instead of running",
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare:
        paths = [Path(x) for x in args.compare.split(",") if x.strip()]
        if len(paths) != 2:
            parser.error("--compare takes two result files: A.json,B.json")
        result = compare(paths[0], paths[1])
        out = args.json or Path(DEFAULT_COMPARE_JSON)
        write_compare_reports(result, out)
        print(out.with_suffix(".md").read_text())
        return result
    if args.repetitions:
        paths = [Path(x) for x in args.repetitions.split(",") if x.strip()]
        if not paths or args.json is None:
            parser.error("--repetitions takes one or more --compare results and needs --json")
        result = summarize_repetitions(paths)
        write_repetition_reports(result, args.json)
        print(args.json.with_suffix(".md").read_text())
        return result
    try:
        url = check_loopback_url(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    if args.requests < 1 or args.max_tokens < 1 or args.timeout <= 0 or args.deadline <= 0 or args.warmup < 0:
        parser.error("--requests and --max-tokens must be >= 1, --timeout and --deadline > 0, --warmup >= 0")
    try:
        prompts = load_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    try:
        result = asyncio.run(run_load(args, url, prompts))
    except (RuntimeError, httpx.HTTPError) as exc:
        print(f"bench.load: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    out = args.json or Path(DEFAULT_JSON)
    write_reports(result, out)
    print(out.with_suffix(".md").read_text())
    return result


if __name__ == "__main__":
    main()
