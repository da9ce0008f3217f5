"""The figures of docs/benchmarks.md, drawn from the results the repository keeps.

    python -m bench.plots                      # writes docs/img/*.png
    python -m bench.plots --out /tmp/img       # elsewhere

Every plot reads JSON written by a benchmark or by `domino-train eval`; nothing is measured here and no
measured value is typed in. The inputs are named in `SOURCES` below, so a new round that replaces a
result changes one line. `SOURCES` also holds what the files do not record and the titles state: the
machine, and for serving the request settings (the per-server files that held them are not kept).

Figures:
- `speedup_by_mode.png`: batch-1 decode tok/s per mode on the ShareGPT test half and HumanEval
  (`bench.engine`), each bar labelled with its ratio to the set's reference mode.
- `tau_per_slot.png`: accepted drafts per verify step at each draft slot on the test slice
  (`domino-train eval`, full blocks): the shipped drafter with its head on and off, and the
  like-for-like Domino / DFlash pair.
- `serving_by_concurrency.png`: output tok/s by concurrency for `domino` and `ar` (`bench.load`
  comparisons, one point per repetition) and the ratio per repetition.
- `verify_cost.png`: what a verify over T tokens per row costs relative to a plain step
  (`bench.verify_cost`), bf16 at batches 1, 4, 8 and fp32 at batch 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("bench/results")

# Where each figure's numbers come from (paths relative to the repository root).
SOURCES: dict[str, Any] = {
    # Round 19, 2-core Intel Xeon VM (AVX-512 BF16, AMX), bf16, one thread.
    "engine": {
        "ShareGPT test half": RESULTS / "engine_sharegpt_round19.json",
        "HumanEval": RESULTS / "engine_humaneval_round19.json",
    },
    # The reference mode each set's ratios are read against (docs/benchmarks.md).
    "engine_reference": {"ShareGPT test half": "hf-generate", "HumanEval": "hf-prompt-lookup"},
    "engine_machine": "round 19: 2-core Intel Xeon (AVX-512 BF16, AMX)",
    # Test-slice evaluations (fp32).
    "shipped_domino_eval": Path("drafters/smollm2-135m-domino/eval.json"),
    "pair_domino_eval": Path("drafters/train_logs/smollm2-135m-domino-pair19-block8-stage2/eval.json"),
    "pair_dflash_eval": Path("drafters/train_logs/smollm2-135m-dflash-pair19-block8-stage2/eval.json"),
    # bench.load --compare outputs, one per ABAB repetition.
    "serving_domino_vs_ar": [
        RESULTS / "load_domino_vs_ar_1_round19.json",
        RESULTS / "load_domino_vs_ar_2_round19.json",
        RESULTS / "load_domino_vs_ar_1_round19b.json",
        RESULTS / "load_domino_vs_ar_2_round19b.json",
    ],
    # Concurrency 1 was measured only with two drafters side by side; side A is the shipped one.
    "serving_shipped_c1": [
        RESULTS / "load_vocab16k_vs_vocab8k_1_round19.json",
        RESULTS / "load_vocab16k_vs_vocab8k_2_round19.json",
    ],
    "serving_machine": "round 19: 2-core Intel Xeon (AVX-512 BF16, AMX), bf16, 1 thread per server",
    "serving_settings": "32 streaming chats of 64 tokens per level",
    # bench.verify_cost: bf16 after round 6's engine changes; fp32 and bf16 at batch 1 from round 4.
    "verify_bf16": {
        1: RESULTS / "verify_cost_batch1_round6.json",
        4: RESULTS / "verify_cost_batch4_round6.json",
        8: RESULTS / "verify_cost_batch8_round6.json",
    },
    "verify_fp32": RESULTS / "verify_cost.json",  # fp32 and bf16 at batch 1, before round 6
    "verify_machine": "2-core VMs with AVX-512 BF16, 1 thread, context 300",
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads((ROOT / path).read_text())


def _style() -> None:
    plt.rcParams.update(
        {
            "font.size": 11,
            "axes.titlesize": 11,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )


def _save(fig: plt.Figure, out: Path, name: str) -> Path:
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def speedup_by_mode(out: Path) -> Path:
    """Decode tok/s per mode, one panel per prompt set, each bar labelled with its ratio to the reference."""
    sets = SOURCES["engine"]
    fig, axes = plt.subplots(1, len(sets), figsize=(10, 4.2), sharey=True)
    for ax, (name, path) in zip(axes, sets.items()):
        modes = _load(path)["modes"]
        reference = SOURCES["engine_reference"][name]
        ref_tps = modes[reference]["decode_tokens_per_s"]
        names = list(modes)
        tps = [modes[m]["decode_tokens_per_s"] for m in names]
        colours = ["tab:orange" if m == "domino" else ("tab:grey" if m == reference else "tab:blue") for m in names]
        bars = ax.bar(names, tps, color=colours)
        for bar, value in zip(bars, tps):
            ax.annotate(
                f"{value:.1f}\n{value / ref_tps:.2f}×",
                (bar.get_x() + bar.get_width() / 2, value),
                ha="center",
                va="bottom",
                fontsize=10,
            )
        ax.set_title(f"{name} (ratios vs {reference})")
        ax.set_ylim(0, max(tps) * 1.3)
        ax.tick_params(axis="x", labelrotation=15)
    axes[0].set_ylabel("decode tok/s, batch 1")
    cfg = _load(next(iter(sets.values())))["config"]
    fig.suptitle(
        f"bench.engine, {SOURCES['engine_machine']}, {cfg['dtype']}, {cfg['threads']} thread, "
        f"{cfg['prompts']} prompts x {cfg['max_new_tokens']} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    return _save(fig, out, "speedup_by_mode.png")


def _slots(entry: dict[str, Any]) -> list[float]:
    return entry["tau_per_slot"]


def tau_per_slot(out: Path) -> Path:
    """Accepted drafts per verify step at each slot; τ = 1 + their sum."""
    shipped = _load(SOURCES["shipped_domino_eval"])
    pair_domino = _load(SOURCES["pair_domino_eval"])["domino"]
    pair_dflash = _load(SOURCES["pair_dflash_eval"])["dflash"]
    panels = [
        (
            "shipped drafter (block 8), head on vs off",
            [
                (f"Domino head on, τ {shipped['domino']['tau']:.3f}", _slots(shipped["domino"]), "tab:orange"),
                (f"same drafter, head off, τ {shipped['dflash']['tau']:.3f}", _slots(shipped["dflash"]), "tab:grey"),
            ],
        ),
        (
            "like for like: same data, steps, seed, recipe (608k blocks)",
            [
                (f"Domino, τ {pair_domino['tau']:.3f}", _slots(pair_domino), "tab:orange"),
                (f"DFlash, τ {pair_dflash['tau']:.3f}", _slots(pair_dflash), "tab:blue"),
            ],
        ),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, (title, series) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (label, values, colour) in enumerate(series):
            xs = [j + 1 + (i - (len(series) - 1) / 2) * width for j in range(len(values))]
            ax.bar(xs, values, width=width, label=label, color=colour)
        ax.set_xticks(range(1, len(series[0][1]) + 1))
        ax.set_xlabel("draft slot")
        ax.set_title(title)
        ax.legend(fontsize=9)
    axes[0].set_ylabel("accepted per verify step")
    fig.suptitle(
        f"domino-train eval --slice {shipped['slice']}: {shipped['domino']['prompts']} ShareGPT prompts x "
        f"{shipped['max_new_tokens']} tokens, every draft verified, T = 0, fp32",
        fontsize=10,
    )
    fig.tight_layout()
    return _save(fig, out, "tau_per_slot.png")


def serving_by_concurrency(out: Path) -> Path:
    """Output tok/s by concurrency (a point per repetition, a line through the means) and domino / ar."""
    points: dict[str, dict[int, list[float]]] = {"domino": {}, "ar": {}}
    ratios: dict[int, list[float]] = {}
    for path in SOURCES["serving_domino_vs_ar"]:
        cmp = _load(path)
        for level, row in cmp["levels"].items():
            c = int(level)
            points["domino"].setdefault(c, []).append(row["a_output_tokens_per_s"])
            points["ar"].setdefault(c, []).append(row["b_output_tokens_per_s"])
            ratios.setdefault(c, []).append(row["output_tokens_per_s_ratio"])
    for path in SOURCES["serving_shipped_c1"]:
        row = _load(path)["levels"].get("1")
        if row:
            points["domino"].setdefault(1, []).append(row["a_output_tokens_per_s"])

    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 2]})
    styles = {"domino": ("tab:orange", "o"), "ar": ("tab:blue", "s")}
    for mode, by_level in points.items():
        colour, marker = styles[mode]
        levels = sorted(by_level)
        for c in levels:
            ax.scatter([c] * len(by_level[c]), by_level[c], color=colour, marker=marker, alpha=0.5, s=25)
        means = [sum(by_level[c]) / len(by_level[c]) for c in levels]
        ax.plot(levels, means, color=colour, marker=marker, label=f"{mode} (mean)")
        for c, m in zip(levels, means):
            ax.annotate(f"{m:.1f}", (c, m), textcoords="offset points", xytext=(6, -12 if mode == "ar" else 6))
    c1 = points["domino"].get(1)
    if c1:  # from another pair of servers (two drafters side by side), so marked apart
        ax.scatter(
            [1], [sum(c1) / len(c1)], s=120, facecolors="none", edgecolors="black", label="domino at 1: drafter A/B run"
        )
    ax.annotate("ar: not measured\nat concurrency 1", (1.05, 88), fontsize=9, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 8, 16], labels=["1", "8", "16"])
    ax.set_xlabel("concurrent streaming clients")
    ax.set_ylabel("output tok/s")
    ax.set_ylim(0, None)
    ax.legend(loc="upper left")
    ax.set_title(f"bench.load, {SOURCES['serving_settings']}")

    levels = sorted(ratios)
    ax_ratio.boxplot([ratios[c] for c in levels], positions=range(len(levels)), widths=0.4)
    for i, c in enumerate(levels):
        ax_ratio.scatter([i] * len(ratios[c]), ratios[c], color="tab:orange", s=25, zorder=3)
    ax_ratio.axhline(1.0, color="grey", linewidth=0.8)
    ax_ratio.set_xticks(range(len(levels)), labels=[str(c) for c in levels])
    ax_ratio.set_xlabel("concurrency")
    ax_ratio.set_ylabel("domino / ar, per repetition")
    ax_ratio.set_title(f"{len(SOURCES['serving_domino_vs_ar'])} ABAB repetitions")
    fig.suptitle(f"Serving, {SOURCES['serving_machine']}", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "serving_by_concurrency.png")


def verify_cost(out: Path) -> Path:
    """Forward time over T new tokens per row divided by the time over one token."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for batch, path in SOURCES["verify_bf16"].items():
        secs = _load(path)["seconds"]["bfloat16"]
        ts = sorted(int(t) for t in secs)
        ax.plot(ts, [secs[str(t)] / secs["1"] for t in ts], marker="o", label=f"bf16, batch {batch} (round 6)")
    round4 = _load(SOURCES["verify_fp32"])["seconds"]  # one run, both dtypes side by side
    for dtype, colour, label in (("float32", "black", "fp32"), ("bfloat16", "tab:grey", "bf16")):
        secs = round4[dtype]
        ts = sorted(int(t) for t in secs)
        ax.plot(
            ts,
            [secs[str(t)] / secs["1"] for t in ts],
            marker="s",
            linestyle="--",
            color=colour,
            label=f"{label}, batch 1 (round 4)",
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("tokens per row in the forward (T = drafts + 1)")
    ax.set_ylabel("time / time at T = 1")
    ax.set_ylim(0.8, None)
    ax.legend()
    ax.set_title(f"bench.verify_cost, SmolLM2-135M, {SOURCES['verify_machine']}", fontsize=10)
    fig.tight_layout()
    return _save(fig, out, "verify_cost.png")


PLOTS = (speedup_by_mode, tau_per_slot, serving_by_concurrency, verify_cost)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="bench.plots", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="directory for the PNGs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    _style()
    written = [plot(args.out) for plot in PLOTS]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
