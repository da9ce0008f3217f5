"""A packed forward (model/nn/target.py: `forward_packed`): several groups of rows in one decoder
pass give each group what a forward of that group alone gives, and write the same keys."""

from __future__ import annotations

import pytest
import torch

from model.nn.target import RowGroup, TargetModel
from tests.helpers import tiny_target


def _filled(target: TargetModel, prefixes: list[list[int]]) -> object:
    """A cache whose slots hold these prefixes (one forward per row)."""
    cache = target.new_cache(len(prefixes), 64)
    for slot, prefix in enumerate(prefixes):
        if prefix:
            target.forward(cache, slot, torch.tensor([prefix]))
            cache.set_lengths(slot, [len(prefix)])
    return cache


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_groups_match_each_group_alone(kind: str) -> None:
    target = TargetModel(tiny_target(kind=kind, vocab=96), tap_layer_ids=[0, 2])
    # Slots 0-2 decode (prefixes of different lengths, 3 tokens each); slots 3-4 take prompt chunks
    # (one after 5 cached tokens, one from nothing), padded to 6 and asked for one position each.
    prefixes = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24], []]
    decode = torch.tensor([[30, 31, 32], [33, 34, 35], [36, 37, 38]])
    chunk = torch.tensor([[40, 41, 42, 43, 44, 45], [50, 51, 52, 0, 0, 0]])
    at = torch.tensor([5, 2])

    alone = _filled(target, prefixes)
    expected = [target.forward(alone, 0, decode), target.forward(alone, 3, chunk, logits_at=at)]
    packed = _filled(target, prefixes)
    got = target.forward_packed(packed, [RowGroup(0, decode), RowGroup(3, chunk, at)])

    for e, g in zip(expected, got):
        assert g.logits.shape == e.logits.shape
        torch.testing.assert_close(g.logits, e.logits, atol=1e-4, rtol=1e-4)
        assert g.features is not None and e.features is not None
        torch.testing.assert_close(g.features, e.features, atol=1e-4, rtol=1e-4)
    # The keys each row wrote: its prefix and its new tokens, where the padded forward put them.
    new = [3, 3, 3, 6, 3]
    for slot, prefix in enumerate(prefixes):
        end = len(prefix) + new[slot]
        torch.testing.assert_close(packed.row_kv(slot, 0, end), alone.row_kv(slot, 0, end), atol=1e-4, rtol=1e-4)


def test_a_packed_forward_leaves_the_cache_padded_again() -> None:
    """After a packed forward, a plain one reads the cache as before (no packed state left)."""
    target = TargetModel(tiny_target(vocab=96))
    cache = _filled(target, [[1, 2, 3], [4, 5]])
    target.forward_packed(cache, [RowGroup(0, torch.tensor([[6]])), RowGroup(1, torch.tensor([[7, 8]]))])
    assert cache.packed == []
    out = target.forward(cache, 0, torch.tensor([[9], [10]]))
    assert out.logits.shape == (2, 1, 96)
