"""End-to-end decoding speed at Qwen3-8B / Domino-b16 shapes with acceptance forced to a chosen tau.

Random weights accept nothing, so the target is given a planted greedy rule and the drafts are
made to follow it for a scheduled number of slots:

- planted target: the embedding rows are random directions of a large norm (they dominate the
  residual stream, whatever the random layers add) and the LM head row of succ[v] is v's direction,
  so the greedy next token after v is succ[v] (a fixed random permutation) with a wide margin, in
  bf16 too. Only weight values change: every layer still runs at full size, so costs are real;
- oracle drafter (`OracleEngine`): the real drafter runs every step (its static-shape bucket /
  CUDA graph where the engine has one), then its drafts are replaced by the target's own greedy
  continuation succ(anchor), succ(succ(anchor)), ... for the first a_s slots of step s and a wrong
  token after, with a_s = floor((s + 1)(tau - 1)) - floor(s (tau - 1)): acceptance length tau on
  average, exactly (a row's last steps are cut by its token budget; `tau_expected` allows for it).

Every engine decodes the same prompts at batch size B (all rows admitted in one prefill, equal
budgets, so they finish together); tokens/s counts the tokens after each row's first over the time
after the prefill. Engines: `ar` and the oracle in `--mode` (domino: head on), each as `eager` (the
dynamic path), `static` (static-shape buckets run eagerly) and `graph` (the buckets replayed as
CUDA graphs; on the CPU the same code as static). Speedups are against the graph-captured `ar`.

    python -m bench.gpu_e2e                                          # full size on CUDA, bf16
    python -m bench.gpu_e2e --scale 16 --layers-scale 4 --device cpu --max-new-tokens 40
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from bench import common
from bench.report import e2e_markdown, run_and_report
from model.drafter import Drafter, DraftResult
from model.engine import Engine, Row, SamplingParams
from model.sampling import SamplingBatch
from model.target import TargetModel

DEFAULT_TAUS = (1.0, 4.0, 7.17)  # no acceptance, a middling drafter, the published Domino tau


# -- the planted target ------------------------------------------------------------------------


@torch.no_grad()
def plant_successor(target: TargetModel, seed: int, embed_rms: float) -> torch.Tensor:
    """Make the target's greedy next token after v be succ[v]; returns succ [V] (on the device).

    Embedding rows: random unit directions u_v times embed_rms * sqrt(H) (per-element RMS embed_rms,
    far above what 36 random layers add: ~2.4 at full width). LM head row succ[v] = u_v, so after the
    final norm the logit of succ[v] is ~sqrt(H) and every other is a random cosine times that.
    """
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    vocab, hidden = embed.shape
    gen = torch.Generator(device=embed.device).manual_seed(seed)
    succ = torch.randperm(vocab, generator=gen, device=embed.device)
    for lo in range(0, vocab, 8192):  # in chunks: no full-vocabulary fp32 copy at full size
        u = torch.randn(min(8192, vocab - lo), hidden, generator=gen, device=embed.device)
        u = u / u.norm(dim=-1, keepdim=True)
        embed[lo : lo + len(u)] = (u * embed_rms * hidden**0.5).to(embed.dtype)
        head[succ[lo : lo + len(u)]] = u.to(head.dtype)
    return succ


@torch.no_grad()
def check_planted(
    target: TargetModel, succ: torch.Tensor, seed: int, rows: int = 2, length: int = 64
) -> dict[str, Any]:
    """One forward over random tokens: the share of positions whose greedy next token is succ[token]
    and the smallest margin between the best and second-best logit."""
    gen = torch.Generator(device=target.device).manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (rows, length), generator=gen, device=target.device)
    logits = target.hf_model(input_ids=ids).logits.float()
    top = logits.topk(2, dim=-1)
    return {
        "greedy_is_successor": float((top.indices[..., 0] == succ[ids]).float().mean()),
        "min_margin": float((top.values[..., 0] - top.values[..., 1]).min()),
    }


def successor_chain(succ: torch.Tensor, depth: int) -> torch.Tensor:
    """[V, depth]: row v holds succ(v), succ(succ(v)), ... (the oracle's drafts in one gather)."""
    cols = [succ]
    for _ in range(depth - 1):
        cols.append(succ[cols[-1]])
    return torch.stack(cols, dim=1)


# -- the oracle --------------------------------------------------------------------------------


def accepted_at(tau: float, step: int) -> int:
    """Drafts right in step `step`: the schedule's mean over steps is tau - 1."""
    return math.floor((step + 1) * (tau - 1) + 1e-9) - math.floor(step * (tau - 1) + 1e-9)


def expected_acceptance(tau: float, max_new_tokens: int, num_drafts: int) -> list[int]:
    """One row's acceptance lengths under the schedule: the first token comes from the prefill, and
    each step verifies at most the row's remaining budget - 1 drafts (the engine's fixed policy)."""
    lengths, made, step = [], 1, 0
    while made < max_new_tokens:
        drafts = min(num_drafts, max_new_tokens - made - 1)
        lengths.append(min(accepted_at(tau, step), drafts) + 1)
        made += lengths[-1]
        step += 1
    return lengths


class OracleEngine(Engine):
    """Runs the real drafter, then proposes the target's greedy continuation (a `successor_chain`
    table) right for `accepted_at(tau, step)` slots and wrong after."""

    def __init__(self, *args: Any, chain: torch.Tensor, tau: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chain = chain
        self.set_tau(tau)

    def set_tau(self, tau: float) -> None:
        if not 1 <= tau <= self.num_drafts + 1:
            raise ValueError(f"tau must be in [1, {self.num_drafts + 1}], got {tau}")
        self.tau, self.proposals = tau, 0

    def _propose(
        self, lo: int, rows: list[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> DraftResult:
        draft = super()._propose(lo, rows, anchors, sampling, num_slots)  # the drafter's real cost
        right = self.chain[anchors, :num_slots]
        slots = torch.arange(num_slots, device=anchors.device)
        good = accepted_at(self.tau, self.proposals)
        self.proposals += 1
        # succ is a permutation of [0, V): right + 1 (mod V) is never the right token.
        tokens = torch.where(slots[None, :] < good, right, (right + 1) % self.target.vocab_size)
        return DraftResult(tokens, draft.token_probs, draft.draft_probs, draft.confidence, draft.logits)


# -- runs --------------------------------------------------------------------------------------


def decode(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """Decode every prompt at once; tokens/s after the prefill, and each row's tokens and stats."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    lengths: dict[str, list[int]] = {}

    def collect(outputs: list[Any]) -> None:
        for out in outputs:
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                lengths[out.request_id] = list(out.stats.acceptance_lengths)

    collect(engine.step())  # the prefill: every row is admitted together
    if engine.num_waiting:
        raise RuntimeError("max_batch_size must hold every prompt")
    common.synchronize(engine.device)
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        collect(engine.step())
        steps += 1
    common.synchronize(engine.device)
    seconds = time.perf_counter() - t0
    decoded = sum(len(t) - 1 for t in tokens.values())
    all_lengths = [n for rid in ids for n in lengths.get(rid, [])]
    return {
        "tokens_per_s": decoded / seconds if seconds > 0 else math.inf,
        "seconds": seconds,
        "steps": steps,
        "step_ms": 1e3 * seconds / max(steps, 1),
        "decoded_tokens": decoded,
        "tau": sum(all_lengths) / max(len(all_lengths), 1),
        "tokens": [tokens[rid] for rid in ids],
        "acceptance_lengths": [lengths.get(rid, []) for rid in ids],
    }


def successor_match(prompts: list[list[int]], outputs: list[list[int]], succ: list[int]) -> float:
    """Share of generated tokens that are succ[previous token] (1.0: the engine decoded greedily)."""
    hits = total = 0
    for prompt, toks in zip(prompts, outputs):
        seq = prompt[-1:] + toks
        hits += sum(succ[a] == b for a, b in zip(seq, seq[1:]))
        total += len(toks)
    return hits / max(total, 1)


def timed_runs(
    engine: Engine, prompts: list[list[int]], args: argparse.Namespace, succ: list[int], num_drafts: int
) -> dict[str, Any]:
    """One warm-up decode, then the median of --repeats (tau, expected tau and output checks kept)."""
    decode(engine, prompts, min(args.max_new_tokens, 2 * num_drafts + 2))  # warm-up: kernels, allocator
    runs = []
    for _ in range(args.repeats):
        if isinstance(engine, OracleEngine):
            engine.set_tau(engine.tau)  # the schedule restarts with every run
        runs.append(decode(engine, prompts, args.max_new_tokens))
    best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    out = {k: v for k, v in best.items() if k not in ("tokens", "acceptance_lengths")}
    out["tokens_per_s_all"] = [r["tokens_per_s"] for r in runs]
    out["successor_match"] = min(successor_match(prompts, r["tokens"], succ) for r in runs)
    out["acceptance_lengths_row0"] = best["acceptance_lengths"][0]
    return out


def build_engine(
    target: TargetModel,
    drafter: Drafter | None,
    mode: str,
    variant: str,
    batch: int,
    max_model_len: int,
    chain: torch.Tensor,
) -> Engine:
    static_shapes, cuda_graphs = common.VARIANTS[variant]
    shared: dict[str, Any] = {
        "max_batch_size": batch,
        "max_model_len": max_model_len,
        "static_shapes": static_shapes,
        "cuda_graphs": cuda_graphs,
    }
    if mode == "ar":
        return Engine(target, None, mode="ar", **shared)
    # fixed: every draft is verified (full blocks, as the published numbers); no n-gram copies.
    return OracleEngine(target, drafter, mode=mode, draft_policy="fixed", ngram=False, chain=chain, **shared)


def run(args: argparse.Namespace, on_batch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every engine at every batch size; `on_batch` gets the results so far after each batch size."""
    device, dtype = common.start(args)
    shapes = common.scaled_shapes(args.scale, args.layers_scale)
    t0 = time.perf_counter()
    target = common.build_target(shapes, dtype, device)
    drafter = common.build_drafter(shapes, dtype, device)
    succ = plant_successor(target, args.seed, args.embed_rms)
    planted = check_planted(target, succ, args.seed + 1)
    num_drafts = drafter.config.num_drafts
    chain = successor_chain(succ, num_drafts)
    succ_list = succ.tolist()
    build_s = time.perf_counter() - t0
    records: list[dict[str, Any]] = []

    def result(complete: bool) -> dict[str, Any]:
        add_ratios(records)
        env = common.measured_on(device, dtype, build_s, planted=planted)
        return {
            "complete": complete,
            "config": common.flags(args),
            "environment": env,
            "shapes": shapes,
            "records": records,
        }

    gen = torch.Generator().manual_seed(args.seed)
    max_model_len = args.prompt_len + args.max_new_tokens
    with torch.inference_mode():
        for batch in args.batch_sizes:
            prompts = torch.randint(0, target.vocab_size, (batch, args.prompt_len), generator=gen).tolist()
            for mode in ("ar", args.mode):
                for variant in args.variants:
                    # Engines are built and run one at a time: each sets the target's taps and the
                    # drafter's head flag for itself, and brings its own caches (and graphs).
                    engine = build_engine(target, drafter, mode, variant, batch, max_model_len, chain)
                    warmup = common.static_warmup(engine)
                    for tau in [1.0] if mode == "ar" else args.taus:
                        if isinstance(engine, OracleEngine):
                            engine.set_tau(tau)
                        rec = {"batch": batch, "mode": mode, "variant": variant, "tau_target": tau, "warmup": warmup}
                        rec |= timed_runs(engine, prompts, args, succ_list, num_drafts)
                        lengths = expected_acceptance(tau, args.max_new_tokens, 0 if mode == "ar" else num_drafts)
                        rec["tau_expected"] = sum(lengths) / max(len(lengths), 1)
                        records.append(rec)
                    del engine
                    common.free_memory(device)
            if on_batch is not None:
                on_batch(result(complete=False))
    return result(complete=True)


def add_ratios(records: list[dict[str, Any]]) -> None:
    """tokens/s over the baseline's: graph-captured ar where it ran, else eager ar (same batch)."""
    for rec in records:
        base = {r["variant"]: r for r in records if r["batch"] == rec["batch"] and r["mode"] == "ar"}
        ref = base.get("graph") or base.get("eager") or next(iter(base.values()), None)
        if ref is None:
            continue
        rec["baseline"] = f"{ref['variant']} ar"
        rec["speedup"] = rec["tokens_per_s"] / ref["tokens_per_s"]


def parse_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(p)
    p.add_argument("--mode", default="domino", choices=["domino", "dflash"], help="the drafter's mode")
    p.add_argument("--taus", type=parse_floats, default=list(DEFAULT_TAUS), help="mean acceptance lengths")
    p.add_argument("--batch-sizes", type=common.parse_ints, default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--variants",
        type=common.parse_names,
        default=["eager", "graph"],
        help=f"engine variants, of {','.join(common.VARIANTS)}",
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--embed-rms", type=float, default=32.0, help="per-element RMS of the planted embeddings")
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.prompt_len < 1 or args.max_new_tokens < 2:
        p.error("--repeats and --prompt-len must be >= 1, --max-new-tokens >= 2")
    if not args.batch_sizes or min(args.batch_sizes) < 1 or not args.taus or min(args.taus) < 1:
        p.error("--batch-sizes need positive values and --taus values >= 1")
    unknown = set(args.variants) - set(common.VARIANTS)
    if unknown or not args.variants:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {list(common.VARIANTS)}")
    args.variants = [v for v in common.VARIANTS if v in args.variants]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_and_report(parse_args(argv), run, e2e_markdown)


if __name__ == "__main__":
    main()
