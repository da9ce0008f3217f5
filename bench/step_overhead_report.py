"""bench/step_overhead.py's results: a case's samples summarized as its JSON record (`summarize`),
and the Markdown report of a run (`markdown`): a table of every case, then where the largest batch's
reads are, by call site. Apart from the measuring so that neither module passes ~400 lines.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.common import TINY

COUNTS = {  # JSON field: ReadCounter key
    "reads": "all:read",
    "shape_syncs": "all:shape",
    "device_reads": "device:read",
    "device_shape_syncs": "device:shape",
    "h2d_copies": "device:h2d",  # host->device copies that block (bench/host_reads.py)
    "h2d_async_copies": "device:h2d_async",  # asked for with non_blocking=True
}


@dataclass
class Samples:
    step_s: list[float] = field(default_factory=list)
    captured_s: list[float] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)
    captured_cpu_s: list[float] = field(default_factory=list)
    run_s: list[float] = field(default_factory=list)
    counts: dict[str, list[int]] = field(default_factory=lambda: {name: [] for name in COUNTS})
    cuda_syncs: list[int] = field(default_factory=list)
    kv_bytes_read: list[int] = field(default_factory=list)  # what each timed step's attention read
    tokens: int = 0
    verify_calls: int = 0
    propose_calls: int = 0
    dynamic_verifies: int = 0


def _ms(seconds: list[float]) -> dict[str, Any]:
    ms = [1e3 * x for x in seconds]
    return {
        "median": statistics.median(ms),
        # A low quantile: on a shared machine interference only ever adds time.
        "p25": sorted(ms)[(len(ms) - 1) // 4],
        "mean": statistics.fmean(ms),
        "min": min(ms),
        "max": max(ms),
        "per_step": ms,
    }


def _counts(per_step: list[int], sites: Counter[str]) -> dict[str, Any]:
    return {
        "per_step": per_step,
        "mean": statistics.fmean(per_step),
        "max": max(per_step),
        "total": sum(per_step),
        "by_site": dict(sites.most_common()),  # totals over the counted steps
    }


def summarize(
    case: dict[str, Any],
    s: Samples,
    sites: dict[str, Counter[str]],
    sync_sites: Counter[str] | None,
    max_drafts_per_step: int,
) -> dict[str, Any]:
    """A case's JSON record: `case` (policy, mode, batch, sampling, temperature), then its times,
    counts (`sites`: a ReadCounter's counts, totals per call site) and step statistics."""
    steps, batch = len(s.step_s), case["batch"]
    host = [a - b for a, b in zip(s.step_s, s.captured_s)]
    host_cpu = [a - b for a, b in zip(s.step_cpu_s, s.captured_cpu_s)]
    result: dict[str, Any] = {
        **case,
        "steps": steps,
        "host_ms": _ms(host),
        "step_ms": _ms(s.step_s),
        "captured_ms": _ms(s.captured_s),
        # The same split in this thread's CPU time: time other processes take from it is left out
        # (with one torch thread every CPU op runs on it; on CUDA, time spent spinning in a sync counts).
        "host_cpu_ms": _ms(host_cpu),
        "step_cpu_ms": _ms(s.step_cpu_s),
        "run_ms": _ms(s.run_s),
    }
    for name, key in COUNTS.items():
        result[name] = _counts(s.counts[name], sites[key])
    result["cuda_syncs"] = _counts(s.cuda_syncs, sync_sites) if sync_sites is not None else None
    result.update(
        kv_bytes_read_per_step=statistics.fmean(s.kv_bytes_read),
        tokens_per_row_step=s.tokens / (steps * batch),
        static_verify_calls=s.verify_calls,
        static_propose_calls=s.propose_calls,
        dynamic_verifies=s.dynamic_verifies,
        max_drafts_per_step=max_drafts_per_step,
    )
    return result


# -- the report -------------------------------------------------------------------------------


def _per_step(counts: dict[str, Any], site: str, steps: int) -> str:
    return f"{counts['by_site'].get(site, 0) / steps:.2f}"


def markdown(result: dict[str, Any]) -> str:
    env, cfg = result["environment"], result["config"]
    cuda = env["device"].startswith("cuda")
    bf16 = ", AVX-512 BF16" if env["avx512_bf16"] else ""
    on = f"{env['gpu']} (host: {env['cpu']})" if cuda else f"{env['cpu']}{bf16}"
    columns = ["mode", "policy", "batch", "sampling", "host ms/step (median)", "host ms (p25)", "host CPU ms (median)"]
    columns += ["step ms (median)", "captured ms (median)", "reads/step (mean, max)", "device reads/step (mean, max)"]
    columns += ["device shape syncs/step", "blocking H2D copies/step", "non-blocking H2D copies/step"]
    columns += ["CUDA syncs/step"] if cuda else []
    columns += ["KV KiB read/step", "tokens/row/step", "drafter buckets/step"]
    lines = [
        "# Host time per decode step outside the captured functions (`python -m bench.step_overhead`)",
        "",
        f"{env['device']}: {on}; {env['dtype']}; {env['threads']} thread(s); torch {env['torch']}, "
        f"transformers {env['transformers']}; load average {env['load_average']} at the start, "
        f"{env['load_average_end']} at the end, on {env['cpus']} CPUs; commit {str(env['commit'])[:10]}"
        f"{' with uncommitted changes in model/' if env['model_dirty'] else ''}.",
        f"Tiny random Qwen3 target (2 layers, 64 wide, vocab {TINY['vocab_size']}); dflash/domino: a 2-layer "
        f"drafter, block {cfg['block_size']}. Static shapes on"
        f"{', CUDA graphs' if cuda else ' (the buckets run eagerly)'}; default engine settings but the draft "
        f"policy (n-gram copies on in dflash/domino). Per case: {cfg['warmup']} warm-up decode steps, then "
        f"{cfg['steps']} timed and {cfg['steps']} counted.",
        "",
        "- host = step − captured (the buckets' graph replay on CUDA, their function on the CPU), in wall time; "
        "host CPU: the same in this thread's CPU time, which leaves out time other processes take from it.",
        "- reads: calls that bring a tensor's values to Python (`item`, `tolist`, `bool`, `int`, `float`, "
        "`cpu`, ...), of tensors on the engine's device"
        + (
            "; on the CPU every tensor, so these are reads that *would* be device→host on CUDA, an upper bound."
            if not cuda
            else "."
        ),
        "- device reads: of tensors that live on the device on CUDA"
        + (" (on the CPU estimated by residency tracking; host-side policy tensors excluded)." if not cuda else ".")
        + " Shape syncs: ops whose output shape depends on device data (`nonzero`, boolean masks)."
        + " H2D copies: host data copied to the device (`torch.tensor(..., device=)`, `.to(device)` of a host"
        + " tensor, host tensors or lists mixed into device ops), blocking or asked for with `non_blocking=True`.",
        "",
        "| " + " | ".join(columns) + " |",
        "|---|---|---:|---|" + "---:|" * (len(columns) - 4),
    ]
    for r in result["results"]:
        cells = [
            r["mode"],
            r["policy"],
            str(r["batch"]),
            r["sampling"],
            f"{r['host_ms']['median']:.2f}",
            f"{r['host_ms']['p25']:.2f}",
            f"{r['host_cpu_ms']['median']:.2f}",
            f"{r['step_ms']['median']:.2f}",
            f"{r['captured_ms']['median']:.2f}",
            f"{r['reads']['mean']:.1f}, {r['reads']['max']}",
            f"{r['device_reads']['mean']:.1f}, {r['device_reads']['max']}",
            f"{r['device_shape_syncs']['mean']:.1f}",
            f"{r['h2d_copies']['mean']:.1f}",
            f"{r['h2d_async_copies']['mean']:.1f}",
        ]
        if cuda:
            cells.append(f"{r['cuda_syncs']['mean']:.1f}")
        cells += [
            f"{r['kv_bytes_read_per_step'] / 1024:.0f}",
            f"{r['tokens_per_row_step']:.2f}",
            f"{r['static_propose_calls'] / r['steps']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    largest = max(r["batch"] for r in result["results"])
    lines += [
        "",
        "## Where the reads are",
        "",
        f"Per step at batch {largest}: all reads / device reads (and shape syncs), by call site.",
    ]
    for r in result["results"]:
        if r["batch"] != largest:
            continue
        lines += ["", f"**{r['mode']}, {r['policy']} policy, {r['sampling']}**", ""]
        for kind, every, device in (
            ("read", r["reads"], r["device_reads"]),
            ("shape sync", r["shape_syncs"], r["device_shape_syncs"]),
        ):
            sites = list(every["by_site"]) + [x for x in device["by_site"] if x not in every["by_site"]]
            for site in sites:
                n_all, n_dev = _per_step(every, site, r["steps"]), _per_step(device, site, r["steps"])
                lines.append(f"- {kind} {n_all} / {n_dev}: `{site}`")
        for name, label in (("h2d_copies", "blocking H2D copy"), ("h2d_async_copies", "non-blocking H2D copy")):
            for site in r[name]["by_site"]:
                lines.append(f"- {label} {_per_step(r[name], site, r['steps'])}: `{site}`")
        if r["cuda_syncs"] is not None:
            for site in r["cuda_syncs"]["by_site"]:
                lines.append(f"- CUDA sync {_per_step(r['cuda_syncs'], site, r['steps'])}: `{site}`")
    return "\n".join(lines) + "\n"
