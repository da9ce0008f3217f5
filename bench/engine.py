"""Decoding speed and acceptance, side by side: `python -m bench.engine`.

Modes run interleaved prompt by prompt (so machine drift hits them alike), all greedy at batch 1:
  hf-generate       transformers `generate(do_sample=False)` (the reference for speed and output)
  hf-prompt-lookup  transformers prompt-lookup decoding
  ar                our engine, no drafts
  ngram             our engine with n-gram copies from the prompt and output only (no drafter)
  dflash            our engine with the DFlash-only baseline drafter (--dflash-drafter)
  domino            our engine with the Domino drafter, head on
  domino-head-off   the Domino drafter with its head off (base logits only)
dflash, domino and domino-head-off also propose n-gram copies unless --no-ngram.
Decode speed counts tokens after the first, over the time after the first token arrived.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from bench import common
from bench.report import write_json
from model.engine.engine import Engine, SamplingParams
from model.load.checkpoint import load_drafter
from model.load.loading import (
    DEFAULT_DFLASH_DRAFTER_DIR,
    DEFAULT_DRAFTER_DIR,
    DEFAULT_TARGET,
    eos_token_ids,
    load_target_as,
    match_packing,
)
from model.load.prompts import load_prompt_file
from model.nn.drafter import Drafter
from model.nn.target import TargetModel

ALL_MODES = ("hf-generate", "hf-prompt-lookup", "ar", "ngram", "dflash", "domino", "domino-head-off")


class _FirstTokenClock(BaseStreamer):
    """Records when generate() emits its first new token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(
    model: PreTrainedModel, prompt: list[int], max_new: int, eos: list[int], lookup: bool
) -> tuple[list[int], float, float]:
    ids = torch.tensor([prompt], device=model.device)
    clock = _FirstTokenClock()
    extra: dict[str, Any] = {"prompt_lookup_num_tokens": 10} if lookup else {}
    t0 = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        streamer=clock,
        **extra,
    )
    t1 = time.perf_counter()
    tokens = out[0, len(prompt) :].tolist()
    return tokens, (clock.first_token_at or t1) - t0, t1 - t0


class TimedGrammar:
    """A grammar whose matchers add the time they take (masks along the drafts, commits) to `seconds`."""

    def __init__(self, grammar: Any) -> None:
        self.grammar, self.seconds, self.masks = grammar, 0.0, 0

    def matcher(self) -> Any:
        inner, timed = self.grammar.matcher(), self

        class Timed:
            def allowed(self, drafts: list[int], positions: int) -> torch.Tensor:
                t0 = time.perf_counter()
                out = inner.allowed(drafts, positions)
                timed.seconds += time.perf_counter() - t0
                timed.masks += positions
                return out

            def commit(self, tokens: list[int]) -> None:
                t0 = time.perf_counter()
                inner.commit(tokens)
                timed.seconds += time.perf_counter() - t0

        return Timed()


def run_engine(
    engine: Engine, prompt: list[int], max_new: int, grammar: Any = None
) -> tuple[list[int], float, float, Any]:
    engine.add_request("bench", prompt, SamplingParams(max_new_tokens=max_new, grammar=grammar))
    tokens: list[int] = []
    stats = None
    first_at = None
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if first_at is None and out.new_token_ids:
                first_at = time.perf_counter()
            stats = out.stats
    t1 = time.perf_counter()
    return tokens, (first_at or t1) - t0, t1 - t0, stats


