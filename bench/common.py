"""What the benchmarks share: the Qwen3-8B / Domino-b16 shapes, their scaled-down copies and the
tiny CPU shapes, random-weight builders, timing, the environment a result was measured on, and the
GPU benchmarks' common flags. Rendering and writing results: bench/report.py.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

from model.engine.engine import Engine
from model.load.loading import PACKED
from model.nn.drafter import Drafter, DrafterConfig, default_target_layer_ids
from model.nn.target import TargetModel

REPO = Path(__file__).resolve().parent.parent

# -- shapes ------------------------------------------------------------------------------------

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
# The widths a drafter shares with its target (it runs the target's layer shape).
SHARED_WIDTHS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)
# A tiny model for CPU measurements of the engine's own work (bench/step_overhead.py): a 2-layer,
# 64-wide target and a 2-layer drafter over it.
TINY = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 128,
    "target_layers": 2,
    "draft_layers": 2,
    "gru_hidden_dim": 24,
    "emb_dim": 8,
    "mask_token_id": 127,
    "block_size": 6,
}
# Engine variants: (static_shapes, cuda_graphs). eager is the dynamic path (the default on the CPU).
VARIANTS: dict[str, tuple[bool, bool]] = {"eager": (False, False), "static": (True, False), "graph": (True, True)}


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


# -- builders ----------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_target(shapes: dict[str, int], dtype: torch.dtype, device: torch.device, **config: Any) -> TargetModel:
    """A random Qwen3 target of these shapes; `config` overrides fields of its Qwen3Config."""
    fields: dict[str, Any] = dict(
        **{k: shapes[k] for k in SHARED_WIDTHS},
        num_hidden_layers=shapes["target_layers"],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    config = Qwen3Config(**{**fields, **config})
    # Parameters are created (and randomly initialised) on the device in the target dtype: the
    # full-size model is ~16 GB in bf16 and must never exist as an fp32 copy or on the host.
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return TargetModel(model.eval())


def build_drafter(shapes: dict[str, int], dtype: torch.dtype, device: torch.device, **config: Any) -> Drafter:
    """A random Domino drafter of these shapes; `config` overrides fields of its DrafterConfig."""
    layers, target_layers = shapes["draft_layers"], shapes["target_layers"]
    fields: dict[str, Any] = dict(
        **{k: shapes[k] for k in SHARED_WIDTHS},
        num_hidden_layers=layers,
        block_size=shapes["block_size"],
        # Clamped so that --layers-scale never asks for a layer the shrunken target lacks.
        target_layer_ids=[min(max(i, 0), target_layers - 1) for i in default_target_layer_ids(target_layers, layers)],
        num_target_layers=target_layers,
        mask_token_id=shapes["mask_token_id"],
        projector_type="domino",
        shift_label=True,
        gru_hidden_dim=shapes["gru_hidden_dim"],
        emb_dim=shapes["emb_dim"],
    )
    cfg = DrafterConfig(**{**fields, **config})
    with torch.device(device), default_dtype(dtype):
        drafter = Drafter(cfg)
    return drafter.eval()


@torch.no_grad()
def widen_init(module: torch.nn.Module, std: float) -> torch.nn.Module:
    """Redraw a module's weights: N(0, std), norms 1 + N(0, 0.1). A wide init gives a tiny random
    drafter drafts that are not near-uniform."""
    for name, p in module.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0, std)
    return module


# -- timing ------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn() after `warmup` calls: CUDA events on CUDA,
    perf_counter around synchronised work elsewhere."""
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
    return samples


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of fn() (sample_ms)."""
    return statistics.median(sample_ms(fn, device, warmup, repeats))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def static_warmup(engine: Engine) -> dict[str, Any] | None:
    """The static-shape engine's warm-up report (graphs captured, eager buckets, seconds, MiB), or
    None for a dynamic engine."""
    report = engine.static.report if engine.static is not None else None
    return None if report is None else {**asdict(report), "memory_mib": report.memory_bytes / 2**20}


# -- environment -------------------------------------------------------------------------------


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


def cpu_info() -> dict[str, Any]:
    """The CPU's model name (as lscpu shows it), whether it has AVX-512 BF16, and the CPU count."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    name = fields.get("model name") or platform.processor() or platform.machine()
    return {"cpu": name, "avx512_bf16": "avx512_bf16" in fields.get("flags", "").split(), "cpus": os.cpu_count()}


def git_state() -> dict[str, Any]:
    """The commit measured, and whether model/ had uncommitted changes (a result that names source
    lines needs both)."""
    try:
        run = functools.partial(subprocess.run, cwd=REPO, capture_output=True, text=True, timeout=10, check=True)
        commit = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        changes = run(["git", "status", "--porcelain", "--", "model"]).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "model_dirty": None, "model_changes": None}
    return {"commit": commit, "model_dirty": bool(changes), "model_changes": changes}


def load_average() -> float | None:
    """The 1-minute load average: other work on the machine while a host-time result was measured."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def host_environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What a result that times host work was measured on: versions, the CPU, the load at the start
    and the commit (and on CUDA the GPU)."""
    env: dict[str, Any] = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        **cpu_info(),
        "load_average": load_average(),
        **git_state(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


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


def start(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """A run's device and dtype from its flags, with its CPU threads and seed set."""
    device, dtype = device_and_dtype(args.device, args.dtype)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return device, dtype


def measured_on(device: torch.device, dtype: torch.dtype, build_s: float, **extra: Any) -> dict[str, Any]:
    """`environment`, then `extra`, then (on CUDA) the peak memory so far."""
    env = {**environment(device, dtype, build_s), **extra}
    if device.type == "cuda":
        env["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return env


# -- flags -------------------------------------------------------------------------------------


def dtype_label(dtype_arg: str, activations: torch.dtype) -> str:
    """What a report names the target's dtype: `int4 weights, bf16 activations` for a packed one."""
    name = str(activations).removeprefix("torch.")
    return f"{dtype_arg} weights, {name} activations" if dtype_arg in PACKED else name


DTYPE_HELP = (
    "auto (bf16 with native bf16, else fp32), float32, bfloat16, int8 (weight-only int8, bf16 activations), "
    "int4 (int4 in groups of 32, the LM head int8)"
)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_shape_args(p: argparse.ArgumentParser, dtype_help: str | None = None) -> None:
    """--scale, --layers-scale, --device, --dtype: the flags every GPU benchmark starts with."""
    p.add_argument("--scale", type=int, default=1, help="divide every width by K (CPU runs: 16)")
    p.add_argument("--layers-scale", type=int, default=1, help="also divide layer counts by K")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help=dtype_help)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """--threads, --seed, --json, --markdown: the flags every GPU benchmark ends with."""
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here")


def flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as JSON values (paths as strings): a result's "config"."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
