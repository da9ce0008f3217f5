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

    python -m bench.gpu_costs                                # full size on CUDA, bf16
    python -m bench.gpu_costs --scale 16 --device cpu        # every width / 16, on the CPU
    python -m bench.gpu_costs --variants eager               # without the static / graph engines

Random weights give random drafts, so acceptance is not measured here; tau comes from the paper.
Step costs do not depend on acceptance (every verify runs all drafts; rollback is free).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from model.drafter import DraftContextCache, Drafter, DrafterConfig, count_parameters, default_target_layer_ids
from model.engine import Engine, SamplingParams
from model.sampling import SamplingBatch
from model.target import TargetModel

# Qwen/Qwen3-8B config.json (text part) and Huang2020/Qwen3-8B-Domino-b16 (the published configs; docs/design.md §2).
QWEN3_8B = {
    "num_hidden_layers": 36,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
}
DOMINO_8B = {
    "num_hidden_layers": 5,
    "block_size": 16,
    "mask_token_id": 151669,
    "gru_hidden_dim": 1024,
    "emb_dim": 256,
}
PUBLISHED = {
    "source": "Domino paper, Qwen3-8B, Transformers backend, batch 1, A100, T = 0",
    "domino": {"tau": 7.17, "speedup": 5.49, "head_latency_overhead": 0.028},
    "dflash": {"tau": 6.06, "speedup": 4.66},
}
DEFINITIONS = {
    "target_ms[T]": "TargetModel.forward of T new tokens per row over `context` cached tokens (features on for T > 1)",
    "backbone_ms": "Drafter.forward_block of one [anchor, MASK x (B-1)] block per row",
    "draft_base_ms / draft_domino_ms": "Drafter.draft (greedy) with the head off / on",
    "head_ms": "draft_domino_ms - draft_base_ms: the Domino head's sequential loop",
    "append_ms": "Drafter.append_context of B + 1 verified tokens' features per row",
    "engine.<mode>.step_ms": "Engine.step() of a full decode batch (draft_policy fixed: every draft verified)",
    "engine_overhead_ms": "step_ms minus the model work above that the step runs",
    "projection.<m>.speedup": "tau * target_ms[1] / (t_draft + t_verify); Domino verifies B + 1, DFlash B tokens",
    "projection.<m>.speedup_engine": "tau * engine.ar.step_ms / engine.<m>.step_ms",
    "projection.domino.head_overhead": "head_ms / (backbone + draft_base + append + target_ms[B + 1])",
    "projection.<m>.speedup_graph": "tau * graph ar step_ms / graph <m> step_ms (variant graph)",
    "graph_vs_eager.verify_<T>": "Engine._target_verify of T tokens per row (T = 1: ar engine, T = W + 1: domino)",
    "graph_vs_eager.propose_<m>": "Engine._propose of a full greedy block (backbone + draft; the static bucket)",
    "graph_vs_eager.step_<m>": "Engine.step() of the <m> engine, as engine.<m>.step_ms",
    "warmup": "StaticSteps.warm_up of each static engine: buckets captured as graphs / run eagerly, s, MiB",
    "warmup.pools_mib": "memory_reserved growth over the engine's build minus its KV caches (CUDA; graph pools)",
}
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 17)
MODES = ("ar", "dflash", "domino")
# Engine variants: (static_shapes, cuda_graphs). eager is the dynamic path (the default on the CPU).
VARIANTS: dict[str, tuple[bool, bool]] = {"eager": (False, False), "static": (True, False), "graph": (True, True)}


# -- model shapes ------------------------------------------------------------------------------


