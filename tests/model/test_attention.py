"""Folded grouped-query attention (model/nn/attention.py) against the copy-the-heads reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.nn.attention import ATTENTION_NAME, can_pack, packed_gqa_attention
from model.nn.target import TargetModel
from tests.helpers import tiny_target


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), attn_mask=mask
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("t", [1, 2, 5])
@pytest.mark.parametrize("mask_kind", ["float", "bool", "broadcast"])
def test_folded_attention_matches_repeated_heads(heads: int, kv_heads: int, t: int, mask_kind: str) -> None:
    g = torch.Generator().manual_seed(heads * 100 + t)
    r, d, cached = 3, 16, 11
    kv_len = cached + t
    q = torch.randn(r, heads, t, d, generator=g)
    k = torch.randn(r, kv_heads, kv_len, d, generator=g)
    v = torch.randn(r, kv_heads, kv_len, d, generator=g)
    # Ragged rows: row i has i fewer cached tokens, and causal over its new ones.
    lengths = torch.tensor([cached - i for i in range(r)])
    positions = lengths[:, None] + torch.arange(t)[None]
    visible = torch.arange(kv_len)[None, None, :] <= positions[:, :, None]  # [R, T, K]
    if mask_kind == "float":
        mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None]
    elif mask_kind == "bool":
        mask = visible[:, None]
    else:  # one mask row for every query, as the drafter's block uses
        mask = visible[:, -1:][:, None]
    assert can_pack(heads, kv_heads, mask) == (heads > kv_heads)
    expected = _reference(q, k, v, mask)
    got = packed_gqa_attention(q, k, v, mask)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_target_uses_folded_attention_and_matches_stock_sdpa() -> None:
    model = tiny_target(vocab=96, layers=2)
    target = TargetModel(model)
    assert model.config._attn_implementation == ATTENTION_NAME

    def verify_logits() -> torch.Tensor:
        cache = target.new_cache(max_slots=2, capacity=32)
        prompts = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
        target.forward(cache, 0, prompts, logits_at=torch.tensor([4, 4]))
        cache.set_lengths(0, [5, 3])  # ragged rows
        return target.forward(cache, 0, torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]])).logits

    folded = verify_logits()
    model.set_attn_implementation("sdpa")
    stock = verify_logits()
    torch.testing.assert_close(folded, stock, atol=1e-5, rtol=1e-5)
