"""What a verify forward costs against a plain decoding step, per dtype: `python -m bench.verify_cost`.

Speculation pays only when a forward over T = k + 1 tokens per row costs little more than one over
a single token. On a CPU that depends on the dtype: fp32 GEMMs slow down with every extra row of a
small batch, while bf16 on a CPU with native bf16 (AVX512-BF16, AMX) stays nearly flat (and its
single-row path is the slowest). This times `TargetModel.forward` over the engine's own ragged cache
at a fixed context, for each dtype and T, interleaved (so machine drift hits every cell alike), and
reports a low quantile per cell: interference on a shared machine only ever adds time.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.report import save_result
from model.load.loading import DEFAULT_TARGET, cpu_has_native_bf16, load_target_as
from model.nn.target import TargetModel


def time_forwards(
    targets: dict[str, TargetModel], tokens: list[int], batch: int, context: int, repeats: int, quantile: float
) -> dict[str, dict[int, float]]:
    """Seconds per forward {dtype: {T: low quantile}} with `context` tokens already cached per row."""
    vocab = min(t.vocab_size for t in targets.values())
    caches = {}
    for name, target in targets.items():
        cache = target.new_cache(batch, context + max(tokens) + 1)
        target.forward(cache, 0, torch.randint(0, vocab, (batch, context)), want_features=False)
        cache.set_lengths(0, [context] * batch)
        caches[name] = cache
    samples: dict[str, dict[int, list[float]]] = {name: {t: [] for t in tokens} for name in targets}
    for _ in range(repeats):
        for name, target in targets.items():
            for t in tokens:
                x = torch.randint(0, vocab, (batch, t))
                t0 = time.perf_counter()
                target.forward(caches[name], 0, x, want_features=False)
                samples[name][t].append(time.perf_counter() - t0)  # rows not advanced: a rollback
    return {
        name: {t: sorted(s)[int(quantile * (len(s) - 1))] for t, s in per_t.items()} for name, per_t in samples.items()
    }


def report(seconds: dict[str, dict[int, float]]) -> str:
    tokens = sorted(next(iter(seconds.values())))
    lines = [
        "| dtype | " + " | ".join(f"T={t}" for t in tokens) + " |",
        "|---|" + "---|" * len(tokens),
    ]
    for name, per_t in seconds.items():
        base = per_t[tokens[0]]
        cells = [f"{1000 * per_t[t]:.1f} ms ({per_t[t] / base:.2f}×)" for t in tokens]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.verify_cost", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="DOMINO_DTYPE values: float32, bfloat16, int4, ..."
    )
    parser.add_argument("--tokens", default="1,2,3,4,5,7,9")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quantile", type=float, default=0.25)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default="bench/results/verify_cost.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    targets = {name: TargetModel(load_target_as(args.target, name, "cpu")[0]) for name in args.dtypes.split(",")}
    seconds = time_forwards(targets, tokens, args.batch, args.context, args.repeats, args.quantile)
    result = {
        "seconds": seconds,
        "config": {
            **{k: v for k, v in vars(args).items() if k != "json"},
            "threads": torch.get_num_threads(),
            "cpu_native_bf16": cpu_has_native_bf16(),
            "torch": torch.__version__,
        },
    }
    save_result(result, args.json, report(seconds))
    return result


if __name__ == "__main__":
    main()
