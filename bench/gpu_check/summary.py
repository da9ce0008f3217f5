"""summary.md of the GPU check (bench/gpu_check/driver.py), from its records: the parts' status, the issue's
targets (met, or missed by how much), then a table per kind of measurement. Imports no torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

Rec = dict[str, Any]


def _first(records: list[Rec], kind: str, **match: Any) -> Rec | None:
    return next((r for r in records if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())), None)


def _get(rec: Rec | None, key: str) -> float | None:
    return None if rec is None else rec.get(key)


def targets(records: list[Rec]) -> list[tuple[str, float | None, float, bool]]:
    """(what, measured, target, higher is better) for each of the issue's targets."""
    caps = [r["capacity"] for r in records if r["kind"] == "verify"]
    cap = min(caps) if caps else None
    verify17 = _first(records, "verify", batch=1, T=17, variant="graph", capacity=cap)
    head = _first(records, "head", batch=1, variant="graph")
    ar1 = _first(records, "e2e", batch=1, mode="ar")
    tau = max((r["tau_target"] for r in records if r["kind"] == "e2e"), default=None)
    dom1 = _first(records, "e2e", batch=1, mode="domino", policy="fixed", tau_target=tau)
    dom16 = _first(records, "e2e", batch=16, mode="domino", policy="fixed", tau_target=tau)
    ratio = None
    if ar1 is not None and ar1.get("bare_step_ms"):
        ratio = ar1["step_ms"] / ar1["bare_step_ms"]
    return [
        ("verify T=17, batch 1, graph (ms)", _get(verify17, "median_ms"), 6.0, False),
        ("Domino head, batch 1, graph (ms)", _get(head, "median_ms"), 0.6, False),
        ("graph ar step / bare forward, batch 1", ratio, 1.2, False),
        (f"tok/s at tau {tau}, batch 1", _get(dom1, "tokens_per_s"), 1000.0, True),
        (f"speedup over graph ar at tau {tau}, batch 1", _get(dom1, "speedup_vs_graph_ar"), 5.0, True),
        (f"step at tau {tau}, batch 16 (ms)", _get(dom16, "step_ms"), 12.0, False),
    ]


def _verdict(measured: float | None, target: float, higher: bool) -> str:
    if measured is None:
        return "not measured"
    if (measured >= target) if higher else (measured <= target):
        return "met"
    return f"missed by {100 * abs(measured - target) / target:.0f} %"


def _table(records: list[Rec], kind: str, cols: list[tuple[str, Callable[[Rec], Any]]]) -> list[str]:
    rows = [r for r in records if r["kind"] == kind]
    if not rows:
        return []
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(fn, r) for _, fn in cols) + " |")
    return lines + [""]


def _cell(fn: Callable[[Rec], Any], rec: Rec) -> str:
    try:
        return _fmt(fn(rec))
    except (KeyError, TypeError):  # a record from an older or partial run: show the gap, keep the table
        return "–"


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1e-2 else f"{x:.2f}"
    return "–" if x is None else str(x)


