"""The drafter's context cache: per-row context keys/values of every drafter layer, in the KV
room's per-slot storage (model/kv/slots.py)."""

from __future__ import annotations

from model.kv.paged import PagedKV
from model.kv.slots import SlotKV


class DraftContextCache(SlotKV):
    """Per-row context keys/values of every drafter layer, in preallocated buffers.

    Rows live in slots; a row's context length is its slot's length. A block's own keys/values are
    written after a row's context as scratch and never counted, so rolling back is free.
    """


class PagedDraftContextCache(PagedKV, DraftContextCache):
    """The drafter's context over block pools, with the target's block ids (model/kv/paged.py)."""
