"""Target features stored once per data shard, so `fit` spends its time on the drafter only.

For every gen shard `shard-XXXXX.jsonl.gz` and a tap set, one directory (written under a temporary
name, then renamed, so a half-written shard is never read) holds memory-mappable numpy arrays:

    features.npy   [P, K*H] fp16   concatenated tap hidden states of every position of every sequence
    offsets.npy    [S + 1]  int64  sequence s occupies rows offsets[s] .. offsets[s+1]-1
    topk_ids.npy   [P, k]   int32  the target's k most likely next tokens after each position
    topk_logp.npy  [P, k]   fp16   their log-probabilities (full-vocabulary softmax)
    meta.json               taps, k, sizes, target name

P = sum of sequence lengths (prompt + answer). The cache lives outside the repository
(`~/.cache/domino-serve/features/<data dir name>/` by default) and is never committed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from model.load.wheels import default_cache_dir
from model.nn.target import TargetModel
from train.shards import read_shard, shard_path, shard_paths

log = logging.getLogger("domino.train.features")


class DiskSpaceError(RuntimeError):
    """Not enough free disk for the stored features."""


def default_features_root() -> Path:
    return default_cache_dir() / "features"


def features_root(data_dir: Path, features_dir: str | None, several: bool) -> Path:
    """Where a gen directory's stored features live: `--features-dir` itself for a single data
    directory, else one folder per data directory name under it (default: the user cache)."""
    if features_dir and not several:
        return Path(features_dir)
    return (Path(features_dir) if features_dir else default_features_root()) / data_dir.name


def shard_features_dir(root: Path, shard: Path, taps: list[int]) -> Path:
    return root / (shard.name.removesuffix(".jsonl.gz") + ".taps-" + "-".join(map(str, taps)))


def bytes_needed(num_positions: int, feature_width: int, topk: int) -> int:
    return num_positions * (feature_width * 2 + topk * (4 + 2)) + 8 * num_positions // 100


def check_disk(root: Path, needed: int) -> None:
    """Fail before computing anything when the features would not fit (with a 1 GB margin)."""
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if needed + (1 << 30) > free:
        raise DiskSpaceError(
            f"stored features need {needed / 1e9:.1f} GB under {root}, only {free / 1e9:.1f} GB free; "
            "free space, point --features-dir elsewhere, or train with --online-features"
        )
    log.info("features need %.1f GB under %s (%.1f GB free)", needed / 1e9, root, free / 1e9)


def length_sorted_batches(lengths: list[int], batch_tokens: int) -> Iterator[list[int]]:
    """Sequence indices in ascending length, grouped so that rows × the longest length stays within
    `batch_tokens` (a sequence longer than that is a batch of its own)."""
    batch: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batch and (len(batch) + 1) * lengths[i] > batch_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


@torch.inference_mode()
def _forward_batch(
    target: TargetModel, seqs: list[list[int]], taps: list[int], topk: int, first: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Taps [R, N, K*H], top-k ids and log-probs [R, N, k] of right-padded sequences; the top-k
    is computed only from position first[r] on (answer positions: the only ones a block predicts
    from) and left at id 0 / -inf before it.

    Right padding needs no mask: causal attention never looks at later (padded) positions."""
    hf = target.hf_model
    n = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long, device=target.device)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.tensor(s)
    out = hf.model(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[t + 1] for t in taps], dim=-1)
    top_ids = torch.zeros(len(seqs), n, topk, dtype=torch.long, device=target.device)
    top_logp = torch.full((len(seqs), n, topk), float("-inf"), device=target.device)
    for row, s in enumerate(seqs):
        logits = hf.lm_head(out.last_hidden_state[row, first[row] : len(s)])
        values, top_ids[row, first[row] : len(s)] = logits.topk(topk, dim=-1)
        # logsumexp in the model's dtype: ~0.05 nats off in bf16, 5x cheaper than an fp32 copy.
        top_logp[row, first[row] : len(s)] = values.float() - torch.logsumexp(logits, dim=-1, keepdim=True).float()
    return feats, top_ids, top_logp


