"""What a load run (bench/load.py) records per request and what the records come to: per-level
summaries and latency distributions, two runs compared (`--compare`), several comparisons
summarised (`--repetitions`), and the files they are written to (JSON, the Markdown of
bench/report.py, plots). No HTTP here: this reads records and results only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.report import QUANTILES, compare_markdown, load_markdown, repetitions_markdown, write_table


@dataclass
class RequestRecord:
    index: int
    prompt: int
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    content_chunks: int = 0
    spec_decode: dict[str, Any] | None = None
    itl_s: list[float] = field(default_factory=list)  # per-token gaps (not written to the JSON)


def quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default): monotone in q."""
    if not values:
        return None
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {name: quantile(values, q) for name, q in QUANTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["n"] = len(values)
    return out


def summarize_level(concurrency: int, records: list[RequestRecord], skipped: int, wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    drafts = sum(int((r.spec_decode or {}).get("num_drafts") or 0) for r in ok)
    draft_tokens = sum(int((r.spec_decode or {}).get("num_draft_tokens") or 0) for r in ok)
    accepted = sum(int((r.spec_decode or {}).get("num_accepted_tokens") or 0) for r in ok)
    with_drafts = sum(int((r.spec_decode or {}).get("num_steps_with_drafts") or 0) for r in ok)
    errors = [r for r in records if not r.ok]
    return {
        "concurrency": concurrency,
        "requests": len(records) + skipped,
        "completed": len(ok),
        "errors": len(errors),
        "skipped": skipped,
        "error_messages": sorted({r.error or "" for r in errors})[:10],
        "wall_s": wall_s,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": distribution([x for r in ok for x in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "mean_acceptance_length": (accepted + drafts) / drafts if drafts else None,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        # Share of verify steps that verified drafts: τ near 1 with a low share means the policy
        # kept speculation off, not that drafts failed.
        "draft_step_share": with_drafts / drafts if drafts else None,
        "spec_decode": {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted},
        "per_request": [{k: v for k, v in asdict(r).items() if k != "itl_s"} for r in records],
    }


# -- comparisons -----------------------------------------------------------------------------------


def compare(path_a: Path, path_b: Path) -> dict[str, Any]:
    a, b = json.loads(path_a.read_text()), json.loads(path_b.read_text())
    name_a, name_b = a.get("label") or path_a.stem, b.get("label") or path_b.stem
    if name_a == name_b:  # keep the columns apart when both runs carry the same label
        name_a, name_b = f"{name_a} (A)", f"{name_b} (B)"
    common = sorted(set(a["levels"]) & set(b["levels"]), key=int)
    levels = {}
    for c in common:
        la, lb = a["levels"][c], b["levels"][c]
        ta, tb = la["output_tokens_per_s"], lb["output_tokens_per_s"]
        levels[c] = {
            "concurrency": int(c),
            "a_output_tokens_per_s": ta,
            "b_output_tokens_per_s": tb,
            "output_tokens_per_s_ratio": ta / tb if tb > 0 else None,
            "a_requests_per_s": la["requests_per_s"],
            "b_requests_per_s": lb["requests_per_s"],
            **{f"{side}_{key}": lv[key] for side, lv in (("a", la), ("b", lb)) for key in ("ttft_s", "itl_s", "e2e_s")},
            "a_mean_acceptance_length": la["mean_acceptance_length"],
            "b_mean_acceptance_length": lb["mean_acceptance_length"],
            "a_errors": la["errors"] + la["skipped"],
            "b_errors": lb["errors"] + lb["skipped"],
        }
    return {
        "a": {"label": name_a, "path": str(path_a), "model": a.get("model"), "url": a.get("url")},
        "b": {"label": name_b, "path": str(path_b), "model": b.get("model"), "url": b.get("url")},
        "levels": levels,
    }


def summarize_repetitions(paths: list[Path]) -> dict[str, Any]:
    """Per concurrency level over several `--compare` results of the same A and B: each
    repetition's A / B ratio and τ of A, the median ratio and range, and mean(A) / mean(B)."""
    runs = [json.loads(p.read_text()) for p in paths]
    common = sorted(set.intersection(*(set(r["levels"]) for r in runs)), key=int)
    levels = {}
    for c in common:
        per = [r["levels"][c] for r in runs]
        ratios = [lv["output_tokens_per_s_ratio"] for lv in per]
        known = sorted(x for x in ratios if x is not None)
        mean_a = sum(lv["a_output_tokens_per_s"] for lv in per) / len(per)
        mean_b = sum(lv["b_output_tokens_per_s"] for lv in per) / len(per)
        levels[c] = {
            "concurrency": int(c),
            "ratios": ratios,
            "ratio_median": quantile(known, 0.5) if known else None,
            "ratio_min": known[0] if known else None,
            "ratio_max": known[-1] if known else None,
            "mean_a_output_tokens_per_s": mean_a,
            "mean_b_output_tokens_per_s": mean_b,
            "ratio_of_means": mean_a / mean_b if mean_b > 0 else None,
            "a_mean_acceptance_length": [lv["a_mean_acceptance_length"] for lv in per],
            "errors": sum(lv["a_errors"] + lv["b_errors"] for lv in per),
        }
    return {
        "a": runs[0]["a"]["label"],
        "b": runs[0]["b"]["label"],
        "repetitions": [str(p) for p in paths],
        "levels": levels,
    }


# -- files -----------------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _levels(result: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    return sorted(((int(k), v) for k, v in result["levels"].items()), key=lambda kv: kv[0])


def write_reports(result: dict[str, Any], json_path: Path) -> None:
    """A load run's JSON, its Markdown table (.md) and plots (_throughput.png, _latency.png) beside it."""
    write_table(result, json_path, load_markdown(result))
    stem = json_path.with_suffix("")
    levels = _levels(result)

    plt = _pyplot()
    xs = [c for c, _ in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [lv["output_tokens_per_s"] for _, lv in levels], marker="o", label=result["label"] or None)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(f"{stem}_throughput.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL (per token)", "end-to-end")):
        for name, _ in QUANTILES:
            ys = [lv[key][name] * 1000 if lv[key][name] is not None else math.nan for _, lv in levels]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(f"{stem}_latency.png", dpi=100)
    plt.close(fig)


def write_compare_reports(result: dict[str, Any], json_path: Path) -> None:
    """A comparison's JSON, its Markdown table (.md) and _throughput.png beside it."""
    write_table(result, json_path, compare_markdown(result))
    stem = json_path.with_suffix("")
    na, nb = result["a"]["label"], result["b"]["label"]
    levels = sorted(result["levels"].values(), key=lambda lv: lv["concurrency"])

    plt = _pyplot()
    xs = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [lv["a_output_tokens_per_s"] for lv in levels], marker="o", label=na)
    ax1.plot(xs, [lv["b_output_tokens_per_s"] for lv in levels], marker="s", label=nb)
    ax1.set_xlabel("concurrent clients")
    ax1.set_ylabel("output tokens/s")
    ax1.set_ylim(bottom=0)
    ax1.legend()
    ratios = [lv["output_tokens_per_s_ratio"] or 0.0 for lv in levels]
    ax2.bar([str(x) for x in xs], ratios)
    ax2.axhline(1.0, color="grey", linewidth=0.8)
    ax2.set_xlabel("concurrent clients")
    ax2.set_ylabel(f"output tokens/s, {na} / {nb}")
    if xs:
        ax1.set_xscale("log", base=2)
        ax1.set_xticks(xs, [str(x) for x in xs])
    fig.tight_layout()
    fig.savefig(f"{stem}_throughput.png", dpi=100)
    plt.close(fig)


def write_repetition_reports(result: dict[str, Any], json_path: Path) -> None:
    write_table(result, json_path, repetitions_markdown(result))
