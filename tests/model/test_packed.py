"""Weight-only int8 linear layers (model/nn/packed.py, DOMINO_DTYPE=int8): what they compute, and an
engine over them decoding exactly what HF generate decodes with the same (de-quantized) weights."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import pytest
import torch
from torch import nn

from model.engine.engine import Engine, SamplingParams
from model.load.loading import pack_weights, resolve_dtype
from model.nn.packed import INT8_ROWS, Int8Linear
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target
from tests.model.test_engine import _hf_greedy, _prompts


def test_an_int8_layer_applies_its_dequantized_weight() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    packed = Int8Linear(linear)
    dense = linear.weight.detach()
    w = packed.qweight.float() * packed.scale.float()[:, None]
    # Per output channel, symmetric: within half a step of the dense weight (and the bf16 scale's
    # rounding, under 1 % of the value).
    step = dense.abs().amax(1, keepdim=True) / 127
    assert ((w - dense).abs() <= step / 2 + 0.01 * dense.abs()).all()
    assert packed.dequantized().dtype == torch.bfloat16
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    expected = (x.float() @ w.T + linear.bias.detach().float()).to(torch.bfloat16)
    torch.testing.assert_close(packed(x), expected, rtol=2e-2, atol=2e-2)
    assert packed(x).shape == (3, 5, 48) and packed.qweight.dtype == torch.int8
    # Up to INT8_ROWS rows through the int8 kernel, more through the de-quantized weight: the same.
    few = x[0, :INT8_ROWS]
    torch.testing.assert_close(packed(few), packed(x)[0, :INT8_ROWS], rtol=2e-2, atol=2e-2)
    with pytest.raises(AttributeError, match="weight"):
        _ = packed.weight


def _dequantized_fp32(model: nn.Module) -> nn.Module:
    """A float32 copy of `model` whose Int8Linear layers are nn.Linear layers holding the weights
    they apply (int8 x scale, exactly, in float32)."""
    copy = deepcopy(model)

    def swap(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, Int8Linear):
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight = nn.Parameter(child.qweight.float() * child.scale.float()[:, None])
                setattr(module, name, dense)
            else:
                swap(child)

    swap(copy)
    return copy.float()


def test_an_int8_engine_decodes_what_hf_generate_does_on_the_same_weights() -> None:
    """The tiny target packed as int8 (the LM head too, keeping the dense weight a drafter
    borrows): `ar` and `domino` greedy output against HF generate in float32 on the weights the
    int8 layers apply. bf16 activations may part from it only at near-ties: where an output first
    differs, the reference's top two logits are within 2 % of the logits' spread."""
    model = tiny_target().to(torch.bfloat16)
    assert pack_weights(model, "int8") == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    reference = _dequantized_fp32(model)
    prompts, budgets = _prompts(4), [12, 9, 14, 10]
    refs = [_hf_greedy(reference, p, n) for p, n in zip(prompts, budgets)]
    for mode, drafter in (("ar", None), ("domino", tiny_drafter(domino=True).to(torch.bfloat16))):
        engine = Engine(TargetModel(model), drafter, mode=mode, max_batch_size=4, max_model_len=96)
        out = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in budgets])
        same = 0
        for (tokens, _, _), ref, prompt in zip(out, refs, prompts):
            if tokens == ref:
                same += 1
                continue
            pos = next(i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b)
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + ref[:pos]])).logits[0, -1]
            top = logits.topk(2).values
            assert float(top[0] - top[1]) < 0.02 * float(logits.std()), (mode, pos, top)
        assert same >= 2, mode  # most rows exact


def test_int8_is_a_cpu_dtype() -> None:
    assert resolve_dtype("int8", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="DOMINO_DTYPE"):
        resolve_dtype("int8", "cuda")
    with pytest.raises(ValueError, match="int8"):
        resolve_dtype("int4", "cpu")


def test_dtype_int8_builds_a_packed_engine_from_a_checkpoint(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    """What `DOMINO_DTYPE=int8` starts: the target's linear layers packed, bf16 elsewhere, the
    drafter borrowing the LM head's dense rows; it decodes. On a GPU it is refused, naming the setting."""
    from model.load.loading import build_engine

    engine, _ = build_engine(
        str(tiny_target_dir), str(tiny_drafter_dir), mode="domino", dtype="int8", device="cpu",
        max_batch_size=2, max_model_len=64,
    )  # fmt: skip
    layers = list(engine.target.hf_model.modules())
    assert sum(isinstance(m, Int8Linear) for m in layers) > 0 and not any(isinstance(m, nn.Linear) for m in layers)
    assert engine.target.dtype == torch.bfloat16
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(out[0][0]) == 6
    with pytest.raises(ValueError, match="DOMINO_DTYPE"):
        build_engine(str(tiny_target_dir), None, mode="ar", dtype="int8", device="cuda")
