"""Writing and rendering benchmark results: the JSON every benchmark writes (`write_json`, compact),
the driver of the GPU cost study (bench/gpu_check/costs.py: `run_and_report`) and the load test's Markdown
reports (bench/load.py). The single-table benchmarks (bench/engine.py, batch_split.py,
verify_cost.py) keep their one table beside their numbers and write it with `save_result`. Imports
no torch: bench.load stays a light HTTP client.
"""

from __future__ import annotations

import argparse
import gzip
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


SIGNIFICANT_DIGITS = 6  # past any timer's or counter's precision; keeps per-step samples small


def compact_json(obj: Any, level: int = 0) -> str:
    """JSON that stays readable and diffable but small: objects one key per line, a list of scalars
    (per-step samples) on one line, floats to SIGNIFICANT_DIGITS. The checked-in results are part
    of the tracked tree, whose size the packaging test bounds."""
    pad, inner = "  " * level, "  " * (level + 1)
    if isinstance(obj, float) and math.isfinite(obj):
        return json.dumps(float(f"{obj:.{SIGNIFICANT_DIGITS}g}"))
    if isinstance(obj, dict) and obj:
        items = (f"{inner}{json.dumps(str(k))}: {compact_json(v, level + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and obj:
        if all(not isinstance(v, (dict, list)) for v in obj):
            return "[" + ", ".join(compact_json(v) for v in obj) + "]"
        return "[\n" + ",\n".join(inner + compact_json(v, level + 1) for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def write_json(result: dict[str, Any], path: Path) -> None:
    """`compact_json` to `path`, gzipped when it ends in .gz (results of many per-step samples that
    feed only a table: `zcat` or `gzip.open` reads them). No timestamp in the gzip header, so the
    same result gives the same bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = compact_json(result) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    else:
        path.write_text(text)


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
    """Run a benchmark, writing its reports after each batch size ("complete": false until
    the end) and once more, printed, at the end (bench.gpu_check.costs)."""
    result = run_fn(args, lambda partial: write_reports(partial, markdown_fn(partial), args.json, args.markdown))
    report = markdown_fn(result)
    print(report)
    write_reports(result, report, args.json, args.markdown)
    return result


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
