"""Typed configuration of the training jobs. `train/cli.py` builds these from `domino-train`'s flags
(whose defaults are the ones here; tests/train checks they agree); the library takes nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class GenConfig:
    """`domino-train gen`: regenerate answers with the target (train/gen.py)."""

    out: Path
    target: str = "default"
    prompts: Path | None = None  # a JSONL prompt file instead of ShareGPT
    source: str = "first-turns"  # ShareGPT: "first-turns" or "later-turns"
    batch_size: int = 16
    shard_size: int = 64
    first_shard: int = 0
    last_shard: int | None = None  # None: the last
    limit: int | None = None  # only the first N train prompts
    heldout: int = 200
    max_prompt_tokens: int = 384
    max_new_tokens: int = 256
    device: str = "cpu"
    dtype: str = "float32"
    time_budget_s: float | None = None  # start no shard that would end after this


@dataclass
class DataConfig:
    """Where fit's samples and their target features come from (train/samples.py)."""

    dirs: list[Path]  # gen directories; validation comes from the first one's first shard
    features_dir: str | None = None  # None: ~/.cache/domino-serve/features/<data dir name>
    stored_only: bool = False  # train only on shards whose features are stored (picks up new ones)
    online_features: bool = False  # a target forward per batch, nothing stored
    topk: int = 16  # target log-probs stored per position (distillation)
    val_samples: int = 64  # held out of the first shard
    max_samples: int | None = None


@dataclass
class DrafterSpec:
    """A new drafter's architecture; with `init_from`, what to change in that drafter (None: keep)."""

    init_from: str | None = None
    layers: int | None = None  # None: train.init.DEFAULT_LAYERS (with init_from: deepen to this)
    block_size: int | None = None  # None: DEFAULT_BLOCK_SIZE (with init_from: re-block)
    taps: list[int] | None = None  # None: the design notes' rule (model.nn.drafter.default_target_layer_ids)
    gru_size: int = 256
    rank: int | None = None  # None: DEFAULT_RANK (with init_from: widen the head)
    head: bool = True  # False: the plain DFlash baseline
    shift_label: bool = True
    qk_norm: bool = True
    mask_token_id: int | None = None  # None: a learned mask embedding
    draft_vocab: int | None = None  # None: 8192 for a new drafter; 0: the full vocabulary
    rebuild_vocab: bool = False  # with init_from: re-pick the draft vocabulary
    warm_start: bool = True  # draft layers start as copies of the target's top layer


@dataclass
class FitConfig:
    """`domino-train fit` (train/fit.py): data, drafter, optimisation, validation and budget."""

    out: Path  # the best drafter so far (published layout)
    run_dir: Path  # state.pt, log.csv, val.csv, loss.png, summary.json
    data: DataConfig
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    target: str = "default"
    restart: bool = False  # ignore a saved state in run_dir
    steps: int = 2000
    batch_seqs: int = 1
    anchors: int = 32  # blocks per sequence per step
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup: float = 0.04  # fraction of training
    clip: float = 1.0
    base_loss_until: float = 0.5  # λ falls from 1 to 0 over this fraction of training
    gamma: float | None = None  # per-slot decay exp(-j/γ); None: 0.45·B, 0: off
    distill: float = 0.0  # weight of the target's top-k soft labels
    detach_head: bool = False  # the head trains on a detached backbone
    val_tokens: int = 128  # answer tokens walked per validation sequence
    eval_every: int = 1000
    save_every: int = 200
    stop_after: int | None = None  # stop (resumably) after this many steps in this run
    time_budget_s: float | None = None  # schedules follow wall time
    device: str = "cpu"
    amp: str = "auto"  # "auto" | "bf16" | "off"
    threads: int | None = None
    seed: int = 0
