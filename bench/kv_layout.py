"""Slot vs paged KV storage, side by side: `python -m bench.kv_layout`.

Two engines over one target and drafter (the embedded default), one per layout, run the same
requests in turns, A B A B, in one process: at each concurrency `c`, `c * rounds` held-out prompts
are submitted together to an engine of `max_batch_size` c, and its decode throughput (generated
tokens over wall time) is taken per repetition. The ratio paged / slots is reported per repetition
and as its median; whether both layouts produced the same tokens is reported too (fp32 with the
fixed policy must agree; bf16 may part at near-ties, since kernels see different strides, and the
adaptive policy follows measured step times).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench import common
from bench.report import write_reports
from model.engine.engine import Engine, SamplingParams
from model.load.checkpoint import load_drafter
from model.load.loading import DEFAULT_DRAFTER_DIR, eos_token_ids, load_target, resolve_dtype
from model.load.prompts import load_prompt_file
from model.nn.drafter import Drafter
from model.nn.target import TargetModel

LAYOUTS = ("slots", "paged")
PROMPTS = common.REPO / "bench/prompts/sharegpt_heldout.jsonl"


def measure(
    target: TargetModel,
    drafter: Drafter | None,
    prompts: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    repetitions: int,
    eos: list[int],
    **engine_kwargs: Any,
) -> dict[str, Any]:
    """ABAB at one concurrency: tokens/s per layout and repetition, their ratio, token agreement."""
    max_len = max(map(len, prompts)) + max_new_tokens + 1
    mode = "domino" if drafter is not None else "ar"
    engines = {
        layout: Engine(
            target,
            drafter,
            mode=mode,
            max_batch_size=concurrency,
            max_model_len=max_len,
            eos_token_ids=eos,
            kv_layout=layout,
            **engine_kwargs,
        )
        for layout in LAYOUTS
    }
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for engine in engines.values():  # first calls allocate and pick kernels
        engine.generate(prompts[:concurrency], SamplingParams(max_new_tokens=4))
    rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    kv_read: dict[str, int] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(repetitions):
        for layout, engine in engines.items():
            read_before = engine.kv_bytes_read
            t0 = time.perf_counter()
            results = engine.generate(prompts, params)
            wall = time.perf_counter() - t0
            rates[layout].append(sum(len(tokens) for tokens, _, _ in results) / wall)
            kv_read[layout] = engine.kv_bytes_read - read_before
            outputs[layout] = [tokens for tokens, _, _ in results]
    ratios = [b / a for a, b in zip(rates["slots"], rates["paged"])]
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "tokens_per_s": {layout: [round(x, 2) for x in r] for layout, r in rates.items()},
        "paged_over_slots": [round(x, 4) for x in ratios],
        "median": statistics.median(ratios),
        "kv_bytes_read": kv_read,  # the last repetition's
        "same_tokens": outputs["slots"] == outputs["paged"],
    }


def markdown(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    lines = [
        "# Slot vs paged KV storage (`python -m bench.kv_layout`)",
        "",
        f"{env['cpu']}{', AVX-512 BF16' if env['avx512_bf16'] else ''}; {env['dtype']}; {env['threads']} thread(s); "
        f"torch {env['torch']}; load average {env['load_average']} -> {env['load_average_end']}; "
        f"commit {str(env['commit'])[:10]}. Embedded default target + drafter, "
        f"{cfg['mode']}, {cfg['draft_policy']} policy; {cfg['max_new_tokens']} tokens a request (ignore_eos), "
        f"{cfg['repetitions']} repetitions, slots and paged in turns in one process.",
        "",
        "| concurrency | requests | slots tok/s | paged tok/s | paged / slots | median | same tokens |",
        "|---:|---:|---|---|---|---:|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {', '.join(map(str, r['tokens_per_s']['slots']))} | "
            f"{', '.join(map(str, r['tokens_per_s']['paged']))} | {', '.join(map(str, r['paged_over_slots']))} | "
            f"{r['median']:.3f} | {r['same_tokens']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.kv_layout", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrency level = concurrency x rounds")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repetitions", type=int, default=4)
    p.add_argument("--offset", type=int, default=100, help="skip the first N held-out prompts (the training half)")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has native bf16, else fp32")
    p.add_argument("--draft-policy", default="adaptive", choices=["adaptive", "fixed"])
    p.add_argument("--mode", default="domino", choices=["domino", "ar"])
    common.add_output_args(p)  # --threads, --seed, --json, --markdown
    p.set_defaults(threads=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    t0 = time.perf_counter()
    hf, tokenizer = load_target("default", dtype)
    target = TargetModel(hf)
    drafter = (
        load_drafter(str(DEFAULT_DRAFTER_DIR), dtype=dtype, target_config=hf.config) if args.mode != "ar" else None
    )
    prompts = [p for p in load_prompt_file(PROMPTS, tokenizer)[args.offset :] if len(p) <= args.max_prompt_tokens]
    eos = sorted(eos_token_ids(hf, tokenizer))
    env = {**common.host_environment(torch.device("cpu"), dtype), "build_seconds": time.perf_counter() - t0}
    results = []
    for c in common.parse_ints(args.concurrency):
        r = measure(
            target,
            drafter,
            prompts[: c * args.rounds],
            c,
            args.max_new_tokens,
            args.repetitions,
            eos,
            draft_policy=args.draft_policy,
        )
        print(f"concurrency {c}: paged / slots {r['paged_over_slots']} (median {r['median']:.3f})", flush=True)
        results.append(r)
    result = {
        "environment": {**env, "load_average_end": common.load_average()},
        "config": {**common.flags(args), "mode": args.mode},
        "results": results,
    }
    write_reports(result, markdown(result), args.json, args.markdown)
    return result


if __name__ == "__main__":
    main()