def store_shard(
    target: TargetModel,
    sequences: list[list[int]],
    topk_from: list[int],
    out_dir: Path,
    taps: list[int],
    topk: int = 16,
    batch_tokens: int = 4096,
    target_name: str = "",
) -> None:
    """Compute and write one shard's features (see the module docstring); no-op if already there.
    The top-k of sequence s is stored from position topk_from[s] on."""
    if (out_dir / "meta.json").exists():
        return
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lengths = np.array([len(s) for s in sequences], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total, width = int(offsets[-1]), len(taps) * target.hidden_size
    feats = np.lib.format.open_memmap(tmp / "features.npy", mode="w+", dtype=np.float16, shape=(total, width))
    top_ids = np.lib.format.open_memmap(tmp / "topk_ids.npy", mode="w+", dtype=np.int32, shape=(total, topk))
    top_logp = np.lib.format.open_memmap(tmp / "topk_logp.npy", mode="w+", dtype=np.float16, shape=(total, topk))
    bar = tqdm(total=len(sequences), desc=f"features {out_dir.name}", unit="seq", mininterval=30)
    for batch in length_sorted_batches([len(seq) for seq in sequences], batch_tokens):
        f, ti, tl = _forward_batch(target, [sequences[i] for i in batch], taps, topk, [topk_from[i] for i in batch])
        for row, i in enumerate(batch):
            lo, hi = offsets[i], offsets[i + 1]
            feats[lo:hi] = f[row, : hi - lo].to(torch.float16).cpu().numpy()
            top_ids[lo:hi] = ti[row, : hi - lo].to(torch.int32).cpu().numpy()
            top_logp[lo:hi] = tl[row, : hi - lo].to(torch.float16).cpu().numpy()
        bar.update(len(batch))
    bar.close()
    for arr in (feats, top_ids, top_logp):
        arr.flush()
    np.save(tmp / "offsets.npy", offsets)
    meta = {"taps": taps, "topk": topk, "sequences": len(sequences), "positions": total, "width": width}
    (tmp / "meta.json").write_text(json.dumps({**meta, "target": target_name}, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


@dataclass
class ShardFeatures:
    """Read-only memory-mapped view of one stored shard."""

    features: np.ndarray  # [P, K*H] fp16
    offsets: np.ndarray  # [S + 1]
    topk_ids: np.ndarray  # [P, k]
    topk_logp: np.ndarray  # [P, k]

    @classmethod
    def open(cls, directory: Path) -> ShardFeatures:
        def load(name: str) -> np.ndarray:
            return np.load(directory / name, mmap_mode="r")

        return cls(load("features.npy"), load("offsets.npy"), load("topk_ids.npy"), load("topk_logp.npy"))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sequence(self, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Features [N, K*H] (fp16), top-k ids [N, k] and log-probs [N, k] of sequence s (copies)."""
        lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
        return (
            torch.from_numpy(np.array(self.features[lo:hi])),
            torch.from_numpy(np.array(self.topk_ids[lo:hi])),
            torch.from_numpy(np.array(self.topk_logp[lo:hi])),
        )


def store_features(
    target: TargetModel,
    data_dir: Path,
    root: Path,
    taps: list[int],
    topk: int = 16,
    shards: list[int] | None = None,
    target_name: str = "",
) -> list[Path]:
    """Store the features of every gen shard in `data_dir` (or the listed shard numbers) under
    `root`; shards already stored are skipped, so an interrupted run resumes. Checks free disk first."""
    if shards is None:
        paths = shard_paths(data_dir)
    else:
        # Shard numbers, not positions in the listing: gen can leave gaps (shards 0-25, then 60).
        paths = [shard_path(data_dir, i) for i in shards]
        missing = [p.name for p in paths if not p.exists()]
        if missing:
            raise FileNotFoundError(f"no such gen shard in {data_dir}: {', '.join(missing)}")
    todo = [(p, read_shard(p)) for p in paths if not (shard_features_dir(root, p, taps) / "meta.json").exists()]
    positions = sum(len(s["prompt"]) + len(s["answer"]) for _, samples in todo for s in samples)
    check_disk(root, bytes_needed(positions, len(taps) * target.hidden_size, topk))
    for path, samples in todo:
        sequences = [s["prompt"] + s["answer"] for s in samples]
        # A block's first label follows the anchor x_a with a >= prompt_len - 1 (see train.batches).
        topk_from = [max(0, len(s["prompt"]) - 1) for s in samples]
        store_shard(
            target, sequences, topk_from, shard_features_dir(root, path, taps), taps, topk, target_name=target_name
        )
        log.info("stored %s", shard_features_dir(root, path, taps))
    return [shard_features_dir(root, p, taps) for p in paths]


@torch.inference_mode()
def compute_features(
    target: TargetModel,
    sequences: list[list[int]],
    taps: list[int],
    batch_tokens: int = 4096,
    out_device: torch.device | str = "cpu",
    progress: bool = True,
    dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    """Concatenated tap hidden states [N, K*H] (`dtype`, on `out_device`) of each full sequence, by
    length-sorted batches, kept in memory (fit --online-features computes them per batch)."""
    feats: list[torch.Tensor | None] = [None] * len(sequences)
    bar = tqdm(total=len(sequences), desc="features", unit="seq", disable=not progress)
    for batch in length_sorted_batches([len(seq) for seq in sequences], batch_tokens):
        out, _, _ = _forward_batch(target, [sequences[i] for i in batch], taps, 1, [len(sequences[i]) for i in batch])
        for row, i in enumerate(batch):
            feats[i] = out[row, : len(sequences[i])].to(device=out_device, dtype=dtype)
        bar.update(len(batch))
    bar.close()
    return feats  # type: ignore[return-value]
