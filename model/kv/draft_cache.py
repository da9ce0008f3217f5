"""The drafter's context cache: per-row context keys/values of every drafter layer, in
preallocated buffers [slots, kv_heads, capacity, head_dim]."""

from __future__ import annotations

import torch

from model.kv.slots import move_slot, slot_buffers


class DraftContextCache:
    """Per-row context keys/values of every drafter layer, in preallocated buffers.

    Rows live in slots; a row's context length is `lengths[slot]`. A block's own keys/values are
    written after a row's context as scratch and never counted, so rolling back is free.
    """

    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.keys, self.values, self.lengths = slot_buffers(
            num_layers, max_slots, capacity, kv_heads, head_dim, dtype, device
        )
        self.capacity = capacity

    def write(self, layer: int, lo: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [R, kv, T, hd] for slots lo..lo+R-1 at positions start[r] + t."""
        r, kv, t, _ = k.shape
        dev = k.device
        rows = torch.arange(lo, lo + r, device=dev)[:, None, None]
        heads = torch.arange(kv, device=dev)[None, :, None]
        # Clamped: a padding row of a static-shape step may sit near the end (never counted).
        pos = (start[:, None] + torch.arange(t, device=dev)[None, :]).clamp_max(self.capacity - 1)[:, None, :]
        self.keys[layer].index_put_((rows, heads, pos), k)
        self.values[layer].index_put_((rows, heads, pos), v)

    def move_row(self, src: int, dst: int) -> None:
        """Copy one row's context into another slot (used when compacting the batch)."""
        move_slot(self.keys, self.values, self.lengths, src, dst)