def summary_markdown(records: list[Rec], args: argparse.Namespace) -> str:
    versions = _first(records, "versions") or {}
    gpu = _first(records, "gpu") or {}
    sdpa = _first(records, "sdpa") or {}
    cpu = versions.get("device", "").startswith("cpu")
    lines = [
        f"# GPU check: {versions.get('device_name', '?')} ({versions.get('device', '?')}), "
        f"{versions.get('dtype', '?')}, scale 1/{args.scale} (layers 1/{args.layers_scale})",
        "",
        f"torch {versions.get('torch', '?')}, transformers {versions.get('transformers', '?')}, "
        f"python {versions.get('python', '?')}, CUDA {versions.get('cuda')}, cache argument "
        f"`{versions.get('cache_kwarg', '?')}`; SDPA chosen {sdpa.get('chosen', '?')}, "
        f"pinned {sdpa.get('pinned', '?')}. " + (f"GPU: {gpu}." if gpu else ""),
        "",
    ]
    if cpu:
        lines += ["**CPU run: every time below is CPU wall time at reduced width, not a GPU figure.**", ""]
    lines += ["| part | status | seconds | box | reason |", "|---|---|---|---|---|"]
    for r in records:
        if r["kind"] == "part":
            lines.append(
                f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {r['box_s']:.0f} | {r.get('reason', '')} |"
            )
    for r in records:
        if r["kind"] == "killed":
            lines.append(f"| (killed) | {r['reason']} | | | |")
    lines += ["", "## Targets", "", "| target | measured | goal | verdict |", "|---|---|---|---|"]
    for what, measured, goal, higher in targets(records):
        verdict = "no verdict (CPU)" if cpu else _verdict(measured, goal, higher)
        lines.append(f"| {what} | {_fmt(measured)} | {'≥' if higher else '≤'} {goal:g} | {verdict} |")
    lines += ["", "## Correctness", ""]
    lines += _table(records, "teacher_forced", [
        ("batch", lambda r: r["batch"]), ("T", lambda r: r["T"]), ("graph vs eager", lambda r: r["graph_vs_eager"]),
        ("graph vs HF", lambda r: r["graph_vs_hf"]), ("eager vs HF", lambda r: r["eager_vs_hf"]),
        ("argmax graph = HF", lambda r: r["argmax_graph_eq_hf"]), ("copy rule", lambda r: r["copy_rule_hits"]),
        ("anchors agree", lambda r: r["anchors_agree"]), ("all layers wrote KV", lambda r: r["cache_layers_written"]),
    ])  # fmt: skip
    lines += _table(records, "greedy", [
        ("engine", lambda r: f"{r['mode']} {r['variant']}"), ("exact", lambda r: f"{r['exact']}/{r['total']}"),
        ("near-ties", lambda r: len(r["near_ties"])), ("mismatches", lambda r: len(r["mismatches"])),
        ("copy rule", lambda r: r["copy_match"]), ("batch sizes", lambda r: r["batch_sizes_seen"]),
        ("buckets", lambda r: r["buckets"] and f"{r['buckets']['graphs']} graphs, {r['buckets']['eager']} eager"),
    ])  # fmt: skip
    lines += ["## Timings (median / p10 / p90 ms)", ""]
    spread = [("median", lambda r: r["median_ms"]), ("p10", lambda r: r["p10_ms"]), ("p90", lambda r: r["p90_ms"])]
    lines += _table(records, "verify", [
        ("batch", lambda r: r["batch"]), ("T", lambda r: r["T"]), ("capacity", lambda r: r["capacity"]),
        ("variant", lambda r: r["variant"]), *spread, ("clock", lambda r: r["clock"]),
    ])  # fmt: skip
    lines += _table(records, "propose", [
        ("batch", lambda r: r["batch"]), ("head", lambda r: r["head"]), ("variant", lambda r: r["variant"]),
        *spread, ("clock", lambda r: r["clock"]),
    ])  # fmt: skip
    lines += ["## End to end (oracle drafter, graph engines)", ""]
    lines += _table(records, "e2e", [
        ("batch", lambda r: r["batch"]), ("engine", lambda r: f"{r['mode']} {r['policy']}"),
        ("tau target / expected / measured", lambda r: f"{r['tau_target']:g} / {r['tau_expected']:.2f} / "
         f"{r['tau']:.2f}"),
        ("tok/s", lambda r: r["tokens_per_s"]), ("step ms", lambda r: r["step_ms"]),
        ("bare step ms", lambda r: r.get("bare_step_ms")), ("host ms/step", lambda r: r.get("host_ms_per_step")),
        ("vs graph ar", lambda r: r.get("speedup_vs_graph_ar")), ("copy rule", lambda r: r["copy_match"]),
        ("capacity", lambda r: r["capacity"]),
    ])  # fmt: skip
    lines += _table(records, "pytest", [
        ("pytest", lambda r: r["name"]), ("exit", lambda r: r["rc"]), ("timed out", lambda r: r["timed_out"]),
        ("result", lambda r: (r.get("tail") or [""])[-1]),
    ])  # fmt: skip
    return "\n".join(lines) + "\n"
