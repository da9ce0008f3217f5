"""Keys/values of prompt beginnings seen before, copied into later prompts that begin the same way.

Chat prompts share their first tokens (the system prompt, the template's role markers: 24 tokens on
every request to the embedded default without a system message). A token's keys/values in every
layer depend only on the tokens up to it, so a prompt whose first n tokens were prefilled before
can copy those from here and forward only the rest. The copy is exact up to the summation order of
the forward that first computed them (as for any batching of a prefill).

Storage is in blocks of `block_size` tokens. A block is keyed by a chain hash of every token up to
its end and holds its own tokens and its parent's key, which a lookup checks, so a hash collision
can never reuse another prompt's prefix. Blocks are evicted least recently used first; a lookup
refreshes a chain from its end to its root, so a block never outlives its parent.

It caches the rows of any number of caches alike (the target's RaggedKVCache and the drafter's
DraftContextCache), through the KV room's interface (model/kv/slots.py: `row_kv`, `put_row_kv`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.kv.slots import SlotKV


@dataclass
class CachedBlock:
    tokens: tuple[int, ...]
    parent: int | None  # the key of the block before it (None: the prompt's first block)
    kv: list[torch.Tensor]  # per cache: [layers, 2, kv_heads, block_size, head_dim]


class PrefixCache:
    """Block-granular store of prompt keys/values; at most `max_tokens` tokens are kept."""

    def __init__(self, caches: list[SlotKV], block_size: int, max_tokens: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.caches = caches
        self.block_size = block_size
        self.max_blocks = max_tokens // block_size
        self.blocks: OrderedDict[int, CachedBlock] = OrderedDict()
        self.hit_tokens = 0  # prompt tokens copied instead of computed, since creation
        self.lookups = 0

    def _chain(self, prompt: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of every full block that leaves at least one prompt token to forward."""
        b = self.block_size
        out, key = [], None
        for end in range(b, len(prompt), b):
            tokens = tuple(prompt[end - b : end])
            key = hash((key, tokens))
            out.append((key, tokens))
        return out

    def lookup(self, prompt: list[int]) -> list[int]:
        """Keys of the longest stored chain of blocks the prompt begins with (refreshed as used)."""
        self.lookups += 1
        found: list[int] = []
        parent = None
        for key, tokens in self._chain(prompt):
            block = self.blocks.get(key)
            if block is None or block.tokens != tokens or block.parent != parent:
                break
            found.append(key)
            parent = key
        for key in reversed(found):  # the root ends up most recent: children are evicted first
            self.blocks.move_to_end(key)
        self.hit_tokens += len(found) * self.block_size
        return found

    def load(self, slot: int, keys: list[int]) -> int:
        """Copy these blocks (a chain from `lookup`) into positions 0.. of `slot`; returns the tokens."""
        if not keys:
            return 0
        for c, cache in enumerate(self.caches):
            cache.put_row_kv(slot, 0, torch.cat([self.blocks[key].kv[c] for key in keys], dim=3))
        return len(keys) * self.block_size

    def store(self, slot: int, prompt: list[int]) -> None:
        """Keep the blocks of a prompt just prefilled into `slot` that are not stored yet."""
        if self.max_blocks == 0:
            return
        b = self.block_size
        chain = self._chain(prompt)
        parent = None
        for i, (key, tokens) in enumerate(chain):
            block = self.blocks.get(key)
            if block is not None and (block.tokens != tokens or block.parent != parent):
                break  # a hash collision: leave the stored chain alone
            if block is None:
                kv = [c.row_kv(slot, i * b, (i + 1) * b) for c in self.caches]
                self.blocks[key] = CachedBlock(tokens, parent, kv)
            parent = key
        for key, _ in reversed(chain):
            if key in self.blocks:
                self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size
