"""What the target's and the drafter's per-slot KV caches share: buffers [slots, kv_heads, capacity,
head_dim] per layer plus each slot's committed length, and how a row moves between slots."""

from __future__ import annotations

import torch


def move_slot(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: torch.Tensor, src: int, dst: int) -> None:
    """Copy slot src's committed keys/values (every layer) and length into slot dst (compacting the
    batch when a row leaves)."""
    n = int(lengths[src])
    for k, v in zip(keys, values):
        k[dst, :, :n] = k[src, :, :n]
        v[dst, :, :n] = v[src, :, :n]
    lengths[dst] = lengths[src]
