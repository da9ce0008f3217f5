"""Where a batch's time goes, per engine setting: `python -m bench.batch_split`.

A serving run's throughput mixes two kinds of step. Prefill costs the same with or without
speculation; only decode steps can get faster. This runs the same prompts through engines side by
side at one batch size (the settings interleaved per repetition, so machine drift hits every one
alike) and splits each engine's time into prefill and decode, the decode step into drafter and
verify, and reports tokens per decode step, so a serving ratio can be read as

    total ratio = 1 / (prefill share + decode share / decode ratio)     (Amdahl).

Settings: `ar`; `domino` (the adaptive policy); `domino-kN` (the adaptive policy over at most N
drafts per step); `domino-fixed-kN` (always N drafter drafts, no copies); `domino-full` (every
draft of the block, no copies).
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench.report import save_result
from model.engine.engine import Engine
from model.engine.requests import SamplingParams
from model.load.checkpoint import load_drafter
from model.load.loading import DEFAULT_DRAFTER_DIR, DEFAULT_TARGET, eos_token_ids, load_target_as
from model.load.prompts import load_prompt_file
from model.nn.drafter import Drafter
from model.nn.target import TargetModel


@dataclass
class Split:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0  # inside decode: proposing (the drafter's forward, n-gram lookups)
    verify_s: float = 0.0  # inside decode: the target's verify forward
    decode_steps: int = 0
    row_steps: int = 0  # rows decoded, summed over decode steps
    tokens: int = 0  # tokens emitted by decode steps (prefill's first token not counted)

    def add(self, other: Split) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def engine_kwargs(setting: str) -> dict[str, Any]:
    """Engine arguments for a setting name (module docstring)."""
    if setting == "ar":
        return {"mode": "ar"}
    if setting == "domino":
        return {"mode": "domino"}
    if setting == "domino-full":
        return {"mode": "domino", "draft_policy": "fixed", "ngram": False}
    m = re.fullmatch(r"domino-(fixed-)?k(\d+)", setting)
    if m is None:
        raise ValueError(f"unknown setting {setting!r}")
    kw: dict[str, Any] = {"mode": "domino", "max_drafts": int(m.group(2))}
    if m.group(1):
        kw.update(draft_policy="fixed", ngram=False)
    return kw


def run_batch(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> Split:
    """All prompts through one engine (at most its batch size at once); time per step kind."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"split-{i}", prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    split = Split()
    while engine.has_unfinished():
        engine.last_timing = None
        t0 = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - t0
        timing = engine.last_timing
        if timing is None or timing.kind != "decode":
            split.prefill_s += seconds
            continue
        split.decode_s += seconds
        split.draft_s += timing.draft_seconds
        split.verify_s += timing.verify_seconds
        split.decode_steps += 1
        split.row_steps += timing.batch_size
        split.tokens += sum(len(o.new_token_ids) for o in outputs)
    return split


def summarize(splits: dict[str, Split]) -> dict[str, dict[str, float]]:
    base = splits.get("ar")
    rows: dict[str, dict[str, float]] = {}
    for name, s in splits.items():
        total = s.prefill_s + s.decode_s
        row = {
            "prefill_s": s.prefill_s,
            "decode_s": s.decode_s,
            "prefill_share": s.prefill_s / total if total else 0.0,
            "ms_per_decode_step": 1000 * s.decode_s / max(s.decode_steps, 1),
            "draft_ms_per_step": 1000 * s.draft_s / max(s.decode_steps, 1),
            "tokens_per_row_step": s.tokens / max(s.row_steps, 1),
            "decode_tok_s": s.tokens / s.decode_s if s.decode_s else 0.0,
            "total_tok_s": s.tokens / total if total else 0.0,
        }
        if base is not None and base.decode_s and s.decode_s:
            row["decode_ratio"] = row["decode_tok_s"] / (base.tokens / base.decode_s)
            row["total_ratio"] = row["total_tok_s"] / (base.tokens / (base.prefill_s + base.decode_s))
        rows[name] = row
    return rows


def report(rows: dict[str, dict[str, float]]) -> str:
    lines = [
        "| setting | prefill share | ms / decode step (proposing) | tokens / row-step | decode tok/s | "
        "total tok/s | decode × ar | total × ar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['prefill_share']:.0%} | {r['ms_per_decode_step']:.1f} ({r['draft_ms_per_step']:.1f}) | "
            f"{r['tokens_per_row_step']:.2f} | {r['decode_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
            f"{r.get('decode_ratio', float('nan')):.3f} | {r.get('total_ratio', float('nan')):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.batch_split", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="Domino drafter (default: the shipped one)")
    parser.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    parser.add_argument("--offset", type=int, default=100, help="skip the first N prompts (100: the test half)")
    parser.add_argument("--settings", default="ar,domino,domino-k1,domino-fixed-k1,domino-full")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24, help="prompts per repetition")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions, each on new prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="auto", help=common.DTYPE_HELP)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default="bench/results/batch_split.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    kwargs = {s: engine_kwargs(s) for s in settings}
    model, tokenizer, dtype = load_target_as(args.target, args.dtype)
    prompts = load_prompt_file(Path(args.prompts), tokenizer)[args.offset :]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    needed = args.requests * args.repeats
    if len(prompts) < needed + 1:
        parser.error(f"{len(prompts)} prompts fit; {needed + 1} needed (warm-up + requests × repeats)")
    target = TargetModel(model)
    drafter: Drafter | None = None
    if any(kw["mode"] != "ar" for kw in kwargs.values()):
        path = args.drafter or (str(DEFAULT_DRAFTER_DIR) if args.target == DEFAULT_TARGET else None)
        if path is None:
            parser.error("--drafter is needed for a non-default target")
        drafter = load_drafter(path, dtype=dtype, target_config=model.config)
    eos = eos_token_ids(model, tokenizer)
    max_len = max(len(p) for p in prompts[: needed + 1]) + args.max_new_tokens + 1
    engines = {
        s: Engine(
            target,
            None if kw["mode"] == "ar" else drafter,
            max_batch_size=args.batch,
            max_model_len=max_len,
            eos_token_ids=eos,
            **kw,
        )
        for s, kw in kwargs.items()
    }
    for engine in engines.values():  # warm-up: first calls allocate and pick kernels
        run_batch(engine, prompts[:1], 4)
    splits = {s: Split() for s in settings}
    for rep in range(args.repeats):
        chunk = prompts[1 + rep * args.requests : 1 + (rep + 1) * args.requests]
        for s, engine in engines.items():
            splits[s].add(run_batch(engine, chunk, args.max_new_tokens))
    rows = summarize(splits)
    result = {
        "settings": rows,
        "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "threads": torch.get_num_threads()},
    }
    save_result(result, args.json, report(rows))
    return result


if __name__ == "__main__":
    main()