def margin_at(model: PreTrainedModel, prompt: list[int], ref: list[int], pos: int) -> float:
    """Target's top-1 minus top-2 logit where the outputs diverge: tiny means a numerical tie."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:pos]], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def build_engines(
    target: TargetModel,
    modes: list[str],
    domino: Drafter | None,
    dflash: Drafter | None,
    eos: list[int],
    max_len: int,
    ngram: bool = True,
) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    kw = dict(max_batch_size=1, max_model_len=max_len, eos_token_ids=eos, ngram=ngram)
    for mode in modes:
        if mode == "ar":
            engines[mode] = Engine(target, None, mode="ar", **kw)
        elif mode == "ngram":
            engines[mode] = Engine(target, None, mode="ngram", **kw)
        elif mode == "domino":
            engines[mode] = Engine(target, domino, mode="domino", **kw)
        elif mode == "domino-head-off":
            engines[mode] = Engine(target, domino, mode="dflash", **kw)
        elif mode == "dflash":
            engines[mode] = Engine(target, dflash, mode="dflash", **kw)
    return engines


def summarize(records: dict[str, list[dict[str, Any]]], num_drafts: dict[str, int]) -> dict[str, Any]:
    base = records.get("hf-generate")
    base_speed = None
    if base:
        base_speed = sum(r["decode_tokens"] for r in base) / sum(r["decode_s"] for r in base)
    modes: dict[str, Any] = {}
    for mode, recs in records.items():
        decode_tokens = sum(r["decode_tokens"] for r in recs)
        decode_s = sum(r["decode_s"] for r in recs)
        speed = decode_tokens / decode_s if decode_s > 0 else 0.0
        taus = [x for r in recs for x in r.get("acceptance_lengths", [])]
        per_pos = None
        if taus:
            steps = len(taus)
            counts = [0] * num_drafts.get(mode, 0)
            for r in recs:
                for i, c in enumerate(r.get("accepted_per_position", [])):
                    counts[i] += c
            per_pos = [c / steps for c in counts]
        mismatches = [r for r in recs if r.get("mismatch") is not None]
        by_proposer = {
            who: {
                "draft_tokens": sum(r.get("draft_tokens_by_proposer", {}).get(who, 0) for r in recs),
                "accepted_tokens": sum(r.get("accepted_tokens_by_proposer", {}).get(who, 0) for r in recs),
            }
            for who in ("drafter", "ngram")
        }
        modes[mode] = {
            "decode_tokens_per_s": speed,
            "speedup": speed / base_speed if base_speed else None,
            "tau_mean": sum(taus) / len(taus) if taus else None,
            # Share of verify steps that verified drafts: a τ near 1 with a low share means the
            # policy kept speculation off, not that the drafts failed.
            "draft_step_share": sum(r.get("steps_with_drafts", 0) for r in recs) / len(taus) if taus else None,
            "greedy_mismatches": None if mode == "hf-generate" or not base else len(mismatches),
            "mismatch_details": [r["mismatch"] for r in mismatches],
            "prompts": len(recs),
            "new_tokens": sum(r["new_tokens"] for r in recs),
            "ttft_s_mean": sum(r["ttft_s"] for r in recs) / len(recs),
            "acceptance_by_position": per_pos,
            "acceptance_lengths": taus,
            "by_proposer": by_proposer if taus else None,
            "per_prompt_speedup": [
                (r["decode_tokens"] / r["decode_s"]) / (b["decode_tokens"] / b["decode_s"])
                if base and r["decode_s"] > 0 and b["decode_s"] > 0
                else None
                for r, b in zip(recs, base or recs)
            ],
        }
    return {"modes": modes}


def write_reports(result: dict[str, Any], json_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write_json(result, json_path)
    stem = json_path.with_suffix("")
    lines = [
        "| mode | decode tok/s | speedup vs hf-generate | τ mean | steps verifying drafts | accepted drafter / ngram "
        "| greedy mismatches | prompts | new tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in result["modes"].items():
        sp = f"{m['speedup']:.2f}×" if m["speedup"] is not None else "–"
        tau = f"{m['tau_mean']:.2f}" if m["tau_mean"] is not None else "–"
        share = f"{m['draft_step_share']:.0%}" if m.get("draft_step_share") is not None else "–"
        mm = "–" if m["greedy_mismatches"] is None else str(m["greedy_mismatches"])
        bp = m.get("by_proposer")
        who = f"{bp['drafter']['accepted_tokens']} / {bp['ngram']['accepted_tokens']}" if bp else "–"
        lines.append(
            f"| {mode} | {m['decode_tokens_per_s']:.1f} | {sp} | {tau} | {share} | {who} | {mm} | {m['prompts']} "
            f"| {m['new_tokens']} |"
        )
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")

    spec = {k: v for k, v in result["modes"].items() if v["tau_mean"] is not None}
    if spec:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, m in spec.items():
            lengths = m["acceptance_lengths"]
            ax.hist(lengths, bins=range(1, max(lengths) + 2), alpha=0.5, label=mode, align="left")
        _save_legended(plt, fig, ax, "tokens committed per verify step (τ)", "steps", f"{stem}_tau_hist.png")
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, m in spec.items():
            if m["acceptance_by_position"]:
                by_slot = m["acceptance_by_position"]
                ax.plot(range(1, len(by_slot) + 1), by_slot, marker="o", label=mode)
        path = f"{stem}_acceptance_by_position.png"
        _save_legended(plt, fig, ax, "draft position", "accepted per verify step", path)
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [k for k, v in result["modes"].items() if v["speedup"] is not None]
    ax.bar(names, [result["modes"][k]["speedup"] for k in names])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("decode speedup vs hf-generate")
    plt.setp(ax.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(f"{stem}_speedup.png", dpi=100)
    plt.close(fig)


def _save_legended(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, path: str) -> None:
    """Label the axes, add the legend, save (100 dpi) and close: the per-mode figures' common tail."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench.engine", description=__doc__)
    parser.add_argument("--prompts", default="bench/prompts/sharegpt_heldout.jsonl")
    parser.add_argument("--modes", default=",".join(ALL_MODES))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="Domino drafter (default: the shipped one)")
    parser.add_argument("--dflash-drafter", default=None, help="DFlash baseline drafter (default: the shipped one)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--offset", type=int, default=0, help="skip the first N prompts of the file")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--json", default="bench/results/engine.json")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help=common.DTYPE_HELP)
    parser.add_argument("--no-ngram", action="store_true", help="drafter modes without n-gram copies")
    parser.add_argument(
        "--json-mode", action="store_true", help="engine answers constrained to a JSON object (llguidance); no HF modes"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {ALL_MODES}")
    if args.json_mode:
        modes = [m for m in modes if not m.startswith("hf-")]  # HF generate has no grammar here
    model, tokenizer, dtype = load_target_as(args.target, args.dtype)
    eos = eos_token_ids(model, tokenizer)
    # --offset 100 on the ShareGPT held-out file = its test half (train/evaluate.py's slices).
    prompts = load_prompt_file(Path(args.prompts), tokenizer)[args.offset :]
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    prompts = prompts[: args.limit] if args.limit else prompts
    target = TargetModel(model)
    domino_path = args.drafter or (str(DEFAULT_DRAFTER_DIR) if args.target == DEFAULT_TARGET else None)
    dflash_path = args.dflash_drafter or (str(DEFAULT_DFLASH_DRAFTER_DIR) if args.target == DEFAULT_TARGET else None)
    domino = load_drafter(domino_path, dtype=dtype, target_config=model.config) if domino_path else None
    dflash = load_drafter(dflash_path, dtype=dtype, target_config=model.config) if dflash_path else None
    for drafter in (domino, dflash):
        if drafter is not None:
            match_packing(model, drafter)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + 1
    engines = build_engines(target, modes, domino, dflash, eos, max_len, ngram=not args.no_ngram)
    num_drafts = {m: e.max_drafts_per_step for m, e in engines.items()}
    grammars: dict[str, TimedGrammar] = {}
    if args.json_mode:
        from model.engine.grammar import GrammarCompiler

        compiler = GrammarCompiler(tokenizer, target.vocab_size, sorted(eos))
        grammars = {m: TimedGrammar(compiler.json_object()) for m in modes}

    records: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    # Warm-up outside the measurement (first calls allocate and pick kernels).
    for mode in modes:
        if mode.startswith("hf-"):
            run_hf(model, prompts[0], 4, eos, mode == "hf-prompt-lookup")
        else:
            run_engine(engines[mode], prompts[0], 4, grammars.get(mode))
    for i, prompt in enumerate(prompts):
        ref: list[int] | None = None
        for mode in modes:
            if mode.startswith("hf-"):
                tokens, ttft, total = run_hf(model, prompt, args.max_new_tokens, eos, mode == "hf-prompt-lookup")
                stats = None
            else:
                tokens, ttft, total, stats = run_engine(engines[mode], prompt, args.max_new_tokens, grammars.get(mode))
            # The first mode is the output reference when hf-generate is among them.
            if mode == "hf-generate":
                ref = tokens
            rec: dict[str, Any] = {
                "prompt": i,
                "new_tokens": len(tokens),
                "decode_tokens": max(0, len(tokens) - 1),
                "ttft_s": ttft,
                "decode_s": total - ttft,
            }
            if stats is not None:
                rec["acceptance_lengths"] = list(stats.acceptance_lengths)
                rec["steps_with_drafts"] = stats.steps_with_drafts
                rec["accepted_per_position"] = list(stats.accepted_per_position)
                rec["draft_tokens_by_proposer"] = dict(stats.draft_tokens_by_proposer)
                rec["accepted_tokens_by_proposer"] = dict(stats.accepted_tokens_by_proposer)
            if ref is not None and mode != "hf-generate" and tokens != ref:
                pos = next((j for j, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
                rec["mismatch"] = {"prompt": i, "position": pos, "top1_top2_margin": margin_at(model, prompt, ref, pos)}
            records[mode].append(rec)
        line = "  ".join(
            f"{m}={records[m][-1]['decode_tokens'] / max(records[m][-1]['decode_s'], 1e-9):.1f}" for m in modes
        )
        print(f"[{i + 1}/{len(prompts)}] tok/s {line}", flush=True)
    result = summarize(records, num_drafts)
    if grammars:
        # The grammar's own cost: masks along every verify position's drafts, and commits.
        for mode, g in grammars.items():
            steps = sum(len(r.get("acceptance_lengths", [])) + 1 for r in records[mode])
            result.setdefault("grammar", {})[mode] = {
                "seconds": g.seconds,
                "masks": g.masks,
                "us_per_mask": 1e6 * g.seconds / max(g.masks, 1),
                "ms_per_step": 1e3 * g.seconds / max(steps, 1),
            }
    result["config"] = {
        "target": args.target,
        "drafter": domino_path,
        "dflash_drafter": dflash_path,
        "prompts_file": args.prompts,
        "offset": args.offset,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "ngram": not args.no_ngram,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "json_mode": args.json_mode,
    }
    write_reports(result, Path(args.json))
    print(Path(args.json).with_suffix(".md").read_text())
    return result


if __name__ == "__main__":
    main()
