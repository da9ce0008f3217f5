"""TargetModel's packed forward: the MLPs and the LM head over the real tokens only."""

from __future__ import annotations

import pytest
import torch

from model.target import TargetModel
from tests.helpers import tiny_target


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_packed_forward_equals_padded_forward_at_real_positions(kind: str) -> None:
    target = TargetModel(tiny_target(kind, vocab=96, layers=3), tap_layer_ids=[0, 2])
    assert target.can_pack
    prompts = torch.tensor([[5, 6, 7, 8, 9, 3], [10, 11, 12, 13, 14, 15], [1, 2, 3, 4, 5, 6]])
    verify = torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1], [7, 8, 9, 10]])
    real = torch.tensor([2, 4, 1])  # anchor + drafts per row; the rest is padding

    def run(num_tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        cache = target.new_cache(max_slots=3, capacity=32)
        target.forward(cache, 0, prompts, logits_at=torch.tensor([5, 5, 5]))
        cache.lengths[:3] = torch.tensor([6, 4, 5])  # ragged rows
        out = target.forward(cache, 0, verify, num_tokens=num_tokens)
        assert out.features is not None
        # What a later forward reads of the cache: the keys/values of the real tokens.
        kv = [k[i, :, : int(cache.lengths[i]) + int(real[i])] for k in cache.keys for i in range(3)]
        return out.logits, out.features, kv

    padded_logits, padded_features, padded_kv = run(None)
    packed_logits, packed_features, packed_kv = run(real)
    for i, n in enumerate(real.tolist()):
        torch.testing.assert_close(packed_logits[i, :n], padded_logits[i, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed_features[i, :n], padded_features[i, :n], atol=1e-5, rtol=1e-5)
        assert bool((packed_logits[i, n:] == 0).all())  # padding was never run through the LM head
        # and its MLPs did not run either: a padded position's features differ from the padded run's
        if n < verify.shape[1]:
            assert not torch.allclose(packed_features[i, n:], padded_features[i, n:])
    for a, b in zip(packed_kv, padded_kv):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Nothing padded: the plain forward, bit for bit.
    full, _, _ = run(torch.tensor([4, 4, 4]))
    assert torch.equal(full, padded_logits)
