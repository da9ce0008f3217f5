"""Where one decode step's time goes on a CPU, for the embedded default: `python -m bench.forward_breakdown`
(issue 56: the gap to llama.cpp is mostly overhead, not bytes; this says how much of each).

A one-row `ar` step and a one-row `domino` step of our engine at a given context (the embedded
default, `--dtype`, `--threads`), against what their parts cost alone with the same shapes:

- weights: every `nn.Linear` of the target (attention and MLP projections, the LM head) applied to
  one token's activations, back to back: the matmuls' own time, mostly reading the weights;
- attention: one query token's scaled-dot-product attention over the context, per layer;
- the rest of the `ar` step: Python, the decoder's small ops (norms, rotary embedding, residual
  adds, activations, cache writes) and framework dispatch around them, and the engine's host work;
- drafting: a `domino` step over an `ar` step (the drafter block, the head, a wider verify).

Each figure is the median of `--repeats` timed runs after warm-up; a step is the engine's own
`step()` on a row that never finishes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench import common
from bench.report import write_reports
from model.engine.engine import Engine, SamplingParams
from model.load.checkpoint import load_drafter
from model.load.loading import DEFAULT_DRAFTER_DIR, DEFAULT_TARGET, load_target, resolve_dtype
from model.load.prompts import load_prompt_file
from model.nn.target import TargetModel


def median_ms(fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


@torch.inference_mode()
def weights_ms(target: TargetModel, warmup: int, repeats: int) -> tuple[float, int]:
    """Every linear layer of the target on one token, back to back; and their bytes."""
    linears = [m for m in target.hf_model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(1, 1, m.in_features, dtype=target.dtype) for m in linears]

    def run() -> None:
        for m, x in zip(linears, inputs):
            F.linear(x, m.weight, m.bias)

    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return median_ms(run, warmup, repeats), nbytes


@torch.inference_mode()
def attention_ms(target: TargetModel, context: int, warmup: int, repeats: int) -> float:
    """One query token over `context` keys per layer (grouped-query heads as the model has them)."""
    heads = int(target.config.num_attention_heads)
    q = torch.randn(1, heads, 1, target.head_dim, dtype=target.dtype)
    k = torch.randn(1, target.kv_heads, context, target.head_dim, dtype=target.dtype)
    v = torch.randn_like(k)

    def run() -> None:
        for _ in range(target.num_layers):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=heads != target.kv_heads)

    return median_ms(run, warmup, repeats)


def step_ms(engine: Engine, prompt: list[int], warmup: int, repeats: int) -> tuple[float, float]:
    """A decode step's median ms for one row with `prompt` before it; tokens per step. The row's
    budget outlasts the steps (at most 17 tokens a step)."""
    budget = engine.max_model_len - len(prompt)
    engine.add_request("row", prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True))
    engine.step()  # the prefill
    tokens = 0

    def run() -> None:
        nonlocal tokens
        for out in engine.step():
            tokens += len(out.new_token_ids)

    ms = median_ms(run, warmup, repeats)
    engine.abort("row")
    engine.step()
    return ms, tokens / (warmup + repeats)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.forward_breakdown", description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=300, help="tokens before the step")
    p.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl", help="the text before the step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has native bf16, else fp32")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, "cpu")
    model, tokenizer = load_target(DEFAULT_TARGET, dtype)
    target = TargetModel(model)
    drafter = load_drafter(str(DEFAULT_DRAFTER_DIR), dtype=dtype, target_config=model.config)
    # Real text before the step (the held-out prompts end to end), so the drafter drafts as it would.
    ids = [t for p in load_prompt_file(Path(args.prompts), tokenizer) for t in p][: args.context]
    max_len = args.context + (args.warmup + args.repeats + 2) * 17 + 64
    w_ms, w_bytes = weights_ms(target, args.warmup, args.repeats)
    a_ms = attention_ms(target, args.context, args.warmup, args.repeats)
    ar = Engine(target, None, mode="ar", max_batch_size=1, max_model_len=max_len)
    ar_ms, _ = step_ms(ar, ids, args.warmup, args.repeats)
    domino = Engine(target, drafter, mode="domino", max_batch_size=1, max_model_len=max_len)
    domino_ms, domino_tokens = step_ms(domino, ids, args.warmup, args.repeats)
    rest = ar_ms - w_ms - a_ms
    cpu = common.cpu_info()
    result = {
        "cpu": cpu,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": args.threads,
        "context": args.context,
        "ar_step_ms": ar_ms,
        "weights_ms": w_ms,
        "weights_bytes": w_bytes,
        "weights_gb_per_s": w_bytes / (w_ms / 1e3) / 1e9,
        "attention_ms": a_ms,
        "rest_ms": rest,
        "domino_step_ms": domino_ms,
        "domino_tokens_per_step": domino_tokens,
        "commit": (common.git_state()["commit"] or "?")[:10],
    }
    rows = [
        ("`ar` step (one token)", ar_ms, "100 %"),
        (f"weights: every linear on one token ({w_bytes / 1e6:.0f} MB, {result['weights_gb_per_s']:.1f} GB/s)",
         w_ms, f"{w_ms / ar_ms:.0%}"),
        (f"attention over {args.context} positions, {target.num_layers} layers", a_ms, f"{a_ms / ar_ms:.0%}"),
        ("the rest: Python, small ops, dispatch, engine host work", rest, f"{rest / ar_ms:.0%}"),
        (f"`domino` step ({domino_tokens:.2f} tokens a step here)", domino_ms,
         f"{domino_ms / ar_ms:.0%}"),
    ]  # fmt: skip
    lines = [
        "# Where a decode step's time goes (`python -m bench.forward_breakdown`)\n",
        f"{cpu['cpu']} ({'AVX-512 BF16' if cpu['avx512_bf16'] else 'no AVX-512 BF16'}); {result['dtype']}; "
        f"{args.threads} thread(s); embedded default at context {args.context}; commit {result['commit']}.\n",
        "| part | ms | of the `ar` step |",
        "|---|---:|---:|",
        *(f"| {name} | {ms:.2f} | {share} |" for name, ms, share in rows),
    ]
    report = "\n".join(lines) + "\n"
    write_reports(result, report, args.json, args.markdown)
    print(report)
    return result


if __name__ == "__main__":
    main()
