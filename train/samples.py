"""fit's samples: the sequences of one or more gen directories, with their target features stored
once (memory-mapped, train/features.py) or computed per batch (`online_features`). Validation is
the last `val_samples` samples of the first directory's first shard, never trained on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from model.nn.target import TargetModel
from train.config import DataConfig
from train.features import ShardFeatures, compute_features, features_root, shard_features_dir, store_features
from train.shards import read_shard, shard_paths

log = logging.getLogger("domino.train.fit")  # fit's own log: these lines are part of a fit run's

Item = tuple[int, int, dict[str, Any]]  # (shard index, row in the shard, sample)


class TrainingData:
    """Training and validation sequences with their stored features (memory-mapped) or none
    (online features). Validation = the last `val_samples` samples of the first directory's first
    shard, which must be stored before fit --stored-only starts."""

    def __init__(self, cfg: DataConfig, taps: list[int], target: TargetModel, target_name: str = "") -> None:
        # One or more gen directories; validation always comes from the first.
        self.paths: list[Path] = []
        self.roots: list[Path] = []  # the features root of each shard's directory
        for data_dir in cfg.dirs:
            paths = shard_paths(data_dir)
            if not paths:
                raise SystemExit(f"no gen shards (shard-*.jsonl.gz) in {data_dir}")
            root = features_root(data_dir, cfg.features_dir, several=len(cfg.dirs) > 1)
            self.paths += paths
            self.roots += [root] * len(paths)
            if not cfg.online_features and not cfg.stored_only:
                store_features(target, data_dir, root, taps, topk=cfg.topk, target_name=target_name)
        self.online = cfg.online_features
        self.stores: list[ShardFeatures | None] = [None] * len(self.paths)
        self.target = target
        self.taps = taps
        self.max_samples = cfg.max_samples
        self.train: list[Item] = []
        self.val: list[Item] = []
        self.val_samples = cfg.val_samples
        self.loaded: set[int] = set()
        self.refresh()
        if self.val_samples and not self.val:
            raise SystemExit(
                f"validation comes from {self.paths[0]}, whose features are not stored yet: store them first "
                "(`domino-train features --shards N`), so that no run validates on samples it trains on"
            )
        if not self.train:
            raise SystemExit(
                f"no training samples in {','.join(map(str, cfg.dirs))}"
                + (": no shard has stored features yet (run `domino-train features`)" if cfg.stored_only else "")
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

    def load(self, items: list[Item], soft: bool) -> list[tuple[Any, ...]]:
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
