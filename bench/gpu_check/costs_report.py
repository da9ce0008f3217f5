"""The Markdown report of bench/gpu_check/costs.py: target forwards, drafter and engine parts, the
projection, and graph vs eager. Imports no torch."""

from __future__ import annotations

from typing import Any


def costs_markdown(result: dict[str, Any]) -> str:
    """bench.gpu_check.costs's report: target forwards, drafter and engine parts, the projection, and
    (with --variants beyond eager) graph vs eager and the static engines' warm-up."""
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
        "| batch | context | backbone | draft (head off) | draft (Domino) | head (eager) | append | "
        "engine step (dynamic) ar / dflash / domino | engine overhead ar / dflash / domino |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps = " / ".join(f"{ms['step_ms']:.2f}" for ms in r["engine"].values())  # ar, dflash, domino
        over = " / ".join(f"{ms:.2f}" for ms in r["engine_overhead_ms"].values())
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
    return "\n".join(lines + _costs_graphs(result))


_PART_LABELS = {
    "verify": "verify T={} ({})",
    "propose_dflash": "propose (dflash: backbone + base draft)",
    "propose_domino": "propose (domino: backbone + head loop)",
    "step_ar": "engine step ar",
    "step_dflash": "engine step dflash",
    "step_domino": "engine step domino",
    "head": "Domino head (propose domino - dflash)",
}


def _costs_graphs(result: dict[str, Any]) -> list[str]:
    """The graph-vs-eager table and the static engines' warm-up, when variants beyond eager ran."""
    variants = result["config"]["variants"]
    if variants == ["eager"]:
        return []
    ratio = "graph" in variants
    lines = [
        "### Graph vs eager (ms)",
        "",
        "eager: the dynamic path; static: static-shape buckets run eagerly; graph: the buckets replayed as "
        "CUDA graphs (on the CPU: the same as static). Only the eager column attends over `context` tokens: "
        "static-shape forwards attend over the engine's whole cache capacity, whatever the context.",
        "",
        "| batch | context (eager) | capacity (static, graph) | part | "
        + " | ".join(variants)
        + (" | eager / graph |" if ratio else ""),
        "|---|---|---|---|" + "---|" * (len(variants) + ratio),
    ]
    for r in result["rows"]:
        for part, times in r["graph_vs_eager"].items():
            if part.startswith("verify_"):
                t = int(part.removeprefix("verify_"))
                label = _PART_LABELS["verify"].format(t, "ar" if t == 1 else "domino")
            else:
                label = _PART_LABELS[part]
            cells = " | ".join(f"{times[v]:.2f}" for v in variants)
            extra = " |"
            if ratio:  # the head is a difference of two times: it can be <= 0 on a noisy CPU
                extra = f" | {times['eager'] / times['graph']:.2f}x |" if times["graph"] > 0 else " | – |"
            cap = r.get("static_capacity") or "–"
            lines.append(f"| {r['batch']} | {r['context']} | {cap} | {label} | {cells}{extra}")
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