def scaled_shapes(scale: int, layers_scale: int = 1) -> dict[str, int]:
    """Qwen3-8B / Domino-b16 widths divided by `scale`, layer counts by `layers_scale`.

    head_dim stays 128 and the head counts shrink instead (at least one, GQA kept while possible):
    shrinking head_dim to 8 would make attention kernels unrepresentative.
    """
    if scale < 1 or layers_scale < 1:
        raise ValueError("scales must be >= 1")
    hidden = QWEN3_8B["hidden_size"] // scale
    if hidden < 32:
        raise ValueError(f"--scale {scale} leaves a hidden size of {hidden}; use at most 128")
    vocab = QWEN3_8B["vocab_size"] // scale
    heads = max(1, QWEN3_8B["num_attention_heads"] // scale)
    kv_heads = max(1, QWEN3_8B["num_key_value_heads"] // scale)
    while heads % kv_heads:  # GQA needs whole groups
        kv_heads -= 1
    return {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": QWEN3_8B["head_dim"],
        "intermediate_size": QWEN3_8B["intermediate_size"] // scale,
        "vocab_size": vocab,
        "target_layers": max(1, QWEN3_8B["num_hidden_layers"] // layers_scale),
        "draft_layers": max(1, DOMINO_8B["num_hidden_layers"] // layers_scale),
        "gru_hidden_dim": max(1, DOMINO_8B["gru_hidden_dim"] // scale),
        "emb_dim": max(1, DOMINO_8B["emb_dim"] // scale),
        # A never-produced row of the (scaled) vocabulary, like Qwen3's <|mask|>.
        "mask_token_id": min(DOMINO_8B["mask_token_id"] // scale, vocab - 1),
        "block_size": DOMINO_8B["block_size"],
    }


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_target(shapes: dict[str, int], dtype: torch.dtype, device: torch.device) -> TargetModel:
    config = Qwen3Config(
        vocab_size=shapes["vocab_size"],
        hidden_size=shapes["hidden_size"],
        intermediate_size=shapes["intermediate_size"],
        num_hidden_layers=shapes["target_layers"],
        num_attention_heads=shapes["num_attention_heads"],
        num_key_value_heads=shapes["num_key_value_heads"],
        head_dim=shapes["head_dim"],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    # Parameters are created (and randomly initialised) on the device in the target dtype: the
    # full-size model is ~16 GB in bf16 and must never exist as an fp32 copy or on the host.
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return TargetModel(model.eval())


def build_drafter(shapes: dict[str, int], dtype: torch.dtype, device: torch.device) -> Drafter:
    cfg = DrafterConfig(
        hidden_size=shapes["hidden_size"],
        num_hidden_layers=shapes["draft_layers"],
        num_attention_heads=shapes["num_attention_heads"],
        num_key_value_heads=shapes["num_key_value_heads"],
        head_dim=shapes["head_dim"],
        intermediate_size=shapes["intermediate_size"],
        vocab_size=shapes["vocab_size"],
        block_size=shapes["block_size"],
        # Clamped so that --layers-scale never asks for a layer the shrunken target lacks.
        target_layer_ids=[
            min(max(i, 0), shapes["target_layers"] - 1)
            for i in default_target_layer_ids(shapes["target_layers"], shapes["draft_layers"])
        ],
        num_target_layers=shapes["target_layers"],
        mask_token_id=shapes["mask_token_id"],
        projector_type="domino",
        shift_label=True,
        gru_hidden_dim=shapes["gru_hidden_dim"],
        emb_dim=shapes["emb_dim"],
    )
    with torch.device(device), default_dtype(dtype):
        drafter = Drafter(cfg)
    return drafter.eval()


# -- timing ------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of fn(): CUDA events on CUDA, perf_counter around synchronised work elsewhere."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    args: argparse.Namespace,
    device: torch.device,
) -> dict[int, dict[str, Any]]:
    """Bare target / drafter times per context length for one batch size."""
    cfg = drafter.config
    b = cfg.block_size
    capacity = max(contexts) + max(max(tokens), b + 1) + 1
    target.set_taps(cfg.target_layer_ids)
    cache = target.new_cache(batch, capacity)
    dcache = DraftContextCache(cfg, batch, capacity, target.dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    vocab = target.vocab_size
    timed = partial(time_ms, device=device, warmup=args.warmup, repeats=args.repeats)
    out: dict[int, dict[str, Any]] = {}
    for ctx in contexts:
        # Rows look ctx tokens long: forwards attend over a full context (buffer content is zeros).
        cache.lengths[:batch] = ctx
        dcache.lengths[:batch] = ctx
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
            drafter.append_context(dcache, 0, features, counts)
            dcache.lengths[:batch] = ctx  # undo the advance so every repeat appends at ctx

        row["append_ms"] = timed(append)
        out[ctx] = row
    return out


def measure_calls(engine: Engine, batch: int, ctx: int, timed: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """The engine's own verify (T = 1 for ar, T = W + 1 with a drafter) and greedy proposal of a
    full block, at context ctx: through a static-shape bucket where the engine has them."""
    engine.cache.lengths[:batch] = ctx  # neither call advances the caches
    if engine.draft_cache is not None:
        engine.draft_cache.lengths[:batch] = ctx
    gen = torch.Generator(device=engine.device).manual_seed(ctx)
    out: dict[str, Any] = {"verify_ms": {}}
    for t in [1] if engine.drafter is None else [engine.max_drafts_per_step + 1]:
        tokens = torch.randint(0, engine.target.vocab_size, (batch, t), device=engine.device, generator=gen)
        out["verify_ms"][t] = timed(partial(engine._target_verify, 0, tokens))
    if engine.drafter is not None:
        anchors = torch.tensor([row.anchor for row in engine.rows], dtype=torch.long, device=engine.device)
        sampling = engine._sampling_batch(engine.rows, None)  # greedy rows: the static bucket's case
        out["propose_ms"] = timed(partial(engine._propose, 0, engine.rows, anchors, sampling, engine.num_drafts))
    return out


def measure_engine(
    target: TargetModel,
    drafter: Drafter,
    mode: str,
    batch: int,
    contexts: list[int],
    args: argparse.Namespace,
    device: torch.device,
    variant: str = "eager",
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """Median `Engine.step()` time of a full batch of decode rows at each context length, and of the
    engine's verify and proposal calls; with the engine's capacity and static-shape warm-up."""
    static_shapes, cuda_graphs = VARIANTS[variant]
    steps = (args.warmup + args.repeats) * len(contexts)
    b = drafter.config.block_size
    # Room for every timed step's output (rows must not finish while being timed).
    max_model_len = max(contexts) + (b + 1) * (steps + 2) + 8
    free_memory(device)
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
    report = engine.static.report if engine.static is not None else None
    info: dict[str, Any] = {"capacity": engine.cache.capacity, "warmup": None}
    if report is not None:
        info["warmup"] = {**asdict(report), "memory_mib": report.memory_bytes / 2**20, "pools_mib": 0.0}
        if device.type == "cuda":
            # The report counts tensors alive after warm-up; the graphs' private pools stay reserved
            # beyond that. Reserved growth over the engine's build minus its caches bounds both.
            caches = [*engine.cache.keys, *engine.cache.values]
            if engine.draft_cache is not None:
                caches += [*engine.draft_cache.keys, *engine.draft_cache.values]
            cache_bytes = sum(t.numel() * t.element_size() for t in caches)
            grown = torch.cuda.memory_reserved(device) - reserved
            info["warmup"]["pools_mib"] = (grown - cache_bytes) / 2**20
    prompt_len = 4
    for i in range(batch):
        prompt = [(7 * i + j) % target.vocab_size for j in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=max_model_len - prompt_len))
    engine.step()  # prefill of the short prompts; the context length is then set directly
    assert engine.num_running == batch, "all rows must be running"
    timed = partial(time_ms, device=device, warmup=args.warmup, repeats=args.repeats)
    out: dict[int, dict[str, Any]] = {}
    for ctx in contexts:

        def step(ctx: int = ctx) -> None:
            engine.cache.lengths[:batch] = ctx
            if engine.draft_cache is not None:
                engine.draft_cache.lengths[:batch] = ctx
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


# -- reporting ---------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    env, rows = result["environment"], result["rows"]
    tokens = result["config"]["tokens"]
    pub = result["published"]
    lines = [
        f"## GPU costs: {env['device_name']}, {env['dtype']}, scale 1/{result['config']['scale']}"
        f" (layers 1/{result['config']['layers_scale']})",
        "",
        f"Target {result['shapes']['target_layers']} layers x hidden {result['shapes']['hidden_size']}, "
        f"vocab {result['shapes']['vocab_size']} ({env['target_params'] / 1e6:.1f} M params); drafter "
        f"{result['shapes']['draft_layers']} layers, block {result['shapes']['block_size']} "
        f"(backbone {env['drafter_params']['backbone'] / 1e6:.1f} M, "
        f"head {env['drafter_params']['head'] / 1e6:.2f} M). "
        f"Medians of {result['config']['repeats']} runs after {result['config']['warmup']} warm-up, in ms.",
        "",
        "### Target forward (T new tokens per row)",
        "",
        "| batch | context | " + " | ".join(f"T={t}" for t in tokens) + " |",
        "|---|---|" + "---|" * len(tokens),
    ]
    for r in rows:
        cells = " | ".join(f"{r['target_ms'][t]:.2f}" for t in tokens)
        lines.append(f"| {r['batch']} | {r['context']} | {cells} |")
    lines += [
        "",
        "### Drafter and engine",
        "",
        "| batch | context | backbone | draft (head off) | draft (Domino) | head | append | "
        "engine step (dynamic) ar / dflash / domino | engine overhead ar / dflash / domino |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = " / ".join(f"{r['engine'][m]['step_ms']:.2f}" for m in MODES)
        over = " / ".join(f"{r['engine_overhead_ms'][m]:.2f}" for m in MODES)
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['backbone_ms']:.2f} | {r['draft_base_ms']:.2f} | "
            f"{r['draft_domino_ms']:.2f} | {r['head_ms']:.2f} | {r['append_ms']:.2f} | {steps} | {over} |"
        )
    d_pub, f_pub = pub["domino"], pub["dflash"]
    lines += [
        "",
        "### Projection (tau from the paper; speedup = tau * t_target(1) / (t_draft + t_verify))",
        "",
        "| batch | context | Domino step/t1 | Domino speedup | Domino speedup (engine steps) | head overhead | "
        "DFlash step/t1 | DFlash speedup | DFlash speedup (engine steps) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| published | | {d_pub['tau'] / d_pub['speedup']:.3f} | {d_pub['speedup']:.2f}x | | "
        f"+{100 * d_pub['head_latency_overhead']:.1f} % | {f_pub['tau'] / f_pub['speedup']:.3f} | "
        f"{f_pub['speedup']:.2f}x | |",
    ]
    for r in rows:
        d, f = r["projection"]["domino"], r["projection"]["dflash"]
        lines.append(
            f"| {r['batch']} | {r['context']} | {d['step_over_t1']:.3f} | {d['speedup']:.2f}x | "
            f"{d['speedup_engine']:.2f}x | +{100 * d['head_overhead']:.1f} % | {f['step_over_t1']:.3f} | "
            f"{f['speedup']:.2f}x | {f['speedup_engine']:.2f}x |"
        )
    lines += [
        "",
        f"tau used: Domino {result['config']['tau']}, DFlash {result['config']['tau_dflash']}. "
        f"Published ({pub['source']}): Domino tau {d_pub['tau']} -> "
        f"{d_pub['speedup']}x, head +{100 * d_pub['head_latency_overhead']:.1f} % latency; DFlash tau "
        f"{f_pub['tau']} -> {f_pub['speedup']}x.",
        "",
    ]
    return "\n".join(lines + markdown_graphs(result))


PART_LABELS = {
    "verify": "verify T={} ({})",
    "propose_dflash": "propose (dflash: backbone + base draft)",
    "propose_domino": "propose (domino: backbone + head loop)",
    "step_ar": "engine step ar",
    "step_dflash": "engine step dflash",
    "step_domino": "engine step domino",
}


def markdown_graphs(result: dict[str, Any]) -> list[str]:
    """The graph-vs-eager table and the static engines' warm-up, when variants beyond eager ran."""
    variants = result["config"]["variants"]
    if variants == ["eager"]:
        return []
    ratio = "graph" in variants
    lines = [
        "### Graph vs eager (ms)",
        "",
        "eager: the dynamic path; static: static-shape buckets run eagerly; graph: the buckets replayed as "
        "CUDA graphs (on the CPU: the same as static). Static-shape forwards attend over the engine's whole "
        "cache capacity (see the warm-up table), whatever the context.",
        "",
        "| batch | context | part | " + " | ".join(variants) + (" | eager / graph |" if ratio else ""),
        "|---|---|---|" + "---|" * (len(variants) + ratio),
    ]
    for r in result["rows"]:
        for part, times in r["graph_vs_eager"].items():
            if part.startswith("verify_"):
                t = int(part.removeprefix("verify_"))
                label = PART_LABELS["verify"].format(t, "ar" if t == 1 else "domino")
            else:
                label = PART_LABELS[part]
            cells = " | ".join(f"{times[v]:.2f}" for v in variants)
            extra = f" | {times['eager'] / times['graph']:.2f}x |" if ratio else " |"
            lines.append(f"| {r['batch']} | {r['context']} | {label} | {cells}{extra}")
    if ratio:
        lines += [
            "",
            "Projection from graph engine steps (tau * graph ar step / graph step): "
            + "; ".join(
                f"batch {r['batch']} context {r['context']}: Domino "
                f"{r['projection']['domino']['speedup_graph']:.2f}x, DFlash "
                f"{r['projection']['dflash']['speedup_graph']:.2f}x"
                for r in result["rows"]
            )
            + ".",
        ]
    lines += [
        "",
        "### Static-shape warm-up (every bucket built, and on CUDA captured, at engine start)",
        "",
        "MiB: the warm-up report's (tensors alive after it); reserved: the allocator's growth over the "
        "engine's build beyond its KV caches (graph pools included; 0 on the CPU).",
        "",
        "| batch | mode | variant | capacity | CUDA graphs | eager buckets | seconds | MiB | reserved MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in result["warmup"]:
        lines.append(
            f"| {w['batch']} | {w['mode']} | {w['variant']} | {w['capacity']} | {w['graphs']} | {w['eager']} | "
            f"{w['seconds']:.2f} | {w['memory_mib']:.0f} | {w['pools_mib']:.0f} |"
        )
    return lines + [""]


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=int, default=1, help="divide every width by K (CPU runs: 16)")
    p.add_argument("--layers-scale", type=int, default=1, help="also divide layer counts by K")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="auto: bf16 on CUDA, fp32 on the CPU",
    )
    p.add_argument("--tau", type=float, default=PUBLISHED["domino"]["tau"], help="Domino acceptance length")
    p.add_argument("--tau-dflash", type=float, default=PUBLISHED["dflash"]["tau"], help="DFlash acceptance length")
    p.add_argument("--contexts", type=parse_ints, default=[512, 2048])
    p.add_argument("--batch-sizes", type=parse_ints, default=[1, 4, 16])
    p.add_argument(
        "--tokens",
        type=parse_ints,
        default=list(DEFAULT_TOKENS),
        help="new tokens per row for the target forwards (1, B and B + 1 are always added)",
    )
    p.add_argument(
        "--variants",
        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
        default=list(VARIANTS),
        help=f"engine variants to time, of {','.join(VARIANTS)} (eager always runs: the tables above use it)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    if not args.contexts or not args.batch_sizes or min(args.contexts) < 1 or min(args.batch_sizes) < 1:
        p.error("--contexts and --batch-sizes need positive values")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v == "eager" or v in args.variants]
    return args


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def environment(device: torch.device, dtype: torch.dtype, build_s: float) -> dict[str, Any]:
    """What a result was measured on (both GPU benchmarks report it)."""
    return {
        "device": str(device),
        "device_name": device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "build_seconds": build_s,
    }


def device_and_dtype(device_arg: str, dtype_arg: str) -> tuple[torch.device, torch.dtype]:
    """--device / --dtype: auto is CUDA when present, and bf16 there, fp32 on the CPU."""
    if device_arg == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_arg)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return device, dtypes.get(dtype_arg) or (torch.bfloat16 if device.type == "cuda" else torch.float32)


def run(args: argparse.Namespace, on_batch: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every measurement; `on_batch` gets the results so far after each batch size (partial runs
    still report when a later batch size fails or runs out of time)."""
    device, dtype = device_and_dtype(args.device, args.dtype)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    shapes = scaled_shapes(args.scale, args.layers_scale)
    b = shapes["block_size"]
    tokens = sorted(set(args.tokens) | {1, b, b + 1})
    t0 = time.perf_counter()
    target = build_target(shapes, dtype, device)
    drafter = build_drafter(shapes, dtype, device)
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    build_s = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    warmups: list[dict[str, Any]] = []

    def result(complete: bool) -> dict[str, Any]:
        env = {
            **environment(device, dtype, build_s),
            "target_params": sum(p.numel() for p in target.hf_model.parameters()),
            "drafter_params": count_parameters(drafter),
        }
        if device.type == "cuda":
            env["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        config["tokens"] = tokens
        return {
            "complete": complete,
            "config": config,
            "environment": env,
            "shapes": shapes,
            "published": PUBLISHED,
            "definitions": DEFINITIONS,
            "rows": rows,
            "warmup": warmups,
        }

    with torch.inference_mode():
        for batch in args.batch_sizes:
            bare = measure_forwards(target, drafter, batch, args.contexts, tokens, args, device)
            engines: dict[str, dict[str, dict[int, dict[str, Any]]]] = {v: {} for v in args.variants}
            for variant in args.variants:
                for m in MODES:
                    engines[variant][m], info = measure_engine(
                        target, drafter, m, batch, args.contexts, args, device, variant
                    )
                    if info["warmup"] is not None:
                        warmups.append(
                            {"batch": batch, "mode": m, "variant": variant, "capacity": info["capacity"]}
                            | info["warmup"]
                        )
                    free_memory(device)  # each engine brings its own full-size caches (and graphs)
            for ctx in args.contexts:
                row = {"batch": batch, "context": ctx, **bare[ctx]}
                row["engine"] = {m: engines["eager"][m][ctx] for m in MODES}
                row["engine_overhead_ms"] = {m: engine_overhead(row, m) for m in MODES}
                row["projection"] = project(row, b, args.tau, args.tau_dflash)
                row["graph_vs_eager"] = graph_vs_eager({v: {m: engines[v][m][ctx] for m in MODES} for v in engines})
                if "graph" in engines:
                    steps = row["graph_vs_eager"]
                    for name in ("domino", "dflash"):
                        proj = row["projection"][name]
                        proj["speedup_graph"] = proj["tau"] * steps["step_ar"]["graph"] / steps[f"step_{name}"]["graph"]
                rows.append(row)
            if on_batch is not None:
                on_batch(result(complete=False))

    return result(complete=True)


def json_ready(obj: Any) -> Any:
    """int dict keys (token counts) become strings; non-finite floats would not be valid JSON."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_reports(result: dict[str, Any], report: str, json_path: Path | None, md_path: Path | None) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(json_ready(result), indent=2) + "\n")
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(report)


def run_and_report(
    args: argparse.Namespace,
    run_fn: Callable[[argparse.Namespace, Callable[[dict[str, Any]], None]], dict[str, Any]],
    markdown_fn: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """Run a GPU benchmark, writing its reports after each batch size ("complete": false until
    the end) and once more, printed, at the end (both GPU benchmarks)."""
    result = run_fn(args, lambda partial: write_reports(partial, markdown_fn(partial), args.json, args.markdown))
    report = markdown_fn(result)
    print(report)
    write_reports(result, report, args.json, args.markdown)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run_and_report(parse_args(argv), run, markdown)


if __name__ == "__main__":
    main()
