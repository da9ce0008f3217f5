"""Rendering and writing benchmark results: the Markdown reports of the GPU benchmarks
(bench/gpu_costs.py, bench/gpu_e2e.py) and of the load test (bench/load.py), and the JSON beside
them. The single-table benchmarks (bench/engine.py, batch_split.py, verify_cost.py) keep their one
table beside their numbers and write it with `save_result`. Imports no torch: bench.load stays a
light HTTP client.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))  # the latency quantiles a load report shows


# -- writing -----------------------------------------------------------------------------------


def json_ready(obj: Any) -> Any:
    """int dict keys (token counts) become strings; non-finite floats would not be valid JSON."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def write_table(result: dict[str, Any], json_path: str | Path, table: str) -> None:
    """`result` as JSON and its Markdown `table` beside it (same stem, .md)."""
    path = Path(json_path)
    write_json(result, path)
    path.with_suffix(".md").write_text(table + "\n")


def save_result(result: dict[str, Any], json_path: str | Path, table: str) -> None:
    """`write_table`, then the table printed: the shared tail of the single-table benchmarks."""
    write_table(result, json_path, table)
    print(table)


def write_reports(result: dict[str, Any], report: str, json_path: Path | None, md_path: Path | None) -> None:
    if json_path is not None:
        write_json(json_ready(result), json_path)
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


# -- bench.gpu_costs ---------------------------------------------------------------------------


def costs_markdown(result: dict[str, Any]) -> str:
    """bench.gpu_costs's report: target forwards, drafter and engine parts, the projection, and
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


# -- bench.gpu_e2e -----------------------------------------------------------------------------


def e2e_markdown(result: dict[str, Any]) -> str:
    """bench.gpu_e2e's report: tokens/s, step time and speedup per engine, variant and tau."""
    env, cfg, recs = result["environment"], result["config"], result["records"]
    variants, planted = cfg["variants"], env["planted"]
    both = "eager" in variants and "graph" in variants
    baseline = recs[0].get("baseline", "ar") if recs else "ar"
    per = " / ".join(variants)
    lines = [
        f"## End to end, oracle drafter: {env['device_name']}, {env['dtype']}, scale 1/{cfg['scale']}"
        f" (layers 1/{cfg['layers_scale']})",
        "",
        f"Prompts of {cfg['prompt_len']} random tokens, {cfg['max_new_tokens']} new tokens per row, greedy, "
        f"full blocks verified, capacity {max((r['capacity'] for r in recs), default='-')} (static-shape "
        f"engines attend over all of it). The {cfg['mode']} drafter runs every step; its drafts are "
        f"replaced by the planted target's own continuation, right for a scheduled number of slots "
        f"(mean acceptance length tau; "
        f"'expected' allows for each row's budget-cut last steps). Planted target ({planted['rule']}): greedy = "
        f"the copy at {100 * planted['greedy_is_copy']:.1f} % of positions, smallest top-2 margin "
        f"{planted['min_margin']:.2f}. tokens/s after the prefill (median of {cfg['repeats']}); speedup: "
        f"tokens/s over {baseline}'s at the same batch. 'greedy ok': share of tokens equal to the target's "
        "greedy choice (1.000 expected).",
        "",
        f"| batch | engine | tau target | tau expected | tau measured ({per}) | tok/s ({per}) | step ms ({per}) | "
        f"speedup ({per}) |" + (" graph / eager |" if both else "") + " greedy ok |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if both else "") + "---|",
    ]
    keys = sorted({(r["batch"], r["mode"] != "ar", r["tau_target"]) for r in recs})
    for batch, spec, tau in keys:
        group = {
            r["variant"]: r for r in recs if (r["batch"], r["mode"] != "ar", r["tau_target"]) == (batch, spec, tau)
        }
        rs = [group[v] for v in variants if v in group]

        def cells(key: str, fmt: str, rs: list[dict[str, Any]] = rs) -> str:
            return " / ".join(format(r.get(key, math.nan), fmt) for r in rs)

        ratio = f" {group['graph']['tokens_per_s'] / group['eager']['tokens_per_s']:.2f}x |" if both else ""
        lines.append(
            f"| {batch} | {rs[0]['mode']} | {tau:g} | {rs[0]['tau_expected']:.2f} | {cells('tau', '.2f')} | "
            f"{cells('tokens_per_s', '.1f')} | {cells('step_ms', '.2f')} | {cells('speedup', '.2f')} |{ratio} "
            f"{min(r['copy_match'] for r in rs):.3f} |"
        )
    seen: set[tuple[int, str, str]] = set()
    warm = []
    for r in recs:
        key = (r["batch"], r["mode"], r["variant"])
        if r["warmup"] is not None and key not in seen:
            seen.add(key)
            w = r["warmup"]
            warm.append(
                f"batch {key[0]} {key[1]} {key[2]}: {w['graphs']} graphs + {w['eager']} eager buckets in "
                f"{w['seconds']:.1f} s, {w['memory_mib']:.0f} MiB"
            )
    if warm:
        lines += ["", "Static-shape warm-up: " + "; ".join(warm) + "."]
    return "\n".join(lines + [""])


