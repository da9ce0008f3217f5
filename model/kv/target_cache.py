"""The target's KV cache: per-slot buffers [slots, kv_heads, capacity, head_dim] for every layer,
implementing transformers' `Cache` so that an HF decoder writes into it and attends over it.

Rows of a batch occupy consecutive slots `lo .. lo + R - 1`; each forward writes row r's T new
keys/values at that row's own offset. Rolling back rejected tokens is free: a row's length simply
isn't advanced past them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from model.kv.slots import move_slot, slot_buffers


class RaggedKVCache(Cache):
    """Per-slot KV buffers [slots, kv_heads, capacity, head_dim] for every target layer."""

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
        super().__init__(layers=[])
        self.keys, self.values, self.lengths = slot_buffers(
            num_layers, max_slots, capacity, kv_heads, head_dim, dtype, device
        )
        self.capacity = capacity
        # Set by `prepare` for one forward.
        self._lo = 0
        self._hi = 0
        self._kv_len = 0
        self._index: tuple[torch.Tensor, ...] = ()
        self.written: list[int] = []  # layer_idx of every `update` since the last `prepare`

    def prepare(self, lo: int, start: torch.Tensor, num_new: int, static: bool = False) -> None:
        """Route the next forward's writes: rows lo.., token t of row r goes to start[r] + t.

        static: attend over the whole capacity instead of the longest row (no device->host read of
        the lengths, the same shapes every step: what a CUDA graph needs). Positions past the end
        (padding of a row near its limit) are clamped onto the last slot, never a committed one."""
        r = start.shape[0]
        dev = start.device
        kv_heads = self.keys[0].shape[1]
        self._lo, self._hi = lo, lo + r
        self._kv_len = self.capacity if static else int(start.max()) + num_new
        rows = torch.arange(lo, lo + r, device=dev)[:, None, None]
        heads = torch.arange(kv_heads, device=dev)[None, :, None]
        pos = (start[:, None] + torch.arange(num_new, device=dev)[None, :])[:, None, :]
        if static:
            pos = pos.clamp_max(self.capacity - 1)
        self._index = (rows, heads, pos)
        self.written = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.written.append(layer_idx)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_put_(self._index, key_states.to(k.dtype))
        v.index_put_(self._index, value_states.to(v.dtype))
        return k[self._lo : self._hi, :, : self._kv_len], v[self._lo : self._hi, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    def move_row(self, src: int, dst: int) -> None:
        """Copy one row's context into another slot (used when compacting the batch)."""
        move_slot(self.keys, self.values, self.lengths, src, dst)


def check_cache_written(cache: RaggedKVCache, num_layers: int) -> None:
    """Every decoder layer wrote its keys/values into our cache exactly once in this forward."""
    if sorted(cache.written) != list(range(num_layers)):
        raise RuntimeError(
            f"the decoder wrote the KV cache for layers {sorted(cache.written)}, expected each of 0..{num_layers - 1} "
            "once: was the cache passed under the argument name this transformers takes?"
        )
