"""The drafter's context cache: per-row context keys/values of every drafter layer, in the KV room's
paged storage (model/kv/paged.py), with the target's block ids."""

from __future__ import annotations

from model.kv.paged import PagedKV


class DraftContextCache(PagedKV):
    """Per-row context keys/values of every drafter layer.

    A row's context length is its slot's length. A block's own keys/values are written after a
    row's context as scratch and never counted, so rolling back is free.
    """
