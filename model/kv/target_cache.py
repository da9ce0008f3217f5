"""The target's KV cache: the KV room's paged storage (model/kv/paged.py) implementing transformers'
`Cache`, so that an HF decoder writes into it and attends over it.

Rows of a batch occupy consecutive slots `lo .. lo + R - 1`; each forward writes row r's T new
keys/values at that row's own offset. Rolling back rejected tokens is free: a row's length simply
isn't advanced past them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from model.kv.paged import PagedKV


@dataclass
class PackedGroup:
    """One padded group of rows in a packed forward: slots lo..hi-1, `width` tokens each, the
    group's tokens at [offset, offset + (hi - lo) * width) of the packed sequence (row-major),
    attending over `kv_len` keys under `mask` [R, 1, width, kv_len]."""

    lo: int
    hi: int
    width: int
    offset: int
    kv_len: int
    mask: torch.Tensor


class RaggedKVCache(PagedKV, Cache):
    """Every target layer's keys/values in block pools, rows in slots."""

    def __init__(
        self,
        num_layers: int,
        max_slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_blocks: int,
        block_size: int,
    ) -> None:
        Cache.__init__(self, layers=[])
        PagedKV.__init__(
            self, num_layers, max_slots, capacity, kv_heads, head_dim, dtype, device, num_blocks, block_size
        )
        # Set by `prepare` for one forward.
        self._lo = 0
        self._hi = 0
        self._kv_len = 0
        self._index: tuple[torch.Tensor, ...] = ()
        self.written: list[int] = []  # layer_idx of every `update` since the last `prepare`
        # A packed forward's groups (`prepare_packed`); empty for a padded one.
        self.packed: list[PackedGroup] = []

    def prepare(self, lo: int, start: torch.Tensor, num_new: int, span: int | None = None) -> None:
        """Route the next forward's writes: rows lo.., token t of row r goes to start[r] + t.

        span: attend over that many positions instead of the longest row's (the same shapes every
        step: what a CUDA graph needs). Either way nothing is read from the device."""
        r = start.shape[0]
        self._lo, self._hi = lo, lo + r
        self._kv_len = self.attended(lo, r, num_new, span)
        self._index = self.scatter_index(lo, start, num_new)
        self.written = []
        self.packed = []

    def prepare_packed(self, groups: list[PackedGroup], starts: list[torch.Tensor]) -> None:
        """Route a packed forward's writes: the groups' tokens one sequence [1, N], group g's row r
        token t written at starts[g][r] + t of slot lo + r. Attention then reads each group's keys
        itself (`view`, model/nn/attention.py), so `update` returns the new keys unchanged."""
        parts = [self.scatter_index(g.lo, start, g.width) for g, start in zip(groups, starts)]
        # Each index is (blocks [R, 1, T], offsets [R, 1, T], heads [1, KV, 1]): flattened row-major
        # like the tokens, [1, 1, R*T] per group, concatenated.
        blocks = torch.cat([b.reshape(1, 1, -1) for b, _, _ in parts], dim=2)
        offsets = torch.cat([o.reshape(1, 1, -1) for _, o, _ in parts], dim=2)
        self._index = (blocks, offsets, parts[0][2])
        self._lo = self._hi = self._kv_len = 0
        self.written = []
        self.packed = groups

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.written.append(layer_idx)
        self.write(layer_idx, self._index, key_states, value_states)
        if self.packed:
            return key_states, value_states
        return self.view(layer_idx, self._lo, self._hi, self._kv_len)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len


def check_cache_written(cache: RaggedKVCache, num_layers: int) -> None:
    """Every decoder layer wrote its keys/values into our cache exactly once in this forward."""
    if sorted(cache.written) != list(range(num_layers)):
        raise RuntimeError(
            f"the decoder wrote the KV cache for layers {sorted(cache.written)}, expected each of 0..{num_layers - 1} "
            "once: was the cache passed under the argument name this transformers takes?"
        )
