"""GPU readiness: what one speculative step costs at Qwen3-8B / Domino-b16 shapes.

Builds a random-weight target with Qwen3-8B's configuration and a random Domino drafter with the
published Qwen3-8B-Domino-b16 configuration, times each part of a decode step through the
project's own code paths, and turns the times into projected speedups next to the published ones:

- target forward (`TargetModel.forward` over a `RaggedKVCache` whose rows hold `context` tokens)
  for T new tokens per row (T = 1 is plain decoding; T = B + 1 verifies a Domino block);
- drafter backbone (`Drafter.forward_block` over a `DraftContextCache` at the same context);
- draft selection (`Drafter.draft`) with the head off (DFlash) and on (Domino): the difference is
  the Domino head's sequential cost;
- context append (`Drafter.append_context` of B + 1 verified tokens' features);
- a real `Engine.step()` per mode; what is left after subtracting the parts above is the engine's
  own per-step overhead (host syncs, sampling set-up, acceptance bookkeeping);
- graph vs eager (`--variants`): the verify at T = 1 (`ar`) and T = B + 1 (`domino`), the greedy
  proposal (drafter backbone + head loop) and the engine step per mode, through the engine's own
  entry points, for the dynamic path (`eager`), the static-shape buckets run eagerly (`static`) and
  the buckets replayed as CUDA graphs (`graph`; on the CPU it runs the same code as `static`), with
  each static engine's warm-up (graphs captured, seconds, memory). Static-shape forwards attend
  over the whole cache capacity, so their cost follows the engine's capacity, not the context.

Projected speedup = tau * t_target(1) / (t_draft + t_verify), with t_verify the target forward of
B + 1 tokens for Domino (shift_label: B drafts + anchor) and B tokens for DFlash (B - 1 drafts).

    python -m bench.gpu_check.costs                                # full size on CUDA, bf16
    python -m bench.gpu_check.costs --scale 16 --device cpu        # every width / 16, on the CPU
    python -m bench.gpu_check.costs --variants eager               # without the static / graph engines

Random weights give random drafts, so acceptance is not measured here; tau comes from the paper.
Step costs do not depend on acceptance (every verify runs all drafts; rollback is free).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench import common
from bench.gpu_check.costs_report import costs_markdown
from bench.report import run_and_report
from model.engine.engine import Engine, SamplingParams
from model.engine.sampling import SamplingBatch
from model.nn.drafter import Drafter, count_parameters, new_context_cache
from model.nn.target import TargetModel

PUBLISHED = {
    "source": "Domino paper, Qwen3-8B, Transformers backend, batch 1, A100, T = 0",
    "domino": {"tau": 7.17, "speedup": 5.49, "head_latency_overhead": 0.028},
    "dflash": {"tau": 6.06, "speedup": 4.66},
}
DEFINITIONS = {
    "target_ms[T]": "TargetModel.forward of T new tokens per row over `context` cached tokens (features on for T > 1)",
    "backbone_ms": "Drafter.forward_block of one [anchor, MASK x (B-1)] block per row",
    "draft_base_ms / draft_domino_ms": "Drafter.draft (greedy) with the head off / on",
    "head_ms": "draft_domino_ms - draft_base_ms: the Domino head's sequential loop, eager (graph: graph_vs_eager.head)",
    "append_ms": "Drafter.append_context of B + 1 verified tokens' features per row",
    "engine.<mode>.step_ms": "Engine.step() of a full decode batch (draft_policy fixed: every draft verified)",
    "engine_overhead_ms": "step_ms minus the model work above that the step runs",
    "projection.<m>.speedup": "tau * target_ms[1] / (t_draft + t_verify); Domino verifies B + 1, DFlash B tokens",
    "projection.<m>.speedup_engine": "tau * engine.ar.step_ms / engine.<m>.step_ms",
    "projection.domino.head_overhead": "head_ms / (backbone + draft_base + append + target_ms[B + 1])",
    "projection.<m>.speedup_graph": "tau * graph ar step_ms / graph <m> step_ms (variant graph)",
    "graph_vs_eager.verify_<T>": "ModelRunner.verify of T tokens per row (T = 1: ar engine, T = W + 1: domino)",
    "graph_vs_eager.propose_<m>": "the proposer's full greedy block (backbone + draft; the static bucket)",
    "graph_vs_eager.step_<m>": "Engine.step() of the <m> engine, as engine.<m>.step_ms",
    "graph_vs_eager.head": "propose_domino - propose_dflash per variant: the head as the engine runs it",
    "static_capacity": "the cache capacity the static / graph engines of a row attend over, whatever its context",
    "warmup": "StaticSteps.warm_up of each static engine: buckets captured as graphs / run eagerly, s, MiB",
    "warmup.pools_mib": "memory_reserved growth over the engine's build minus its KV caches (CUDA; graph pools)",
}
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 17)
MODES = ("ar", "dflash", "domino")


def greedy_sampling(rows: int, device: torch.device) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.zeros(rows, device=device),
        top_p=torch.ones(rows, device=device),
        top_k=torch.zeros(rows, dtype=torch.long, device=device),
    )


# -- measurements ------------------------------------------------------------------------------


def measure_forwards(
    target: TargetModel,
    drafter: Drafter,
    batch: int,
    contexts: list[int],
    tokens: list[int],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> dict[int, dict[str, Any]]:
    """Bare target / drafter times per context length for one batch size."""
    cfg = drafter.config
    b = cfg.block_size
    capacity = max(contexts) + max(max(tokens), b + 1) + 1
    target.set_taps(cfg.target_layer_ids)
    cache = target.new_cache(batch, capacity)
    dcache = new_context_cache(cfg, batch, capacity, target.dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    vocab = target.vocab_size
    timed = partial(common.time_ms, device=device, warmup=warmup, repeats=repeats)
    out: dict[int, dict[str, Any]] = {}
    for ctx in contexts:
        # Rows look ctx tokens long: forwards attend over a full context (buffer content is zeros).
        cache.set_lengths(0, [ctx] * batch)
        dcache.set_lengths(0, [ctx] * batch)
        row: dict[str, Any] = {"target_ms": {}}
        for t in tokens:
            ids = torch.randint(0, vocab, (batch, t), device=device, generator=gen)
            # T = 1 is the autoregressive baseline, which needs no drafter features (as in mode ar).
            fn = partial(target.forward, cache, 0, ids, want_features=t > 1)
            row["target_ms"][t] = timed(fn)

        anchors = torch.randint(0, vocab, (batch,), device=device, generator=gen)
        block = torch.full((batch, b), cfg.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = anchors
        row["backbone_ms"] = timed(partial(drafter.forward_block, dcache, 0, block))
        hidden = drafter.forward_block(dcache, 0, block)
        sampling = greedy_sampling(batch, device)
        for use_head, key in ((False, "draft_base_ms"), (True, "draft_domino_ms")):
            drafter.use_head = use_head
            row[key] = timed(partial(drafter.draft, hidden, anchors, sampling))
        row["head_ms"] = row["draft_domino_ms"] - row["draft_base_ms"]

        # The engine appends the features of every verified input (anchor + drafts) each step.
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        features = 0.1 * torch.randn(batch, b + 1, width, device=device, dtype=target.dtype, generator=gen)
        counts = torch.full((batch,), b + 1, dtype=torch.long, device=device)

        def append(features: torch.Tensor = features, counts: torch.Tensor = counts, ctx: int = ctx) -> None:
            drafter.append_context(dcache, 0, features, counts, [b + 1] * batch)
            dcache.set_lengths(0, [ctx] * batch)  # undo the advance so every repeat appends at ctx

        row["append_ms"] = timed(append)
        out[ctx] = row
    return out


def measure_calls(engine: Engine, batch: int, ctx: int, timed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The engine's own verify (T = 1 for ar, T = W + 1 with a drafter) and greedy proposal of a
    full block, at context ctx: through a static-shape bucket where the engine has them."""
    engine.cache.set_lengths(0, [ctx] * batch)  # neither call advances the caches
    if engine.draft_cache is not None:
        engine.draft_cache.set_lengths(0, [ctx] * batch)
    gen = torch.Generator(device=engine.device).manual_seed(ctx)
    out: dict[str, Any] = {"verify_ms": {}}
    for t in [1] if engine.drafter is None else [engine.max_drafts_per_step + 1]:
        tokens = torch.randint(0, engine.target.vocab_size, (batch, t), device=engine.device, generator=gen)
        out["verify_ms"][t] = timed(partial(engine.runner.verify, 0, tokens))
    if engine.drafter is not None:
        anchors = torch.tensor([row.anchor for row in engine.rows], dtype=torch.long, device=engine.device)
        sampling = SamplingBatch.of_params([r.params for r in engine.rows], None, engine.device)  # greedy: static
        propose = engine.proposer.propose
        out["propose_ms"] = timed(partial(propose, 0, engine.rows, anchors, sampling, engine.num_drafts))
    return out


