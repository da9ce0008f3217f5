"""The lean decoder forward (model/nn/lean.py) against transformers' own forward of the same model:
the same logits, taps and cache writes, padded and packed, and the same greedy decoding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from model.engine.engine import Engine, SamplingParams
from model.load.loading import pack_weights
from model.nn.lean import lean_unsupported
from model.nn.target import RowGroup, TargetModel
from tests.helpers import tiny_drafter, tiny_target
from tests.model.test_engine import _hf_greedy, _prompts


def _filled(target: TargetModel, prefixes: list[list[int]]) -> object:
    cache = target.new_cache(len(prefixes), 64)
    for slot, prefix in enumerate(prefixes):
        target.forward(cache, slot, torch.tensor([prefix]))
        cache.set_lengths(slot, [len(prefix)])
    return cache


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_matches_transformers_forward(kind: str, dtype: torch.dtype) -> None:
    """Decode (one token), verify (four, ragged rows) and a packed forward of both: every logit,
    tapped feature and written key as transformers' forward gives them (the same ops; attention
    folds grouped heads for one token too, so a few ulps may differ)."""
    model = tiny_target(kind=kind, vocab=96).to(dtype)
    lean, plain = TargetModel(model, [0, 2]), TargetModel(model, [0, 2], lean=False)
    assert lean.lean is not None and plain.lean is None
    prefixes = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for tokens in (
        torch.tensor([[20], [21], [22]]),
        torch.tensor([[20, 21, 22, 23], [24, 25, 0, 0], [26, 27, 28, 29]]),
    ):
        caches = _filled(lean, prefixes), _filled(plain, prefixes)
        a, b = lean.forward(caches[0], 0, tokens), plain.forward(caches[1], 0, tokens)
        torch.testing.assert_close(a.logits, b.logits, **tol)
        assert a.features is not None and b.features is not None
        torch.testing.assert_close(a.features, b.features, **tol)
        end = len(prefixes[2]) + tokens.shape[1]
        torch.testing.assert_close(caches[0].row_kv(2, 0, end), caches[1].row_kv(2, 0, end), **tol)
    groups = [RowGroup(0, torch.tensor([[30], [31]])), RowGroup(2, torch.tensor([[32, 33, 34]]))]
    caches = _filled(lean, prefixes), _filled(plain, prefixes)
    for a, b in zip(lean.forward_packed(caches[0], groups), plain.forward_packed(caches[1], groups)):
        torch.testing.assert_close(a.logits, b.logits, **tol)
        torch.testing.assert_close(a.features, b.features, **tol)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("packing", ["none", "int4"])
def test_greedy_decoding_is_the_same_through_either_forward(lean: bool, packing: str) -> None:
    """`ar` and `domino` over the lean or transformers' forward decode what HF generate does (fp32),
    and, over int4 weights (bf16), the two forwards decode the same tokens."""
    model = tiny_target()
    if packing == "int4":
        model = model.to(torch.bfloat16)
        pack_weights(model, "int4")
    prompts, budgets = _prompts(3), [10, 7, 12]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)] if packing == "none" else None
    outputs = {}
    for use_lean in (lean, not lean):
        for mode, drafter in (("ar", None), ("domino", tiny_drafter(domino=True))):
            if packing == "int4" and drafter is not None:
                drafter = drafter.to(torch.bfloat16)
            target = TargetModel(model, lean=use_lean)
            engine = Engine(target, drafter, mode=mode, max_batch_size=3, max_model_len=96, kv_block_size=4)
            out = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in budgets])
            outputs[use_lean, mode] = [tokens for tokens, _, _ in out]
    if refs is not None:
        assert all(v == refs for v in outputs.values())
    else:
        assert outputs[True, "ar"] == outputs[False, "ar"]


def test_what_the_lean_forward_leaves_to_transformers() -> None:
    assert lean_unsupported(Qwen3Config()) is None and lean_unsupported(LlamaConfig()) is None
    assert "model_type" in str(lean_unsupported(type("C", (), {"model_type": "gpt2"})()))
    assert "hidden_act" in str(lean_unsupported(LlamaConfig(hidden_act="gelu")))
    windowed = Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=0, num_hidden_layers=2)
    assert "sliding" in str(lean_unsupported(windowed))
    # Such a model runs through transformers' forward.
    model = tiny_target(hidden_act="gelu")
    target = TargetModel(model)
    assert target.lean is None and "transformers' forward (hidden_act 'gelu')" in target.summary()
    prompt = _prompts(1)[0]
    engine = Engine(target, None, mode="ar", max_batch_size=1, max_model_len=64)
    assert engine.generate([prompt], SamplingParams(max_new_tokens=6))[0][0] == _hf_greedy(model, prompt, 6)


def test_the_start_up_summary_names_the_weights_and_the_forward() -> None:
    model = tiny_target().to(torch.bfloat16)
    assert TargetModel(model).summary() == "target: bfloat16 weights; lean Llama-family forward (model/nn/lean.py)"
    pack_weights(model, "int4")
    summary = TargetModel(model, lean=False).summary()
    assert summary.startswith("target: packed linear layers (28 int4, 1 int8), bfloat16 activations;")
    assert summary.endswith("transformers' forward (lean forward turned off)")
