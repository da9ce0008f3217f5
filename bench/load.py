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

# This module sends the requests (and is the CLI); what the records come to (summaries, comparisons,
# repetitions) and the files they are written to are in bench/load_results.py, the tables in
# bench/report.py. (A comment, not the docstring: the docstring is --help's text.)

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.load_results import (
    RequestRecord,
    compare,
    summarize_level,
    summarize_repetitions,
    write_compare_reports,
    write_repetition_reports,
    write_reports,
)
from bench.report import ms

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_PROMPTS = "bench/prompts/sharegpt_heldout.jsonl"
DEFAULT_JSON = "bench/results/load.json"
DEFAULT_COMPARE_JSON = "bench/results/load_compare.json"
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
    """The prompt JSONL of model/load/prompts.py's load_prompt_file, kept as text for the server to tokenize."""
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
                f"TTFT p50 {ms(level['ttft_s']['p50'])} ms, ITL p50 {ms(level['itl_s']['p50'])} ms, "
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