def measure_engine(
    target: TargetModel,
    drafter: Drafter,
    mode: str,
    batch: int,
    contexts: list[int],
    device: torch.device,
    warmup: int,
    repeats: int,
    variant: str = "eager",
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Median `Engine.step()` time of a full batch of decode rows at each context length, and of the
    engine's verify and proposal calls; with the engine's capacity and static-shape warm-up."""
    static_shapes, cuda_graphs = common.VARIANTS[variant]
    steps = (warmup + repeats) * len(contexts)
    b = drafter.config.block_size
    # Room for every timed step's output (rows must not finish while being timed).
    max_model_len = max(contexts) + (b + 1) * (steps + 2) + 8
    common.free_memory(device)
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    # draft_policy "fixed" verifies every draft: the published numbers (and the projection here)
    # are for full blocks, and the adaptive policy would shrink them for a random drafter.
    engine = Engine(
        target,
        drafter if mode != "ar" else None,
        mode=mode,
        max_batch_size=batch,
        max_model_len=max_model_len,
        draft_policy="fixed",
        static_shapes=static_shapes,
        cuda_graphs=cuda_graphs,
    )
    warm = common.static_warmup(engine)
    info: dict[str, Any] = {"capacity": engine.cache.capacity, "warmup": None}
    if warm is not None:
        info["warmup"] = {**warm, "pools_mib": 0.0}
        if device.type == "cuda":
            # The report counts tensors alive after warm-up; the graphs' private pools stay reserved
            # beyond that. Reserved growth over the engine's build minus its caches bounds both.
            caches = [engine.cache] + ([engine.draft_cache] if engine.draft_cache is not None else [])
            cache_bytes = sum(c.nbytes for c in caches)
            grown = torch.cuda.memory_reserved(device) - reserved
            info["warmup"]["pools_mib"] = (grown - cache_bytes) / 2**20
    prompt_len = 4
    for i in range(batch):
        prompt = [(7 * i + j) % target.vocab_size for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=max_model_len - prompt_len))
    engine.step()  # prefill of the short prompts; the context length is then set directly
    assert engine.num_running == batch, "all rows must be running"
    timed = partial(common.time_ms, device=device, warmup=warmup, repeats=repeats)
    out: dict[int, dict[str, Any]] = {}
    for ctx in contexts:

        def step(ctx: int = ctx) -> None:
            engine.cache.set_lengths(0, [ctx] * batch)
            if engine.draft_cache is not None:
                engine.draft_cache.set_lengths(0, [ctx] * batch)
            engine.step()

        ms = timed(step)
        timing = engine.last_timing
        assert timing is not None and timing.kind == "decode" and engine.num_running == batch
        out[ctx] = {"step_ms": ms, "num_drafts": timing.num_drafts, **measure_calls(engine, batch, ctx, timed)}
    return out, info


def graph_vs_eager(by_variant: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Part -> variant -> ms, from each variant's engine measurements of one (batch, context): the
    verify at T = 1 (ar engine) and T = W + 1 (domino), the proposal and the step per mode."""
    parts: dict[str, dict[str, float]] = {}
    for variant, modes in by_variant.items():
        for mode in ("ar", "domino"):
            for t, ms in modes[mode]["verify_ms"].items():
                parts.setdefault(f"verify_{t}", {})[variant] = ms
        for mode in ("dflash", "domino"):
            parts.setdefault(f"propose_{mode}", {})[variant] = modes[mode]["propose_ms"]
        for mode in MODES:
            parts.setdefault(f"step_{mode}", {})[variant] = modes[mode]["step_ms"]
    # The head's cost in each variant (as a graph in `graph`): the bare `head_ms` is eager only.
    parts["head"] = {v: parts["propose_domino"][v] - parts["propose_dflash"][v] for v in parts["propose_domino"]}
    return parts


def engine_overhead(row: dict[str, Any], mode: str) -> float:
    """Step time minus its model work: target verify (+ drafter backbone, selection, append)."""
    step = row["engine"][mode]
    model_ms = row["target_ms"][step["num_drafts"] + 1]
    if mode != "ar":
        draft_key = "draft_domino_ms" if mode == "domino" else "draft_base_ms"
        model_ms += row["backbone_ms"] + row[draft_key] + row["append_ms"]
    return step["step_ms"] - model_ms


def project(row: dict[str, Any], block_size: int, tau_domino: float, tau_dflash: float) -> dict[str, Any]:
    t1 = row["target_ms"][1]
    base_draft = row["backbone_ms"] + row["draft_base_ms"] + row["append_ms"]
    domino_draft = row["backbone_ms"] + row["draft_domino_ms"] + row["append_ms"]
    domino_verify = row["target_ms"][block_size + 1]  # shift_label: B drafts + the anchor
    dflash_verify = row["target_ms"][block_size]  # plain DFlash: B - 1 drafts + the anchor
    out: dict[str, Any] = {}
    for name, tau, draft, verify in (
        ("domino", tau_domino, domino_draft, domino_verify),
        ("dflash", tau_dflash, base_draft, dflash_verify),
    ):
        step = draft + verify
        out[name] = {
            "tau": tau,
            "t_draft_ms": draft,
            "t_verify_ms": verify,
            "step_over_t1": step / t1,  # published: tau / speedup
            "speedup": tau * t1 / step,
        }
        if "engine" in row:
            # The same projection from whole engine steps (overheads included on both sides).
            # The dflash engine step uses the Domino drafter with its head off (B drafts, not B - 1).
            out[name]["speedup_engine"] = tau * row["engine"]["ar"]["step_ms"] / row["engine"][name]["step_ms"]
    out["domino"]["head_overhead"] = row["head_ms"] / (base_draft + domino_verify)
    return out


# -- the run -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_shape_args(p, dtype_help="auto: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--tau", type=float, default=PUBLISHED["domino"]["tau"], help="Domino acceptance length")
    p.add_argument("--tau-dflash", type=float, default=PUBLISHED["dflash"]["tau"], help="DFlash acceptance length")
    p.add_argument("--contexts", type=common.parse_ints, default=[512, 2048])
    p.add_argument("--batch-sizes", type=common.parse_ints, default=[1, 4, 16])
    p.add_argument(
        "--tokens",
        type=common.parse_ints,
        default=list(DEFAULT_TOKENS),
        help="new tokens per row for the target forwards (1, B and B + 1 are always added)",
    )
    p.add_argument(
        "--variants",
        type=common.parse_names,
        default=list(common.VARIANTS),
        help=f"engine variants to time, of {','.join(common.VARIANTS)} (eager always runs: the tables above use it)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    common.add_output_args(p)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if not args.contexts or not args.batch_sizes or min(args.contexts) < 1 or min(args.batch_sizes) < 1:
        p.error("--contexts and --batch-sizes need positive values")
    unknown = set(args.variants) - set(common.VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {list(common.VARIANTS)}")
    args.variants = [v for v in common.VARIANTS if v == "eager" or v in args.variants]
    return args


def run(args: argparse.Namespace, on_batch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every measurement; `on_batch` gets the results so far after each batch size (partial runs
    still report when a later batch size fails or runs out of time)."""
    device, dtype = common.start(args)
    shapes = common.scaled_shapes(args.scale, args.layers_scale)
    b = shapes["block_size"]
    tokens = sorted(set(args.tokens) | {1, b, b + 1})
    t0 = time.perf_counter()
    target = common.build_target(shapes, dtype, device)
    drafter = common.build_drafter(shapes, dtype, device)
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    build_s = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []

    def result(complete: bool) -> dict[str, Any]:
        env = common.measured_on(
            device,
            dtype,
            build_s,
            target_params=sum(p.numel() for p in target.hf_model.parameters()),
            drafter_params=count_parameters(drafter),
        )
        return {
            "complete": complete,
            "config": {**common.flags(args), "tokens": tokens},
            "environment": env,
            "shapes": shapes,
            "published": PUBLISHED,
            "definitions": DEFINITIONS,
            "rows": rows,
            "warmup": warmups,
        }

    with torch.inference_mode():
        for batch in args.batch_sizes:
            bare = measure_forwards(target, drafter, batch, args.contexts, tokens, device, args.warmup, args.repeats)
            engines: dict[str, dict[str, dict[int, dict[str, Any]]]] = {v: {} for v in args.variants}
            for variant in args.variants:
                for m in MODES:
                    engines[variant][m], info = measure_engine(
                        target, drafter, m, batch, args.contexts, device, args.warmup, args.repeats, variant
                    )
                    if info["warmup"] is not None:
                        warmups.append(
                            {"batch": batch, "mode": m, "variant": variant, "capacity": info["capacity"]}
                            | info["warmup"]
                        )
                    common.free_memory(device)  # each engine brings its own full-size caches (and graphs)
            for ctx in args.contexts:
                row = {"batch": batch, "context": ctx, **bare[ctx]}
                row["engine"] = {m: engines["eager"][m][ctx] for m in MODES}
                row["engine_overhead_ms"] = {m: engine_overhead(row, m) for m in MODES}
                row["projection"] = project(row, b, args.tau, args.tau_dflash)
                row["graph_vs_eager"] = graph_vs_eager({v: {m: engines[v][m][ctx] for m in MODES} for v in engines})
                # Static-shape forwards attend over the whole capacity: the context is the eager column's.
                row["static_capacity"] = max((w["capacity"] for w in warmups if w["batch"] == batch), default=None)
                if "graph" in engines:
                    steps = row["graph_vs_eager"]
                    for name in ("domino", "dflash"):
                        proj = row["projection"][name]
                        proj["speedup_graph"] = proj["tau"] * steps["step_ar"]["graph"] / steps[f"step_{name}"]["graph"]
                rows.append(row)
            if on_batch is not None:
                on_batch(result(complete=False))

    return result(complete=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_and_report(parse_args(argv), run, costs_markdown)


if __name__ == "__main__":
    main()
