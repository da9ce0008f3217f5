"""Where one decode step's time goes on a CPU, for the embedded default: `python -m bench.forward_breakdown`
(issue 56: how much of the gap to llama.cpp is overhead and how much the weights' reads).

A one-row `ar` step and a one-row `domino` step of our engine at a given context (the embedded
default, `--dtype`, `--threads`), and the `ar` step under torch.profiler split by where the time
goes: the matmuls (`aten::mm`/`addmm`: the weights), the attention kernels, every other op (norms,
rotary embedding, residual adds, cache writes, ...) and time in no op at all (Python, dispatch,
the engine's host work, and the profiler's own overhead). Beside them, every linear layer of the
target applied to one token alone, back to back, and the LM head alone: the bandwidth the matmul
kernels reach on these shapes.

Each unprofiled figure is the median of `--repeats` timed runs after warm-up; a step is the
engine's own `step()` on a row that never finishes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench import common
from bench.report import write_reports
from model.engine.engine import Engine, SamplingParams
from model.load.checkpoint import load_drafter
from model.load.loading import DEFAULT_DRAFTER_DIR, DEFAULT_TARGET, load_target_as, match_packing
from model.load.prompts import load_prompt_file
from model.nn.packed import PackedLinear
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


def weight_bytes(layer: nn.Module) -> int:
    """Bytes a layer reads for one token: a dense weight, or a packed one with its scales."""
    if isinstance(layer, PackedLinear):
        return sum(b.numel() * b.element_size() for n, b in layer.named_buffers() if n != "wide")
    return layer.weight.numel() * layer.weight.element_size()


@torch.inference_mode()
def layer_ms(layers: list[nn.Module], dtype: torch.dtype, warmup: int, repeats: int) -> tuple[float, int]:
    """These layers applied to one token each, back to back; and the bytes they read."""
    inputs = [torch.randn(1, 1, m.in_features, dtype=dtype) for m in layers]

    def run() -> None:
        for m, x in zip(layers, inputs):
            m(x)

    return median_ms(run, warmup, repeats), sum(weight_bytes(m) for m in layers)


def linear_layers(target: TargetModel) -> list[nn.Module]:
    """The target's linear layers (dense or packed), the LM head last."""
    return [m for m in target.hf_model.modules() if isinstance(m, nn.Linear | PackedLinear)]


MATMULS = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")


def is_attention(name: str) -> bool:
    return "scaled_dot_product" in name or "flash_attention" in name


def profiled_split(engine: Engine, prompt: list[int], steps: int) -> dict[str, float]:
    """ms per step under torch.profiler, by where the time goes: the matmuls (`MATMULS`: the
    weights), the attention kernels, every other op, and time in no op at all (Python, dispatch,
    the engine's host work; the profiler's own overhead inflates this part)."""
    from torch.profiler import ProfilerActivity, profile

    budget = engine.max_model_len - len(prompt)
    engine.add_request("row", prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True))
    for _ in range(3):  # the prefill and two warm-up steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t0
    engine.abort("row")
    engine.step()
    split = {"matmuls": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.key_averages():
        us = event.self_cpu_time_total
        if event.key in MATMULS:
            split["matmuls"] += us
        elif is_attention(event.key):
            split["attention"] += us
        else:
            split["other ops"] += us
    out = {k: v / 1e3 / steps for k, v in split.items()}
    out["in no op"] = 1e3 * wall / steps - sum(out.values())
    out["profiled step"] = 1e3 * wall / steps
    return out


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
    p.add_argument("--dtype", default="auto", help=common.DTYPE_HELP)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--profiled-steps", type=int, default=10, help="`ar` steps under torch.profiler")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, dtype = load_target_as(DEFAULT_TARGET, args.dtype)
    target = TargetModel(model)
    drafter = load_drafter(str(DEFAULT_DRAFTER_DIR), dtype=dtype, target_config=model.config)
    match_packing(model, drafter)
    # Real text before the step (the held-out prompts end to end), so the drafter drafts as it would.
    ids = [t for p in load_prompt_file(Path(args.prompts), tokenizer) for t in p][: args.context]
    max_len = args.context + (args.warmup + args.repeats + 2) * 17 + 64
    w_ms, w_bytes = layer_ms(linear_layers(target), target.dtype, args.warmup, args.repeats)
    head_ms, head_bytes = layer_ms([target.lm_head], target.dtype, args.warmup, args.repeats)
    ar = Engine(target, None, mode="ar", max_batch_size=1, max_model_len=max_len)
    ar_ms, _ = step_ms(ar, ids, args.warmup, args.repeats)
    split = profiled_split(ar, ids, args.profiled_steps)
    domino = Engine(target, drafter, mode="domino", max_batch_size=1, max_model_len=max_len)
    domino_ms, domino_tokens = step_ms(domino, ids, args.warmup, args.repeats)
    cpu = common.cpu_info()
    result = {
        "cpu": cpu,
        "dtype": common.dtype_label(args.dtype, dtype),
        "threads": args.threads,
        "context": args.context,
        "ar_step_ms": ar_ms,
        "ar_profiled_ms": split,
        "weights_ms": w_ms,
        "weights_bytes": w_bytes,
        "weights_gb_per_s": w_bytes / (w_ms / 1e3) / 1e9,
        "lm_head_ms": head_ms,
        "lm_head_bytes": head_bytes,
        "domino_step_ms": domino_ms,
        "domino_tokens_per_step": domino_tokens,
        "commit": (common.git_state()["commit"] or "?")[:10],
    }
    profiled = split["profiled step"]
    rows = [
        ("`ar` step (one token), not profiled", f"{ar_ms:.2f}", ""),
        ("`ar` step under the profiler", f"{profiled:.2f}", "100 %"),
        *((f"- {part}", f"{split[part]:.2f}", f"{split[part] / profiled:.0%}")
          for part in ("matmuls", "attention", "other ops", "in no op")),
        (f"every linear alone on one token ({w_bytes / 1e6:.0f} MB)", f"{w_ms:.2f}",
         f"{result['weights_gb_per_s']:.1f} GB/s"),
        (f"the LM head alone ({head_bytes / 1e6:.0f} MB)", f"{head_ms:.2f}",
         f"{head_bytes / (head_ms / 1e3) / 1e9:.1f} GB/s"),
        (f"`domino` step ({domino_tokens:.2f} tokens a step here), not profiled", f"{domino_ms:.2f}",
         f"{domino_ms / ar_ms:.2f}x the `ar` step"),
    ]  # fmt: skip
    lines = [
        "# Where a decode step's time goes (`python -m bench.forward_breakdown`)\n",
        f"{cpu['cpu']} ({'AVX-512 BF16' if cpu['avx512_bf16'] else 'no AVX-512 BF16'}); {result['dtype']}; "
        f"{args.threads} thread(s); embedded default at context {args.context}; commit {result['commit']}.\n",
        "| part | ms | share, bandwidth or ratio |",
        "|---|---:|---:|",
        *(f"| {name} | {ms} | {share} |" for name, ms, share in rows),
    ]
    report = "\n".join(lines) + "\n"
    write_reports(result, report, args.json, args.markdown)
    print(report)
    return result


if __name__ == "__main__":
    main()
