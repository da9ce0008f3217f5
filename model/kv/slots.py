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


def slot_buffers(
    num_layers: int,
    max_slots: int,
    capacity: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Zeroed keys and values [max_slots, kv_heads, capacity, head_dim] per layer, and each slot's
    committed length: the storage both the target's and the drafter's caches are made of."""
    shape = (max_slots, kv_heads, capacity, head_dim)
    keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return keys, values, torch.zeros(max_slots, dtype=torch.long, device=device)
