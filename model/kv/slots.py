"""The KV room's one interface, which the target's cache (target_cache.py) and the drafter's context
cache (draft_cache.py) both implement: key/value buffers [slots, kv_heads, capacity, head_dim] per
layer, and each slot's committed length twice, on the device (what forwards and captured graphs
read) and on the host (what sizes a forward and moves a row, so neither reads the device).

The engine keeps the two in step through `set_lengths` (prefill, prefix-cache hits, rollback) and
`advance` (a decode step, with the counts its one device->host copy already brought back). The
prefix cache and tests reach a row's keys and values through `row_kv` / `put_row_kv`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SlotKV:
    """Per-slot keys/values of every layer, with device lengths and their host mirror."""

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
        shape = (max_slots, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * max_slots
        self.capacity = capacity

    @property
    def num_slots(self) -> int:
        return len(self.host_lengths)

    @property
    def nbytes(self) -> int:
        """Bytes the key and value buffers hold."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take over all layers."""
        return self.nbytes // (self.num_slots * self.capacity)

    # -- lengths ----------------------------------------------------------------------------------

    def set_lengths(self, lo: int, lengths: Sequence[int]) -> None:
        """Slots lo.. now hold these committed lengths (one host->device copy)."""
        n = len(lengths)
        self.host_lengths[lo : lo + n] = list(lengths)
        self.lengths[lo : lo + n] = torch.tensor(lengths, dtype=torch.long, device=self.lengths.device)

    def advance(self, lo: int, counts: torch.Tensor, host_counts: Sequence[int]) -> None:
        """Slots lo.. grow by `counts` [R] on the device and by the same `host_counts` on the host
        (the caller has them already: no device read here)."""
        self.lengths[lo : lo + len(host_counts)] += counts
        for i, c in enumerate(host_counts):
            self.host_lengths[lo + i] += c

    def view(self, layer: int, lo: int, hi: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a forward over slots lo..hi-1 attends over in one layer: the first `kv_len`
        positions of their keys and values (views)."""
        return self.keys[layer][lo:hi, :, :kv_len], self.values[layer][lo:hi, :, :kv_len]

    def starts(self, lo: int, r: int) -> torch.Tensor:
        """Where rows lo..lo+r-1 write their next tokens: their device lengths [r] (a view)."""
        return self.lengths[lo : lo + r]

    def attended(self, lo: int, r: int, num_new: int, span: int | None = None) -> int:
        """Keys a forward of `num_new` tokens per row over rows lo..lo+r-1 attends over: the longest
        row's length plus `num_new`, from the host mirror; a static-shape forward attends over a
        fixed `span` (the same shapes every step, nothing for a CUDA graph to read)."""
        return span if span is not None else max(self.host_lengths[lo : lo + r]) + num_new

    def vacate(self, first: int) -> None:
        """Slots first.. hold no row: their lengths become 0 (a static step's padding rows write at
        position 0 of their own slots, never at a stale length; one device write, where any changed)."""
        if any(self.host_lengths[first:]):
            self.set_lengths(first, [0] * (self.num_slots - first))

    # -- rows -------------------------------------------------------------------------------------

    def scatter_index(self, lo: int, start: torch.Tensor, num_new: int) -> tuple[torch.Tensor, ...]:
        """The index_put_ index of token t of row r (slot lo + r) at start[r] + t. Positions past the
        end (a padding row of a static-shape step near its limit) are clamped onto the last position,
        never a committed one."""
        r, dev = start.shape[0], start.device
        rows = torch.arange(lo, lo + r, device=dev)[:, None, None]
        heads = torch.arange(self.keys[0].shape[1], device=dev)[None, :, None]
        pos = (start[:, None] + torch.arange(num_new, device=dev)[None, :]).clamp_max(self.capacity - 1)
        return rows, heads, pos[:, None, :]

    def write(self, layer: int, index: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [R, kv_heads, T, head_dim] of one layer at `index` (`scatter_index`), cast to
        the cache's dtype."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_put_(index, k.to(keys.dtype))
        values.index_put_(index, v.to(values.dtype))

    def move_row(self, src: int, dst: int) -> None:
        """Copy slot src's committed keys/values (every layer) and length into slot dst (compacting
        the batch when a row leaves); the length comes from the host mirror."""
        n = self.host_lengths[src]
        for k, v in zip(self.keys, self.values):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        self.lengths[dst] = self.lengths[src]
        self.host_lengths[dst] = n

    def row_kv(self, slot: int, begin: int, end: int) -> torch.Tensor:
        """Positions begin..end-1 of one slot, every layer: [layers, 2 (keys, values), kv_heads,
        end - begin, head_dim]."""
        return torch.stack([torch.stack([k[slot, :, begin:end], v[slot, :, begin:end]]) for k, v in self.layer_kv()])

    def put_row_kv(self, slot: int, begin: int, kv: torch.Tensor) -> None:
        """Write `row_kv`'s layout [layers, 2, kv_heads, n, head_dim] at positions begin.. of a slot
        (lengths unchanged: the caller sets them)."""
        n = kv.shape[3]
        for layer, (k, v) in enumerate(self.layer_kv()):
            k[slot, :, begin : begin + n] = kv[layer, 0]
            v[slot, :, begin : begin + n] = kv[layer, 1]

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's whole key and value buffers [slots, kv_heads, capacity, head_dim]."""
        return list(zip(self.keys, self.values))
