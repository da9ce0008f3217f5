"""The KV room's one storage, which the target's cache (target_cache.py) and the drafter's context
cache (draft_cache.py) both are: per layer one pool of fixed-size blocks `[num_blocks + 1,
block_size, kv_heads, head_dim]`, allocated once and written in place; per slot (row i of the batch
lives in slot i) a block table; and each slot's committed length twice, on the device (what forwards
and captured graphs read) and on the host (what sizes a forward and moves a row, so neither reads
the device).

Slot s's position p lives in block `tables[s, p // block_size]` at offset `p % block_size`. The
tables are the scheduler's (model/kv/blocks.py: `BlockTables`), copied in with `set_table` when they
change; entries a row does not own point at the last block, a trash block no row owns, so the
padding a prefill group writes past a short row, a static step's padding rows, and the tail a gather
reads past a row never touch another row's blocks. Compaction moves table rows: no key or value is
copied. The engine keeps the lengths in step through `set_lengths` (prefill, rollback) and `advance`
(a decode step, with the counts its one device->host copy already brought back); tests reach a row's
keys and values through `row_kv` / `put_row_kv`.

A read gathers a row's blocks into one tensor (the attention kernels take dense keys). Blocks are
token-major so that the gather is one `index_select` of whole blocks and the result is already
[rows, tokens, kv_heads, head_dim], which attention takes as a transposed view: measured on a Xeon
(bf16, one thread, 8 rows x 400 tokens, SmolLM2's 3 x 64 heads) this is 0.23 ms a layer against 0.86 ms
for head-major blocks gathered by advanced indexing and then reshaped (a second copy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from model.upload import upload


class PagedKV:
    """Keys/values of every layer in block pools, per-slot block tables, device lengths and their
    host mirror."""

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
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * max_slots
        self.capacity = capacity
        self.block_size = block_size
        self.trash = num_blocks  # the extra block: where writes and reads past a row's own blocks go
        self.tables = torch.full((max_slots, math.ceil(capacity / block_size)), num_blocks, device=device)
        self.host_tables: list[list[int]] = [[] for _ in range(max_slots)]

    @classmethod
    def contiguous(
        cls,
        num_layers: int,
        max_slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = 16,
    ) -> PagedKV:
        """A cache whose slot s owns blocks s*n .. s*n + n - 1 (n blocks hold the capacity) for good:
        what a benchmark or test that sets lengths directly, without a scheduler, needs."""
        n = math.ceil(capacity / block_size)
        cache = cls(num_layers, max_slots, capacity, kv_heads, head_dim, dtype, device, max_slots * n, block_size)
        for slot in range(max_slots):
            cache.set_table(slot, range(slot * n, (slot + 1) * n))
        return cache

    @property
    def num_slots(self) -> int:
        return len(self.host_lengths)

    @property
    def nbytes(self) -> int:
        """Bytes the key and value pools hold."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take over all layers."""
        return self.nbytes // ((self.trash + 1) * self.block_size)

    # -- lengths ----------------------------------------------------------------------------------

    def set_lengths(self, lo: int, lengths: Sequence[int]) -> None:
        """Slots lo.. now hold these committed lengths (one non-blocking host->device copy)."""
        n = len(lengths)
        self.host_lengths[lo : lo + n] = list(lengths)
        (on_device,) = upload([np.array(lengths, dtype=np.int64)], self.lengths.device)
        self.lengths[lo : lo + n] = on_device

    def advance(self, lo: int, counts: torch.Tensor, host_counts: Sequence[int]) -> None:
        """Slots lo.. grow by `counts` [R] on the device and by the same `host_counts` on the host
        (the caller has them already: no device read here)."""
        self.lengths[lo : lo + len(host_counts)] += counts
        for i, c in enumerate(host_counts):
            self.host_lengths[lo + i] += c

    def starts(self, lo: int, r: int) -> torch.Tensor:
        """Where rows lo..lo+r-1 write their next tokens: their device lengths [r] (a view)."""
        return self.lengths[lo : lo + r]

    def attended(self, lo: int, r: int, num_new: int, span: int | None = None) -> int:
        """Keys a forward of `num_new` tokens per row over rows lo..lo+r-1 attends over: the longest
        row's length plus `num_new`, from the host mirror; a static-shape forward attends over a
        fixed `span` (the same shapes every step, nothing for a CUDA graph to read)."""
        return span if span is not None else max(self.host_lengths[lo : lo + r]) + num_new

    # -- rows -------------------------------------------------------------------------------------

    def set_table(self, slot: int, blocks: Sequence[int]) -> None:
        """Slot `slot` now owns these blocks, in position order (see `set_tables`)."""
        self.set_tables([slot], [blocks])

    def set_tables(self, slots: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """Each slot now owns its blocks, in position order; the rest of its table points at the
        trash block. The tables that changed go to the device in one non-blocking copy (none when
        none changed: a row grows into a new block once every `block_size` tokens)."""
        pairs = [(slot, list(blocks)) for slot, blocks in zip(slots, tables)]
        changed = [(slot, blocks) for slot, blocks in pairs if self.host_tables[slot] != blocks]
        if not changed:
            return
        width = self.tables.shape[1]
        for slot, blocks in changed:
            if len(blocks) > width:  # a row past max_model_len: it fails alone (the caller's retry)
                raise ValueError(f"slot {slot}: {len(blocks)} blocks exceed its table's {width} (the capacity)")
        rows = np.full((len(changed), width), self.trash, dtype=np.int64)
        for j, (slot, blocks) in enumerate(changed):
            rows[j, : len(blocks)] = blocks
            self.host_tables[slot] = blocks
        index, values = upload([np.array([slot for slot, _ in changed], dtype=np.int64), rows], self.tables.device)
        self.tables.index_copy_(0, index, values)

    def vacate(self, first: int) -> None:
        """Slots first.. hold no row: length 0 and every table entry the trash block, so a static
        step's padding rows write there and nowhere else (host-checked: no device write when they
        are vacant already)."""
        slots = range(first, self.num_slots)
        self.set_tables(slots, [[] for _ in slots])
        if any(self.host_lengths[first:]):
            self.set_lengths(first, [0] * (self.num_slots - first))

    def _locate(self, lo: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of positions pos [R, T] of slots lo..lo+R-1."""
        blocks = self.tables[lo : lo + pos.shape[0]].gather(1, pos // self.block_size)
        return blocks, pos % self.block_size

    def scatter_index(self, lo: int, start: torch.Tensor, num_new: int) -> tuple[torch.Tensor, ...]:
        dev = start.device
        pos = (start[:, None] + torch.arange(num_new, device=dev)[None, :]).clamp_max(self.capacity - 1)
        blocks, offsets = self._locate(lo, pos)
        heads = torch.arange(self.keys[0].shape[2], device=dev)[None, :, None]
        # Indexes (block, offset, head) broadcast to [R, kv_heads, T]: what `write` puts [R, kv_heads, T, D] at.
        return blocks[:, None, :], offsets[:, None, :], heads

    def view(self, layer: int, lo: int, hi: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `kv_len` positions of slots lo..hi-1, gathered from their blocks (a copy):
        [R, kv_heads, kv_len, head_dim] each (a transposed view of the gathered tokens)."""
        table = self.tables[lo:hi, : math.ceil(kv_len / self.block_size)]
        r = table.shape[0]
        ids = table.flatten()

        def gather(pool: torch.Tensor) -> torch.Tensor:
            tokens = pool.index_select(0, ids).view(r, -1, pool.shape[2], pool.shape[3])
            return tokens[:, :kv_len].transpose(1, 2)

        return gather(self.keys[layer]), gather(self.values[layer])

    def move_row(self, src: int, dst: int) -> None:
        """Slot src's row now lives in slot dst: its table and length move, its blocks stay."""
        self.tables[dst] = self.tables[src]
        self.host_tables[dst] = self.host_tables[src]
        self.lengths[dst] = self.lengths[src]
        self.host_lengths[dst] = self.host_lengths[src]

    def _positions(self, slot: int, begin: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(begin, end, device=self.tables.device)[None]
        blocks, offsets = self._locate(slot, pos)
        return blocks[0], offsets[0]

    def row_kv(self, slot: int, begin: int, end: int) -> torch.Tensor:
        blocks, offsets = self._positions(slot, begin, end)
        # pool[blocks, offsets] -> [n, kv_heads, head_dim]; the layout wants [kv_heads, n, head_dim].
        return torch.stack(
            [torch.stack([k[blocks, offsets].transpose(0, 1), v[blocks, offsets].transpose(0, 1)])
             for k, v in self.layer_kv()]
        )  # fmt: skip

    def put_row_kv(self, slot: int, begin: int, kv: torch.Tensor) -> None:
        blocks, offsets = self._positions(slot, begin, begin + kv.shape[3])
        for layer, (k, v) in enumerate(self.layer_kv()):
            k[blocks, offsets] = kv[layer, 0].transpose(0, 1).to(k.dtype)
            v[blocks, offsets] = kv[layer, 1].transpose(0, 1).to(v.dtype)

    def write(self, layer: int, index: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [R, kv_heads, T, head_dim] of one layer at `index` (`scatter_index`), cast to
        the pools' dtype."""
        keys, values = self.keys[layer], self.values[layer]
        keys.index_put_(index, k.to(keys.dtype))
        values.index_put_(index, v.to(values.dtype))

    def layer_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's whole key and value pools [num_blocks + 1, block_size, kv_heads, head_dim]."""
        return list(zip(self.keys, self.values))
