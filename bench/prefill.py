"""Prefill time with and without the prefix cache, side by side: `python -m bench.prefill`.

Two engines over the same target load the same prompts in batches (one prefill step each), the
engines alternating batch by batch so machine drift hits both alike. The first batch is reported
apart: the cache starts empty. Decoding is not timed (each request asks for one token).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.report import write_json
from model.engine.requests import SamplingParams
from model.load.loading import DEFAULT_TARGET, build_engine
from model.load.prompts import load_prompt_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--cache-tokens", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for tokens in (args.cache_tokens, 0):
        engines[tokens], tokenizer = build_engine(
            target=args.target,
            mode="domino",
            max_batch_size=args.batch,
            prefix_cache_tokens=tokens,
            prefix_block_size=args.block_size,
        )
    prompts = load_prompt_file(Path(args.prompts), tokenizer)[: args.batch * args.batches]
    times: dict[int, list[float]] = {tokens: [] for tokens in engines}
    cached = 0
    for b in range(args.batches):
        batch = prompts[b * args.batch : (b + 1) * args.batch]
        for tokens, engine in engines.items():
            for i, prompt in enumerate(batch):
                engine.add_request(f"{b}-{i}", prompt, SamplingParams(max_new_tokens=1))
            t0 = time.perf_counter()
            outputs = engine.step()  # the batch's prefill
            times[tokens].append(time.perf_counter() - t0)
            if tokens and b:
                cached += sum(o.stats.cached_prompt_tokens for o in outputs)
            while engine.has_unfinished():
                engine.step()
    with_cache, without = times[args.cache_tokens], times[0]
    result = {
        "prompts": len(prompts) - args.batch,
        "prompt_tokens": sum(len(q) for q in prompts[args.batch :]),
        "cached_tokens": cached,
        "prefill_s_with_cache": round(sum(with_cache[1:]), 3),
        "prefill_s_without": round(sum(without[1:]), 3),
        "ratio": round(sum(with_cache[1:]) / sum(without[1:]), 3),
        "first_batch_ratio": round(with_cache[0] / without[0], 3),
        "config": vars(args),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(result, Path(args.json))


if __name__ == "__main__":
    main()
