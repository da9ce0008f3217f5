"""`domino-train fit`: train a drafter on regenerated answers, from stored target features.

Resumable: the run directory keeps `state.pt` (weights, optimizer, step, RNG, elapsed time, best
validation τ), `log.csv` (per step), `val.csv` (per evaluation) and `loss.png`. Schedules (warm-up,
cosine, λ) are functions of the progress saved in the state, so a resumed run continues them.
Every `--eval-every` steps the greedy acceptance walk is replayed offline on a validation slice of
the data (never trained on) and `--out` is overwritten only when τ improves: `--out` always holds
the best checkpoint so far.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from model.checkpoint import load_drafter, save_drafter
from model.drafter import Drafter, DrafterConfig, head_parameters
from model.loading import cpu_has_native_bf16, load_target, resolve_device
from model.target import TargetModel
from train.evaluate import offline_walk
from train.features import ShardFeatures, compute_features, default_features_root, shard_features_dir, store_features
from train.init import (
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
from train.shards import read_shard, shard_paths

log = logging.getLogger("domino.train.fit")

LOG_COLUMNS = ["step", "loss", "loss_base", "loss_final", "acc", "lambda", "lr", "elapsed_s"]
VAL_COLUMNS = ["step", "blocks", "val_tau", "elapsed_s", "best"]


def features_root(data_dir: Path, features_dir: str | None, several: bool) -> Path:
    """Where a gen directory's stored features live: `--features-dir` itself for a single data
    directory, else one folder per data directory name under it (default: the user cache)."""
    if features_dir and not several:
        return Path(features_dir)
    return (Path(features_dir) if features_dir else default_features_root()) / data_dir.name


class TrainingData:
    """Training and validation sequences with their stored features (memory-mapped) or none
    (online features). Validation = the last `val_samples` samples of the first directory's first
    shard, which must be stored before fit --stored-only starts."""

    def __init__(self, args: argparse.Namespace, taps: list[int], target: TargetModel) -> None:
        # One or more gen directories (comma-separated); validation always comes from the first.
        data_dirs = [Path(d) for d in str(args.data).split(",") if d]
        self.paths: list[Path] = []
        self.roots: list[Path] = []  # the features root of each shard's directory
        for data_dir in data_dirs:
            paths = shard_paths(data_dir)
            if not paths:
                raise SystemExit(f"no gen shards (shard-*.jsonl.gz) in {data_dir}")
            root = features_root(data_dir, args.features_dir, several=len(data_dirs) > 1)
            self.paths += paths
            self.roots += [root] * len(paths)
            if not args.online_features and not args.stored_only:
                store_features(target, data_dir, root, taps, topk=args.topk, target_name=args.target)
        self.online = bool(args.online_features)
        self.stores: list[ShardFeatures | None] = [None] * len(self.paths)
        self.target = target
        self.taps = taps
        self.max_samples = args.max_samples
        self.train: list[tuple[int, int, dict[str, Any]]] = []  # (shard, row, sample)
        self.val: list[tuple[int, int, dict[str, Any]]] = []
        self.val_samples = args.val_samples
        self.loaded: set[int] = set()
        self.refresh()
        if self.val_samples and not self.val:
            raise SystemExit(
                f"validation comes from {self.paths[0]}, whose features are not stored yet: store them first "
                "(`domino-train features --shards N`), so that no run validates on samples it trains on"
            )
        if not self.train:
            raise SystemExit(
                f"no training samples in {args.data}"
                + (": no shard has stored features yet (run `domino-train features`)" if args.stored_only else "")
            )

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """Answer-token frequencies [V] over every gen shard, stored features or not (the draft
        vocabulary should not depend on which shards were stored first); validation excluded."""
        if self.max_samples:  # a capped run sees only its own samples
            tokens = [t for _, _, s in self.train for t in s["answer"]]
        else:
            held_out = {(k, row) for k, row, _ in self.val}
            tokens = [
                t
                for k, path in enumerate(self.paths)
                for row, s in enumerate(read_shard(path))
                if (k, row) not in held_out
                for t in s["answer"]
            ]
        return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab_size)

    def refresh(self) -> int:
        """Add the shards whose features have been stored since the last call (a `features` job may
        still be running beside fit --stored-only); returns the number of samples added."""
        added = 0
        for k, path in enumerate(self.paths):
            if k in self.loaded:
                continue
            if not self.online:
                directory = shard_features_dir(self.roots[k], path, self.taps)
                if not (directory / "meta.json").exists():
                    continue
                self.stores[k] = ShardFeatures.open(directory)
            items = [(k, row, s) for row, s in enumerate(read_shard(path))]
            if self.max_samples:
                items = items[: max(0, self.max_samples - len(self.train) - len(self.val))]
            if k == 0 and self.val_samples:
                # Validation = the last samples of the first directory's first shard, whatever
                # order shards are stored in: checkpoints are picked on samples no run trains on.
                self.val, items = items[-self.val_samples :], items[: -self.val_samples]
            self.train.extend(items)
            self.loaded.add(k)
            added += len(items)
        if added:
            log.info(
                "%d training samples (%d answer tokens) from %d shards, %d validation samples",
                len(self.train),
                sum(len(s["answer"]) for _, _, s in self.train),
                len({k for k, _, _ in self.train}),
                len(self.val),
            )
        return added

    def load(self, items: list[tuple[int, int, dict[str, Any]]], soft: bool) -> list[tuple[Any, ...]]:
        """(ids, features, answer start, top-k ids, top-k log-probs) per item."""
        ids = [s["prompt"] + s["answer"] for _, _, s in items]
        out = []
        if any(self.stores[k] is None for k, _, _ in items):
            feats = compute_features(self.target, ids, self.taps, progress=False)
            return [(torch.tensor(i), f, len(s["prompt"]), None, None) for i, f, (_, _, s) in zip(ids, feats, items)]
        for seq, (k, row, s) in zip(ids, items):
            f, top_ids, top_logp = self.stores[k].sequence(row)  # type: ignore[union-attr]
            out.append((torch.tensor(seq), f, len(s["prompt"]), top_ids if soft else None, top_logp if soft else None))
        return out


def build_drafter(
    args: argparse.Namespace,
    target: TargetModel,
    state: dict[str, Any] | None,
    data: TrainingData,
    init: Drafter | None = None,
) -> Drafter:
    """The drafter to train: resumed from `state`, else `init` (loaded from --init-from), else new."""
    if state is not None:
        drafter = Drafter(DrafterConfig(**state["config"]))
        drafter.load_state_dict(state["drafter"])
        return drafter
    if init is not None:
        drafter = init
        if args.block_size and args.block_size != drafter.config.block_size:
            log.info("re-blocking %s from %d to %d", args.init_from, drafter.config.block_size, args.block_size)
            drafter.config.block_size = args.block_size
        try:
            if args.rank and args.rank != drafter.config.emb_dim:
                log.info("widening %s's head from rank %d to %d", args.init_from, drafter.config.emb_dim, args.rank)
                widen_head(drafter, args.rank)
            if args.layers and args.layers != drafter.config.num_hidden_layers:
                log.info("deepening %s to %d layers", args.init_from, args.layers)
                deepen(drafter, args.layers)
            wanted = None if args.draft_vocab == 0 else args.draft_vocab  # 0: the full vocabulary
            if args.draft_vocab is not None and wanted != drafter.config.draft_vocab_size:
                size = wanted or target.vocab_size
                old_size = drafter.config.draft_vocab_size
                log.info("widening %s's draft vocabulary from %s to %d", args.init_from, old_size, size)
                widen_draft_vocab(drafter, data.answer_token_counts(target.vocab_size), size)
        except ValueError as e:  # a --rank, --layers or --draft-vocab below D's: one line, like fit's other data errors
            raise SystemExit(f"--init-from {args.init_from}: {e}") from None
    else:
        draft_vocab = 8192 if args.draft_vocab is None else args.draft_vocab
        vocab_size = min(draft_vocab, target.vocab_size) if draft_vocab else None
        drafter = Drafter(make_drafter_config(args, target, vocab_size))
        init_weights(drafter)
        if args.warm_start:
            warm_start(drafter, target)
    if drafter.config.draft_vocab_size is not None and (args.rebuild_vocab or init is None):
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


def fit(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32 for the drafter's fp32 training matmuls
    model, _tok = load_target(args.target, torch.float32, device)
    model.requires_grad_(False)
    target = TargetModel(model)

    state_path = run / "state.pt"
    state = torch.load(state_path, weights_only=False) if state_path.exists() and not args.restart else None
    init = None
    if state is None and args.init_from:
        init = load_drafter(args.init_from, dtype=torch.float32, target_config=model.config)
    if state is not None:
        taps = state["config"]["target_layer_ids"]
    elif init is not None:
        taps = init.config.target_layer_ids
    else:
        taps = make_drafter_config(args, target, None).target_layer_ids
    data = TrainingData(args, list(taps), target)
    drafter = build_drafter(args, target, state, data, init)
    cfg = drafter.config
    drafter.to(device)
    drafter.bind_target(target.embed_tokens.weight.detach(), target.lm_head.weight.detach())
    vocab_map = draft_vocab_map(drafter, target.vocab_size)
    if vocab_map is not None:
        answers = torch.tensor([t for _, _, s in data.train for t in s["answer"]])
        log.info(
            "draft vocabulary %d covers %.4f of answer tokens",
            cfg.draft_vocab,
            float((vocab_map[answers] >= 0).float().mean()),
        )
    gamma = default_gamma(cfg.block_size) if args.gamma is None else (args.gamma or None)
    amp = amp_enabled(args.amp, device)
    log.info("training step in %s", "bf16 autocast" if amp else "fp32")
    val_items = data.load(data.val, soft=False) if data.val else []
    val_seqs = [(ids.to(device), f, start) for ids, f, start, _, _ in val_items]

    optimizer = torch.optim.AdamW(
        [p for p in drafter.parameters() if p.requires_grad], lr=args.lr, weight_decay=args.weight_decay
    )
    detach_head = args.detach_head and cfg.has_head
    # Gradients are clipped per part that has its own loss: detached, the backbone's step is then
    # the one a DFlash fit would take, whatever the head's gradient norm.
    head = head_parameters(drafter) if detach_head else []
    head_ids = {id(p) for p in head}
    clip_groups = [[p for p in drafter.parameters() if id(p) not in head_ids]]
    if head:
        clip_groups.append(head)
    step, elapsed, progress, best = 0, 0.0, 0.0, float("-inf")
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed = state["step"], state.get("elapsed", 0.0)
        progress, best = state.get("progress", 0.0), state.get("best_val_tau", float("-inf"))
        rng.setstate(state["rng"])
        log.info("resumed from %s at step %d (progress %.3f, best validation τ %.3f)", state_path, step, progress, best)
    log_writer, val_writer, files = _open_logs(run, resume=state is not None)
    drafter.train()
    t0 = time.perf_counter() - elapsed
    blocks_per_step = args.batch_seqs * args.anchors
    bar = tqdm(total=None if args.time_budget_s else args.steps, initial=step, desc="fit", unit="step", mininterval=10)
    stop_at = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)

    def save() -> None:
        for f in files:
            f.flush()
        tmp = state_path.with_suffix(".tmp")
        payload = {
            "config": {k: v for k, v in vars(cfg).items()},
            "drafter": drafter.state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "rng": rng.getstate(),
            "elapsed": elapsed,
            "progress": progress,
            "best_val_tau": best,
        }
        torch.save(payload, tmp)
        os.replace(tmp, state_path)
        if not val_seqs:
            save_drafter(drafter, args.out)  # nothing to select on: the latest is the one
        plot_log(run / "log.csv", run / "loss.png", run / "val.csv")

    def validate() -> None:
        nonlocal best
        result = offline_walk(drafter, val_seqs, max_new_tokens=args.val_tokens)
        drafter.train()
        tau = float(result["tau"])  # type: ignore[arg-type]
        improved = tau > best
        if improved:
            best = tau
            save_drafter(drafter, args.out)
            (Path(args.out) / "train_val.json").write_text(
                json.dumps({"step": step, "blocks": step * blocks_per_step, **result}, indent=2) + "\n"
            )
        val_writer.writerow([step, step * blocks_per_step, f"{tau:.4f}", f"{elapsed:.1f}", int(improved)])
        log.info("step %d: validation τ %.3f (best %.3f) per slot %s", step, tau, best, result["tau_per_slot"])

    while step < stop_at:
        # Progress never goes back: a resumed or extended run continues its warm-up, λ and cosine.
        progress = max(progress, training_progress(step, args.steps, elapsed, args.time_budget_s))
        if progress >= 1.0:
            break
        lam = lambda_schedule(progress, args.base_loss_until) if cfg.has_head and not detach_head else 1.0
        lr = args.lr * lr_schedule(progress, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if args.stored_only and step % 500 == 0:
            data.refresh()
        picked = [data.train[rng.randrange(len(data.train))] for _ in range(args.batch_seqs)]
        batch = sample_batch(data.load(picked, soft=args.distill > 0), args.anchors, rng, device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp):
            out = training_loss(drafter, batch, lam, vocab_map, gamma, args.distill, detach_head)
        optimizer.zero_grad(set_to_none=True)
        out["loss"].backward()
        for group in clip_groups:
            torch.nn.utils.clip_grad_norm_(group, args.clip)
        optimizer.step()
        step += 1
        elapsed = time.perf_counter() - t0
        values = [out[k].item() for k in ("loss", "base", "final", "acc")]
        log_writer.writerow([step, *(f"{v:.4f}" for v in values), f"{lam:.4f}", f"{lr:.3e}", f"{elapsed:.1f}"])
        bar.update(1)
        if val_seqs and step % args.eval_every == 0:
            validate()
        if step % args.save_every == 0:
            save()
    if val_seqs and (step % args.eval_every != 0 or step == 0):
        validate()  # every run ends validated, so --out always holds its best checkpoint
    save()
    bar.close()
    for f in files:
        f.close()
    (run / "summary.json").write_text(
        json.dumps(
            {
                "steps": step,
                "blocks": step * blocks_per_step,
                "train_samples": len(data.train),
                "answer_tokens": sum(len(s["answer"]) for _, _, s in data.train),
                "best_val_tau": best,
                "wall_s": elapsed,
                "amp": "bf16" if amp else "off",
                "detach_head": detach_head,
            },
            indent=2,
        )
    )


def _open_logs(run: Path, resume: bool) -> tuple[Any, Any, list[Any]]:
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
    return writers[0], writers[1], files


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
