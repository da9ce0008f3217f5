"""Prefill time with prompts sharing their beginnings' KV blocks and without, side by side:
`python -m bench.prefill`. (Until issue 52 it also compared the slot layout's copying prefix cache:
bench/results/prefill_layouts_abab.json.)

The two engines (A, B) load the same prompts in batches (one prefill step each), alternating batch
by batch so machine drift hits both alike. The first batch is reported apart: the cache starts
empty. Decoding is not timed (each request asks for one token). Ratios are A's prefill time over
B's: with sharing over without (below 1: sharing saves time). The batches after the first are also
cut into `--repetitions` consecutive groups, a ratio each, and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.report import write_json
from model.engine.engine import Engine
from model.engine.requests import SamplingParams
from model.load.loading import DEFAULT_TARGET, build_engine
from model.load.prompts import load_prompt_file


def engine_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """A and B: EngineConfig overrides, by label."""
    return {
        "with_cache": {"prefix_cache_tokens": args.cache_tokens, "kv_block_size": args.block_size},
        "without": {"prefix_cache_tokens": 0, "kv_block_size": args.block_size},
    }


def prefill_times(engines: dict[str, Engine], prompts: list[list[int]], batch: int) -> tuple[dict, int]:
    """Per engine, each batch's prefill step time; and the prompt tokens A's cache held after batch 0."""
    times: dict[str, list[float]] = {label: [] for label in engines}
    cached = 0
    first = next(iter(engines))
    for b in range(len(prompts) // batch):
        for label, engine in engines.items():
            for i, prompt in enumerate(prompts[b * batch : (b + 1) * batch]):
                engine.add_request(f"{b}-{i}", prompt, SamplingParams(max_new_tokens=1))
            t0 = time.perf_counter()
            outputs = engine.step()  # the batch's prefill
            times[label].append(time.perf_counter() - t0)
            if label == first and b:
                cached += sum(o.stats.cached_prompt_tokens for o in outputs)
            while engine.has_unfinished():
                engine.step()
    return times, cached


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--repetitions", type=int, default=1, help="groups of batches after the first, a ratio each")
    p.add_argument("--cache-tokens", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16, help="KV block (what prompts share), in tokens")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engines: dict[str, Engine] = {}
    for label, settings in engine_settings(args).items():
        engines[label], tokenizer = build_engine(
            target=args.target, mode="domino", dtype=args.dtype, max_batch_size=args.batch, **settings
        )
    prompts = load_prompt_file(Path(args.prompts), tokenizer)[: args.batch * args.batches]
    times, cached = prefill_times(engines, prompts, args.batch)
    (a, ta), (b, tb) = times.items()
    group = (len(ta) - 1) // args.repetitions
    ratios = [sum(ta[1 + r * group : 1 + (r + 1) * group]) / sum(tb[1 + r * group : 1 + (r + 1) * group])
              for r in range(args.repetitions)]  # fmt: skip
    result = {
        "a": a,
        "b": b,
        "prompts": len(prompts) - args.batch,
        "prompt_tokens": sum(len(q) for q in prompts[args.batch :]),
        "cached_tokens_a": cached,
        f"prefill_s_{a}": round(sum(ta[1:]), 3),
        f"prefill_s_{b}": round(sum(tb[1:]), 3),
        "ratio": round(sum(ta[1:]) / sum(tb[1:]), 3),  # A's time over B's
        "ratios": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "first_batch_ratio": round(ta[0] / tb[0], 3),
        "config": vars(args),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(result, Path(args.json))
    return result


if __name__ == "__main__":
    main()
