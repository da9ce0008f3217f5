"""Soak test: a live server under mixed traffic at fixed concurrency for N minutes.

    python -m bench.soak --minutes 10                       # the embedded default model
    python -m bench.soak --minutes 0.2 --target DIR --drafter DIR --env DOMINO_DTYPE=float32

Starts `python -m app.main` on a free loopback port (DOMINO_* settings from `--target`, `--drafter`,
`--mode` and `--env KEY=VALUE`), then keeps `--concurrency` clients busy until the time is up, each
cycling through four kinds of request: greedy, sampling, streaming, and cancelled (a stream the
client closes after its first content chunk). Every `--sample-s` seconds it records the server's
RSS (/proc/<pid>/status) and its in-flight count (running + waiting, from /metrics).

Reports: requests and errors per kind (with the first error messages), latency p50/p99 per time
window (`--window-s`), RSS and in-flight drift (mean of the last fifth of the samples minus the mean
of the first fifth), the in-flight count once traffic stopped (must be 0), and the server's exit
status after SIGTERM. JSON goes to `--json` (default bench/results/soak-<UTC time>.json). The exit
status is 1 when a request failed, something stayed in flight, or the server did not exit cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.load_results import quantile
from bench.report import write_json

REPO_ROOT = Path(__file__).resolve().parent.parent
KINDS = ("greedy", "sampling", "stream", "cancel")
PROMPTS = (
    "The quick brown fox",
    "Speculative decoding drafts several tokens and",
    "def add(a, b):",
    "Hello world, hello",
    "Name three colours:",
)
MAX_ERRORS_KEPT = 20


@dataclass
class Record:
    kind: str
    start: float  # seconds since the traffic started
    latency: float
    ok: bool
    error: str | None = None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def in_flight(client: httpx.AsyncClient) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return None
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in ("domino_num_requests_running", "domino_num_requests_waiting"):
            total += sum(s.value for s in family.samples)
    return total


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOMINO_")}
    env.update(OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    for name in ("target", "drafter", "mode"):
        if getattr(args, name):
            env[f"DOMINO_{name.upper()}"] = str(getattr(args, name))
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    env.update(DOMINO_HOST="127.0.0.1", DOMINO_PORT=str(port))
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it; closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "app.main"], cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"the server was not ready after {timeout} s")


def _body(kind: str, i: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens}
    if kind == "greedy":
        body["temperature"] = 0
    else:
        body.update(temperature=0.8, top_p=0.95)
    if kind in ("stream", "cancel"):
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def one_request(client: httpx.AsyncClient, kind: str, i: int, max_tokens: int) -> str | None:
    """None on success, else the error."""
    body = _body(kind, i, max_tokens)
    if kind in ("greedy", "sampling"):
        r = await client.post("/v1/completions", json=body)
        return None if r.status_code == 200 else f"{r.status_code}: {r.text[:200]}"
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"{r.status_code}: {(await r.aread())[:200]!r}"
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"error event: {chunk['error'].get('message')}"
            if kind == "cancel" and any(c.get("text") for c in chunk.get("choices", [])):
                return None  # leaving the block closes the connection: the server must abort it
        return None if done else "stream ended without [DONE]"


async def traffic(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    duration = args.minutes * 60
    records: list[Record] = []
    samples: list[dict[str, float | None]] = []
    counter = itertools.count()
    t0 = time.monotonic()
    end = t0 + duration

    async def client_loop(worker: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
            while time.monotonic() < end:
                i = next(counter)
                kind = KINDS[i % len(KINDS)]
                start = time.monotonic()
                try:
                    error = await one_request(client, kind, i, args.max_tokens)
                except (httpx.HTTPError, ValueError) as exc:
                    error = f"{type(exc).__name__}: {exc}"
                records.append(Record(kind, start - t0, time.monotonic() - start, error is None, error))

    async def sampler() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            while time.monotonic() < end:
                flight = await in_flight(client)
                samples.append({"t": time.monotonic() - t0, "rss_mb": rss_mb(pid), "in_flight": flight})
                await asyncio.sleep(args.sample_s)

    await asyncio.gather(sampler(), *(client_loop(w) for w in range(args.concurrency)))
    # Traffic over: everything must leave the engine (cancelled streams included).
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        settle_deadline = time.monotonic() + 30
        final = await in_flight(client)
        while final != 0 and time.monotonic() < settle_deadline:
            await asyncio.sleep(0.2)
            final = await in_flight(client)
        samples.append({"t": time.monotonic() - t0, "rss_mb": rss_mb(pid), "in_flight": final})
    return summarize(records, samples, final, duration, args.window_s or max(1.0, min(60.0, duration / 6)))


def _drift(values: list[float]) -> float | None:
    if len(values) < 5:
        return None
    fifth = max(1, len(values) // 5)
    return sum(values[-fifth:]) / fifth - sum(values[:fifth]) / fifth


def summarize(
    records: list[Record], samples: list[dict[str, Any]], final: float | None, duration: float, window: float
) -> dict[str, Any]:
    per_kind = {
        k: {"requests": sum(r.kind == k for r in records), "errors": sum(r.kind == k and not r.ok for r in records)}
        for k in KINDS
    }
    windows = []
    for w in range(max(1, int(duration // window + (duration % window > 1e-9)))):
        lo, hi = w * window, (w + 1) * window
        inside = [r for r in records if lo <= r.start < hi]
        lat = [r.latency for r in inside if r.ok and r.kind != "cancel"]
        windows.append(
            {
                "start_s": lo,
                "requests": len(inside),
                "errors": sum(not r.ok for r in inside),
                "p50_s": quantile(lat, 0.5),
                "p99_s": quantile(lat, 0.99),
            }
        )
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    flight = [s["in_flight"] for s in samples if s["in_flight"] is not None]
    return {
        "requests": len(records),
        "errors": sum(not r.ok for r in records),
        "error_messages": [r.error for r in records if not r.ok][:MAX_ERRORS_KEPT],
        "per_kind": per_kind,
        "window_s": window,
        "windows": windows,
        "rss_mb": {"first": rss[0] if rss else None, "last": rss[-1] if rss else None, "max": max(rss, default=None)},
        "rss_drift_mb": _drift(rss),
        "in_flight": {"max": max(flight, default=None), "drift": _drift(flight), "after_traffic": final},
        "samples": samples,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="how long traffic runs")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--target", help="DOMINO_TARGET (default: the server's own default)")
    p.add_argument("--drafter", help="DOMINO_DRAFTER")
    p.add_argument("--mode", help="DOMINO_MODE")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="more server environment")
    p.add_argument("--window-s", type=float, default=None, help="latency window (default: a sixth of the run)")
    p.add_argument("--sample-s", type=float, default=1.0, help="RSS / in-flight sampling period")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="default: bench/results/soak-<UTC time>.json")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    out = args.json or REPO_ROOT / "bench" / "results" / f"soak-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(args, out.with_suffix(".server.log"))
    try:
        wait_ready(proc, url, args.startup_timeout)
        result = asyncio.run(traffic(args, url, proc.pid))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            exit_code: int | None = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = None
    result = {
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "server": {"target": args.target, "drafter": args.drafter, "mode": args.mode, "env": args.env},
        "server_exit_code": exit_code,
        **result,
    }
    result["ok"] = result["errors"] == 0 and result["in_flight"]["after_traffic"] == 0 and exit_code == 0
    write_json(result, out)
    p99 = ", ".join("-" if w["p99_s"] is None else f"{w['p99_s'] * 1000:.0f}" for w in result["windows"])
    print(
        f"soak {args.minutes:g} min at concurrency {args.concurrency}: {result['requests']} requests, "
        f"{result['errors']} errors; p99 ms per {result['window_s']:.0f} s window: {p99}; "
        f"RSS {result['rss_mb']['first']} -> {result['rss_mb']['last']} MB (drift {result['rss_drift_mb']}); "
        f"in flight after traffic {result['in_flight']['after_traffic']}; server exit {exit_code}; -> {out}"
    )
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
