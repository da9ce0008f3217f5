"""KV memory by blocks: a fixed number of fixed-size blocks shared by every row, reference-counted,
each row's block table on the host, and an index of full prompt blocks by content, so that prompts
beginning alike share those blocks by reference.

The budget (`DOMINO_KV_CACHE_MEMORY`) becomes a number of blocks once, at start-up, from the bytes
one token takes in the target's and the drafter's caches together. Admission reserves a row's
blocks (model/engine/scheduler.py); a row leaving gives them back. The blocks are the storage
(model/kv/paged.py).

The prefix index (as vLLM's block pool does) keeps a freed block's content for as long as nobody needs
the block: free blocks wait in least-recently-used order, a prompt that begins with an indexed block
takes it back out of the free queue, and allocating a block that still holds indexed content drops
it from the index. So the index costs no memory of its own: it is the free part of the budget.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from model.kv.sizes import format_bytes

# The budget when none is set. On a CPU a byte count that does not grow with max_batch_size x
# max_model_len: 2 GiB holds ~90k tokens of the embedded default in bf16 (23.25 KiB per token,
# target and drafter) or ~45k in fp32, so its default 8 rows x 2048 tokens fit 2-5 times over, and it
# is under a tenth of a 24 GiB machine. On a GPU, as vLLM does, most of what the weights left.
CPU_DEFAULT_KV_MEMORY = 2 * 2**30
GPU_DEFAULT_KV_FRACTION = 0.9


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in a cache of these shapes."""
    return num_layers * 2 * kv_heads * head_dim * dtype.itemsize


def memory_there_is(device: torch.device) -> int:
    """What a KV budget may take at most: on CUDA the device's free memory now (after the weights),
    on a CPU the machine's physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget(setting: int | float | None, device: torch.device) -> int:
    """Bytes for KV blocks from `kv_cache_memory`: bytes as they are, a fraction of `memory_there_is`,
    or the default (None). ValueError, naming the setting, for more than there is."""
    there_is = memory_there_is(device)
    if setting is None:
        setting = GPU_DEFAULT_KV_FRACTION if device.type == "cuda" else CPU_DEFAULT_KV_MEMORY
    if isinstance(setting, float):
        return int(setting * there_is)
    if setting > there_is:
        raise ValueError(
            f"kv_cache_memory (DOMINO_KV_CACHE_MEMORY) of {format_bytes(setting)} is more than the "
            f"{format_bytes(there_is)} there is on {device}"
        )
    return setting


def prompt_blocks(token_ids: list[int], block_size: int) -> list[tuple[int, tuple[int, ...]]]:
    """(key, tokens) of every full block of a prompt that leaves at least one token to forward (the
    last token's logits are needed, and a row never writes into a block it may share). A block's key
    is a chain hash of every token up to its end."""
    out, key = [], None
    for end in range(block_size, len(token_ids), block_size):
        tokens = tuple(token_ids[end - block_size : end])
        key = hash((key, tokens))
        out.append((key, tokens))
    return out


@dataclass(frozen=True)
class IndexedBlock:
    """What an indexed block holds: its key, its own tokens and its parent's key (a lookup checks
    both, so a hash collision never reuses another prompt's keys and values)."""

    key: int
    tokens: tuple[int, ...]
    parent: int | None


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens: a free queue in least-recently-used order, a
    reference count per block, and the index of full prompt blocks by content."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"kv_block_size must be a power of two, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion order: evicted first
        self.indexed: dict[int, IndexedBlock] = {}  # block id -> its content
        self.by_key: dict[int, int] = {}  # key -> block id

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of the blocks in use (vLLM's kv_cache_usage_perc)."""
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        """n free blocks, each now referenced once; None (and nothing taken) when fewer are free."""
        if n > len(self.free):
            return None
        blocks = list(itertools.islice(self.free, n))
        for b in blocks:
            del self.free[b]
            self.ref_counts[b] = 1
            if b in self.indexed:  # its old content is about to be overwritten
                del self.by_key[self.indexed.pop(b).key]
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more reference to blocks already in use (a row sharing another's prefix)."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is free: only blocks in use can be shared")
            self.ref_counts[b] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block nobody references is free again (last in the
        eviction order, its indexed content kept until the block is allocated again)."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise ValueError(f"block {b} is already free")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None

    # -- the prefix index ---------------------------------------------------------------------------

    def lookup(self, token_ids: list[int]) -> list[int]:
        """The indexed blocks the prompt begins with, each now referenced once more (taken out of
        the free queue where nobody held it)."""
        found: list[int] = []
        parent = None
        for key, tokens in prompt_blocks(token_ids, self.block_size):
            b = self.by_key.get(key)
            if b is None or self.indexed[b] != IndexedBlock(key, tokens, parent):
                break
            found.append(b)
            parent = key
        for b in found:
            self.free.pop(b, None)
            self.ref_counts[b] += 1
        return found

    def index(self, token_ids: list[int], table: list[int]) -> None:
        """A row's prompt `token_ids` is in its blocks `table`: index its full blocks by content
        (where no block holds that content yet)."""
        parent = None
        for (key, tokens), b in zip(prompt_blocks(token_ids, self.block_size), table):
            held = self.by_key.get(key)
            if held is None and b not in self.indexed:
                self.by_key[key] = b
                self.indexed[b] = IndexedBlock(key, tokens, parent)
            elif held is not None and self.indexed[held] != IndexedBlock(key, tokens, parent):
                return  # a hash collision: leave the indexed chain alone
            parent = key

    @property
    def num_indexed(self) -> int:
        return len(self.indexed)


class BlockTables:
    """Each running row's blocks, in position order, by request id: what admission reserved."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.tables: dict[str, list[int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tables

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def shortfall(self, request_id: str, tokens: int) -> int:
        """Blocks the row lacks to hold positions 0..tokens-1."""
        return max(0, self.pool.blocks_for(tokens) - len(self.tables.get(request_id, [])))

    def reserve(self, request_id: str, tokens: int, keep_free: int = 0) -> bool:
        """Grow the row's table to hold positions 0..tokens-1, leaving at least `keep_free` blocks
        free; False, with nothing taken, when the pool cannot."""
        more = self.shortfall(request_id, tokens)
        if more == 0:
            return True
        if self.pool.num_free - more < keep_free:
            return False
        blocks = self.pool.allocate(more)
        if blocks is None:
            return False
        self.tables[request_id] = self.tables.get(request_id, []) + blocks
        return True

    def share_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """Begin a new row's table with the indexed blocks its tokens begin with; returns how many
        tokens they hold (none are copied: the row attends over the shared blocks)."""
        if request_id in self.tables:
            raise ValueError(f"request {request_id!r} holds blocks already")
        shared = self.pool.lookup(token_ids)
        if shared:
            self.tables[request_id] = shared
        return len(shared) * self.pool.block_size

    def index_prefix(self, request_id: str, token_ids: list[int]) -> None:
        """The row's caches now hold `token_ids` from position 0: index its full blocks."""
        self.pool.index(token_ids, self.tables.get(request_id, []))

    def free(self, request_id: str) -> None:
        """The row left: its blocks go back to the pool (shared ones once nobody else holds them),
        last block first, so that a prompt's first blocks, the likeliest shared, are evicted last."""
        self.pool.release(reversed(self.tables.pop(request_id, [])))