# -- bench.load --------------------------------------------------------------------------------


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.1f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _qs(dist: dict[str, Any]) -> str:
    return " / ".join(ms(dist[name]) for name, _ in QUANTILES)


def load_markdown(result: dict[str, Any]) -> str:
    """One load run: a row per concurrency level."""
    levels = sorted(((int(k), v) for k, v in result["levels"].items()), key=lambda kv: kv[0])
    lines = [
        f"Load test `{result['label'] or '-'}`: model `{result['model']}` at {result['url']}, "
        f"max_tokens {result['config']['max_tokens']}, temperature {result['config']['temperature']}. "
        "Latencies in ms, p50 / p90 / p99.",
        "",
        "| concurrency | ok / requests | errors | output tok/s | req/s | TTFT | ITL (per token) | e2e | τ mean "
        "| steps verifying drafts |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c, lv in levels:
        share = lv.get("draft_step_share")
        lines.append(
            f"| {c} | {lv['completed']} / {lv['requests']} | {lv['errors'] + lv['skipped']} | "
            f"{lv['output_tokens_per_s']:.1f} | {lv['requests_per_s']:.2f} | {_qs(lv['ttft_s'])} | "
            f"{_qs(lv['itl_s'])} | {_qs(lv['e2e_s'])} | {_num(lv['mean_acceptance_length'])} | "
            f"{'–' if share is None else f'{share:.0%}'} |"
        )
    return "\n".join(lines)


def compare_markdown(result: dict[str, Any]) -> str:
    """Two load runs side by side (`--compare`)."""
    na, nb = result["a"]["label"], result["b"]["label"]
    levels = sorted(result["levels"].values(), key=lambda lv: lv["concurrency"])
    lines = [
        f"A = `{na}` ({result['a']['path']}), B = `{nb}` ({result['b']['path']}). "
        "Latencies in ms (p50); ITL per token.",
        "",
        f"| concurrency | {na} tok/s | {nb} tok/s | A / B | TTFT A / B | ITL A / B | e2e A / B | "
        "τ A / B | errors A / B |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in levels:
        pairs = " | ".join(
            f"{ms(lv[f'a_{k}']['p50'])} / {ms(lv[f'b_{k}']['p50'])}" for k in ("ttft_s", "itl_s", "e2e_s")
        )
        ratio = lv["output_tokens_per_s_ratio"]
        lines.append(
            f"| {lv['concurrency']} | {lv['a_output_tokens_per_s']:.1f} | {lv['b_output_tokens_per_s']:.1f} | "
            f"{_num(ratio)}{'×' if ratio is not None else ''} | {pairs} | "
            f"{_num(lv['a_mean_acceptance_length'])} / {_num(lv['b_mean_acceptance_length'])} | "
            f"{lv['a_errors']} / {lv['b_errors']} |"
        )
    if not levels:
        lines.append("| (no concurrency level in common) | | | | | | | | |")
    return "\n".join(lines)


def repetitions_markdown(result: dict[str, Any]) -> str:
    """Several `--compare` results of the same two servers (`--repetitions`)."""
    na, nb, n = result["a"], result["b"], len(result["repetitions"])
    lines = [
        f"`{na}` / `{nb}` output tokens/s over {n} alternating repetitions ({', '.join(result['repetitions'])}).",
        "",
        f"| concurrency | per repetition | median | range | mean {na} / mean {nb} tok/s | ratio of means | "
        f"τ {na} per repetition | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lv in sorted(result["levels"].values(), key=lambda lv: lv["concurrency"]):
        per = ", ".join(f"{_num(x)}×" for x in lv["ratios"])
        taus = ", ".join(_num(x) for x in lv["a_mean_acceptance_length"])
        lines.append(
            f"| {lv['concurrency']} | {per} | {_num(lv['ratio_median'])}× | "
            f"{_num(lv['ratio_min'])}–{_num(lv['ratio_max'])}× | "
            f"{lv['mean_a_output_tokens_per_s']:.1f} / {lv['mean_b_output_tokens_per_s']:.1f} | "
            f"{_num(lv['ratio_of_means'])}× | {taus} | {lv['errors']} |"
        )
    return "\n".join(lines)
