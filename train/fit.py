"""`domino-train fit`: train a drafter on regenerated answers, from stored target features.

Resumable: the run directory keeps `state.pt` (weights, optimizer, step, RNG, elapsed time, best
validation τ), `log.csv` (per step), `val.csv` (per evaluation) and `loss.png`. Schedules (warm-up,
cosine, λ) are functions of the progress saved in the state, so a resumed run continues them.
Every `eval_every` steps the greedy acceptance walk is replayed offline on a validation slice of
the data (never trained on) and `out` is overwritten only when τ improves: `out` always holds the
best checkpoint so far.

`fit` is the loop. `load_state`, `prepare` and `resume` set a run up; `train_step`, `validate` and
`checkpoint` are what the loop does.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from tqdm import tqdm

from model.load.checkpoint import load_drafter, save_drafter
from model.load.loading import cpu_has_native_bf16, load_target, resolve_device
from model.nn.drafter import Drafter, DrafterConfig, head_parameters
from model.nn.target import TargetModel
from train.config import DrafterSpec, FitConfig
from train.evaluate import offline_walk
from train.init import (
    DEFAULT_DRAFT_VOCAB,
    deepen,
    draft_vocab_map,
    init_weights,
    make_drafter_config,
    rebuild_draft_vocab,
    warm_start,
    widen_draft_vocab,
    widen_head,
)
from train.loss import default_gamma, lambda_schedule, lr_schedule, sample_batch, training_loss, training_progress
from train.samples import TrainingData

log = logging.getLogger("domino.train.fit")

LOG_COLUMNS = ["step", "loss", "loss_base", "loss_final", "acc", "lambda", "lr", "elapsed_s"]
VAL_COLUMNS = ["step", "blocks", "val_tau", "elapsed_s", "best"]
STATE = "state.pt"
REFRESH_EVERY = 500  # steps between looks for newly stored shards (stored_only)


@dataclass
class Trainer:
    """A run in progress: what the loop reads, and the position it advances."""

    cfg: FitConfig
    drafter: Drafter
    optimizer: torch.optim.Optimizer
    data: TrainingData
    val_seqs: list[tuple[torch.Tensor, torch.Tensor, int]]  # (ids, features, answer start)
    vocab_map: torch.Tensor | None  # target id -> draft-vocabulary row (-1 outside)
    gamma: float | None
    amp: bool
    detach_head: bool
    clip_groups: list[list[torch.nn.Parameter]]
    device: str
    rng: random.Random
    step: int = 0
    elapsed: float = 0.0  # training wall time, over every run in this run directory
    progress: float = 0.0  # the schedules' position in [0, 1]; never decreases
    best: float = float("-inf")  # the best validation τ so far

    @property
    def blocks(self) -> int:
        return self.step * self.cfg.batch_seqs * self.cfg.anchors


@dataclass
class RunLogs:
    """log.csv (a row per step) and val.csv (a row per validation), appended to on resume."""

    steps: Any  # csv writers
    vals: Any
    files: list[IO[str]]

    @classmethod
    def open(cls, run: Path, resume: bool) -> RunLogs:
        writers, files = [], []
        for name, columns in (("log.csv", LOG_COLUMNS), ("val.csv", VAL_COLUMNS)):
            path = run / name
            new = not path.exists() or not resume
            f = path.open("w" if new else "a", newline="")
            writer = csv.writer(f)
            if new:
                writer.writerow(columns)
            writers.append(writer)
            files.append(f)
        return cls(writers[0], writers[1], files)

    def flush(self) -> None:
        for f in self.files:
            f.flush()

    def close(self) -> None:
        for f in self.files:
            f.close()


def fit(cfg: FitConfig) -> None:
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(cfg.run_dir, cfg.restart)
    t = prepare(cfg, state)
    if state is not None:
        resume(t, state)
    logs = RunLogs.open(cfg.run_dir, resume=state is not None)
    t.drafter.train()
    t0 = time.perf_counter() - t.elapsed
    bar = tqdm(total=None if cfg.time_budget_s else cfg.steps, initial=t.step, desc="fit", unit="step", mininterval=10)
    stop_at = cfg.steps if cfg.stop_after is None else min(cfg.steps, t.step + cfg.stop_after)
    while t.step < stop_at:
        # Progress never goes back: a resumed or extended run continues its warm-up, λ and cosine.
        t.progress = max(t.progress, training_progress(t.step, cfg.steps, t.elapsed, cfg.time_budget_s))
        if t.progress >= 1.0:
            break
        if cfg.data.stored_only and t.step % REFRESH_EVERY == 0:
            t.data.refresh()
        losses, lam, lr = train_step(t)
        t.step += 1
        t.elapsed = time.perf_counter() - t0
        logs.steps.writerow([t.step, *(f"{v:.4f}" for v in losses), f"{lam:.4f}", f"{lr:.3e}", f"{t.elapsed:.1f}"])
        bar.update(1)
        if t.val_seqs and t.step % cfg.eval_every == 0:
            validate(t, logs)
        if t.step % cfg.save_every == 0:
            checkpoint(t, logs)
    if t.val_seqs and (t.step % cfg.eval_every != 0 or t.step == 0):
        validate(t, logs)  # every run ends validated, so `out` always holds its best checkpoint
    checkpoint(t, logs)
    bar.close()
    logs.close()
    write_summary(t)


def load_state(run: Path, restart: bool) -> dict[str, Any] | None:
    """The state an earlier run left in `run`, unless `restart`."""
    path = run / STATE
    return torch.load(path, weights_only=False) if path.exists() and not restart else None


def prepare(cfg: FitConfig, state: dict[str, Any] | None) -> Trainer:
    """The frozen target, the data, and the drafter (from `state`, `init_from` or new) with its optimizer."""
    device = resolve_device(cfg.device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 for the drafter's fp32 training matmuls
    model, _tok = load_target(cfg.target, torch.float32, device)
    model.requires_grad_(False)
    target = TargetModel(model)
    init = None
    if state is None and cfg.drafter.init_from:
        init = load_drafter(cfg.drafter.init_from, dtype=torch.float32, target_config=model.config)
    if state is not None:
        taps = state["config"]["target_layer_ids"]
    elif init is not None:
        taps = init.config.target_layer_ids
    else:
        taps = make_drafter_config(cfg.drafter, target, None).target_layer_ids
    data = TrainingData(cfg.data, list(taps), target, target_name=cfg.target)
    drafter = build_drafter(cfg.drafter, target, state, data, init)
    drafter.to(device)
    drafter.bind_target(target.embed_tokens.weight.detach(), target.lm_head.weight.detach())
    vocab_map = draft_vocab_map(drafter, target.vocab_size)
    if vocab_map is not None:
        answers = torch.tensor([t for _, _, s in data.train for t in s["answer"]])
        coverage = float((vocab_map[answers] >= 0).float().mean())
        log.info("draft vocabulary %d covers %.4f of answer tokens", drafter.config.draft_vocab, coverage)
    amp = amp_enabled(cfg.amp, device)
    log.info("training step in %s", "bf16 autocast" if amp else "fp32")
    val_items = data.load(data.val, soft=False) if data.val else []
    detach_head = cfg.detach_head and drafter.config.has_head
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    return Trainer(
        cfg=cfg,
        drafter=drafter,
        optimizer=torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay),
        data=data,
        val_seqs=[(ids.to(device), f, start) for ids, f, start, _, _ in val_items],
        vocab_map=vocab_map,
        gamma=default_gamma(drafter.config.block_size) if cfg.gamma is None else (cfg.gamma or None),
        amp=amp,
        detach_head=detach_head,
        clip_groups=clip_groups(drafter, detach_head),
        device=device,
        rng=random.Random(cfg.seed),
    )


def resume(t: Trainer, state: dict[str, Any]) -> None:
    """Continue where `state` left off: the optimizer, step, wall time, progress, best τ and RNG."""
    t.optimizer.load_state_dict(state["optimizer"])
    t.step, t.elapsed = state["step"], state.get("elapsed", 0.0)
    t.progress, t.best = state.get("progress", 0.0), state.get("best_val_tau", float("-inf"))
    t.rng.setstate(state["rng"])
    where = t.cfg.run_dir / STATE
    log.info("resumed from %s at step %d (progress %.3f, best validation τ %.3f)", where, t.step, t.progress, t.best)


def train_step(t: Trainer) -> tuple[list[float], float, float]:
    """One optimizer step at the current progress: its (loss, base, final, acc), λ and learning rate."""
    cfg, drafter = t.cfg, t.drafter
    lam = lambda_schedule(t.progress, cfg.base_loss_until) if drafter.config.has_head and not t.detach_head else 1.0
    lr = cfg.lr * lr_schedule(t.progress, cfg.warmup)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    picked = [t.data.train[t.rng.randrange(len(t.data.train))] for _ in range(cfg.batch_seqs)]
    batch = sample_batch(t.data.load(picked, soft=cfg.distill > 0), cfg.anchors, t.rng, t.device)
    with torch.autocast(torch.device(t.device).type, dtype=torch.bfloat16, enabled=t.amp):
        out = training_loss(drafter, batch, lam, t.vocab_map, t.gamma, cfg.distill, t.detach_head)
    t.optimizer.zero_grad(set_to_none=True)
    out["loss"].backward()
    for group in t.clip_groups:
        torch.nn.utils.clip_grad_norm_(group, cfg.clip)
    t.optimizer.step()
    return [out[k].item() for k in ("loss", "base", "final", "acc")], lam, lr


def validate(t: Trainer, logs: RunLogs) -> None:
    """The offline greedy walk on the validation samples; a τ better than any before overwrites `out`."""
    result = offline_walk(t.drafter, t.val_seqs, max_new_tokens=t.cfg.val_tokens)
    t.drafter.train()
    tau = float(result["tau"])  # type: ignore[arg-type]
    improved = tau > t.best
    if improved:
        t.best = tau
        save_drafter(t.drafter, t.cfg.out)
        record = {"step": t.step, "blocks": t.blocks, **result}
        (t.cfg.out / "train_val.json").write_text(json.dumps(record, indent=2) + "\n")
    logs.vals.writerow([t.step, t.blocks, f"{tau:.4f}", f"{t.elapsed:.1f}", int(improved)])
    log.info("step %d: validation τ %.3f (best %.3f) per slot %s", t.step, tau, t.best, result["tau_per_slot"])


def checkpoint(t: Trainer, logs: RunLogs) -> None:
    """state.pt (written beside, then renamed over the old one), `out` when nothing validates, loss.png."""
    logs.flush()
    run = t.cfg.run_dir
    tmp = (run / STATE).with_suffix(".tmp")
    payload = {
        "config": dict(vars(t.drafter.config)),
        "drafter": t.drafter.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "step": t.step,
        "rng": t.rng.getstate(),
        "elapsed": t.elapsed,
        "progress": t.progress,
        "best_val_tau": t.best,
    }
    torch.save(payload, tmp)
    os.replace(tmp, run / STATE)
    if not t.val_seqs:
        save_drafter(t.drafter, t.cfg.out)  # nothing to select on: the latest is the one
    plot_log(run / "log.csv", run / "loss.png", run / "val.csv")


def write_summary(t: Trainer) -> None:
    summary = {
        "steps": t.step,
        "blocks": t.blocks,
        "train_samples": len(t.data.train),
        "answer_tokens": sum(len(s["answer"]) for _, _, s in t.data.train),
        "best_val_tau": t.best,
        "wall_s": t.elapsed,
        "amp": "bf16" if t.amp else "off",
        "detach_head": t.detach_head,
    }
    (t.cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def clip_groups(drafter: Drafter, detach_head: bool) -> list[list[torch.nn.Parameter]]:
    """Parameters clipped apart: all of them, or, detached, the backbone and the head. Each part then
    keeps the step its own loss asks for (the backbone's is exactly a DFlash fit's)."""
    head = head_parameters(drafter) if detach_head else []
    head_ids = {id(p) for p in head}
    groups = [[p for p in drafter.parameters() if id(p) not in head_ids]]
    return [*groups, head] if head else groups


def build_drafter(
    spec: DrafterSpec,
    target: TargetModel,
    state: dict[str, Any] | None,
    data: TrainingData,
    init: Drafter | None = None,
) -> Drafter:
    """The drafter to train: resumed from `state`, else `init` (loaded from `spec.init_from` and
    changed as the spec asks), else new."""
    if state is not None:
        drafter = Drafter(DrafterConfig(**state["config"]))
        drafter.load_state_dict(state["drafter"])
        return drafter
    if init is not None:
        drafter = init
        if spec.block_size and spec.block_size != drafter.config.block_size:
            log.info("re-blocking %s from %d to %d", spec.init_from, drafter.config.block_size, spec.block_size)
            drafter.config.block_size = spec.block_size
        try:
            if spec.rank and spec.rank != drafter.config.emb_dim:
                log.info("widening %s's head from rank %d to %d", spec.init_from, drafter.config.emb_dim, spec.rank)
                widen_head(drafter, spec.rank)
            if spec.layers and spec.layers != drafter.config.num_hidden_layers:
                log.info("deepening %s to %d layers", spec.init_from, spec.layers)
                deepen(drafter, spec.layers)
            wanted = None if spec.draft_vocab == 0 else spec.draft_vocab  # 0: the full vocabulary
            if spec.draft_vocab is not None and wanted != drafter.config.draft_vocab_size:
                size = wanted or target.vocab_size
                old_size = drafter.config.draft_vocab_size
                log.info("widening %s's draft vocabulary from %s to %d", spec.init_from, old_size, size)
                widen_draft_vocab(drafter, data.answer_token_counts(target.vocab_size), size)
        except ValueError as e:  # a --rank, --layers or --draft-vocab below D's: one line, like fit's other data errors
            raise SystemExit(f"--init-from {spec.init_from}: {e}") from None
    else:
        draft_vocab = DEFAULT_DRAFT_VOCAB if spec.draft_vocab is None else spec.draft_vocab
        vocab_size = min(draft_vocab, target.vocab_size) if draft_vocab else None
        drafter = Drafter(make_drafter_config(spec, target, vocab_size))
        init_weights(drafter)
        if spec.warm_start:
            warm_start(drafter, target)
    if drafter.config.draft_vocab_size is not None and (spec.rebuild_vocab or init is None):
        rebuild_draft_vocab(drafter, data.answer_token_counts(target.vocab_size))
    return drafter


def amp_enabled(amp: str, device: str) -> bool:
    """Whether the training step runs under bf16 autocast. Where bf16 matmuls are native (AVX512-BF16
    or AMX CPUs, CUDA) they cost about half of fp32 ones; the fp32 weights, optimizer and the loss's
    log-softmax keep the update itself in fp32."""
    if amp == "auto":
        if device.startswith("cuda"):
            return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return cpu_has_native_bf16()
    return amp == "bf16"


def plot_log(log_path: Path, png: Path, val_path: Path | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(log_path.open()))
    if not rows:
        return
    steps = [int(r["step"]) for r in rows]
    smooth = max(1, len(rows) // 200)  # a point per ~0.5 % of training keeps long runs readable

    def series(key: str) -> tuple[list[int], list[float]]:
        values = [float(r[key]) for r in rows]
        xs = steps[smooth - 1 :: smooth]
        return xs, [sum(values[i * smooth : (i + 1) * smooth]) / smooth for i in range(len(xs))]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("loss", "loss_base", "loss_final"):
        ax1.plot(*series(key), label=key, linewidth=0.8)
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy")
    ax1.legend()
    ax2.plot(*series("lambda"), label="λ (base-loss weight)")
    ax2.plot(*series("acc"), label="draft top-1 accuracy (train)", linewidth=0.8)
    val = list(csv.DictReader(val_path.open())) if val_path and val_path.exists() else []
    if val:
        ax2.plot([int(r["step"]) for r in val], [float(r["val_tau"]) - 1 for r in val], "o-", label="validation τ − 1")
    ax2.set_xlabel("step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
