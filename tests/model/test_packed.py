"""Weight-only packed linear layers (model/nn/packed.py, DOMINO_DTYPE=int8|int4): what they compute,
and an engine over them decoding what HF generate decodes with the same (de-quantized) weights."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import pytest
import torch
from torch import nn

from model.engine.engine import Engine, SamplingParams
from model.load.loading import cpu_has_native_bf16, pack_weights, resolve_dtype
from model.nn.packed import Int4Linear, Int8Linear, PackedLinear
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
    # The dense copy for wide inputs stays in the layer's dtype (fp32 here: without native bf16 a
    # bf16 GEMM is emulated); `model.to(torch.bfloat16)` moves it with the rest.
    assert torch.equal(packed.wide, w) and packed.wide.dtype == torch.float32
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    expected = (x.float() @ w.T + linear.bias.detach().float()).to(torch.bfloat16)
    torch.testing.assert_close(packed(x), expected, rtol=2e-2, atol=2e-2)
    assert packed(x).shape == (3, 5, 48) and packed.qweight.dtype == torch.int8
    # Up to max_rows rows through the int8 kernel, more through the de-quantized weight: the same.
    few = x[0, : packed.max_rows]
    torch.testing.assert_close(packed(few), packed(x)[0, : packed.max_rows], rtol=2e-2, atol=2e-2)
    with pytest.raises(AttributeError, match="weight"):
        _ = packed.weight


def test_an_int4_layer_recovers_q4_1_blocks_and_applies_them() -> None:
    """A weight made of GGUF Q4_1 blocks (w = q * d + m per 32 inputs, d and m fp16, each block
    using q = 0 and q = 15 as the format's quantizer does) packs into exactly those d and m, in
    torch's form (scale d, zero m + 8d, rounded to bf16); the layer applies them on both paths."""
    torch.manual_seed(0)
    out_f, in_f = 32, 96
    q = torch.randint(0, 16, (out_f, in_f // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(out_f, in_f // 32) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out_f, in_f // 32) * 0.1).half().float()
    linear = nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = (q * d[..., None] + m[..., None]).view(out_f, in_f)
    packed = Int4Linear(linear)
    scale, zero = packed.scales_zeros.float().unbind(-1)  # [groups, out]
    assert torch.equal(scale.T, d.bfloat16().float()) and torch.equal(zero.T, (m + 8 * d).bfloat16().float())
    applied = ((q - 8) * scale.T[..., None] + zero.T[..., None]).view(out_f, in_f)
    assert torch.equal(packed.wide, applied)
    assert torch.equal(packed.to(torch.bfloat16).wide, applied.bfloat16())
    assert packed.scales_zeros.dtype == torch.bfloat16  # the kernel's dtype: already bf16
    # Off the grid, a weight moves by at most half a step (plus the bf16 scale's rounding).
    linear.weight.data = torch.randn(out_f, in_f) * 0.05
    packed = Int4Linear(linear)
    w = linear.weight.view(out_f, in_f // 32, 32)
    step = ((w.amax(-1) - w.amin(-1)) / 15)[..., None]
    assert ((packed.wide.float().view_as(w) - w).abs() <= 0.55 * step + 0.01 * w.abs()).all()
    x = torch.randn(2, 7, in_f, dtype=torch.bfloat16)
    expected = (x.float() @ packed.wide.float().T).to(torch.bfloat16)
    torch.testing.assert_close(packed(x), expected, rtol=2e-2, atol=2e-2)
    assert x.shape[0] * x.shape[1] > packed.max_rows >= x.shape[1]  # both paths
    torch.testing.assert_close(packed(x[0]), expected[0], rtol=2e-2, atol=2e-2)
    for bad in (nn.Linear(40, 16), nn.Linear(32, 8)):
        with pytest.raises(ValueError, match="divisible"):
            Int4Linear(bad)


def _dequantized_fp32(model: nn.Module) -> nn.Module:
    """A float32 copy of `model` whose packed layers are nn.Linear layers holding the weights they
    apply (int8 x scale exactly; int4 as de-quantized to bf16), in float32."""
    copy = deepcopy(model)

    def swap(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, PackedLinear):
                dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                if isinstance(child, Int8Linear):
                    dense.weight = nn.Parameter(child.qweight.float() * child.scale.float()[:, None])
                else:
                    dense.weight = nn.Parameter(child.wide.float())
                setattr(module, name, dense)
            else:
                swap(child)

    swap(copy)
    return copy.float()


@pytest.mark.parametrize("activations", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("packing", ["int8", "int4"])
def test_a_packed_engine_decodes_what_hf_generate_does_on_the_same_weights(
    packing: str, activations: torch.dtype
) -> None:
    """The tiny target packed (int8: the LM head too; int4: the decoder, the LM head int8; the head
    keeping the dense weight a drafter borrows), its other ops in bf16 (CPUs with native bf16) or
    float32 (without): `ar` and `domino` greedy output against HF generate in float32 on the weights
    the packed layers apply. bf16 rows may part from it only at near-ties: where an output first
    differs, the reference's top two logits are within 2 % of the logits' spread."""
    model = tiny_target().to(activations)
    assert pack_weights(model, packing) == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer; the LM head
    kinds = {type(m) for m in model.modules() if isinstance(m, PackedLinear)}
    assert kinds == ({Int8Linear} if packing == "int8" else {Int4Linear, Int8Linear})
    reference = _dequantized_fp32(model)
    prompts, budgets = _prompts(4), [12, 9, 14, 10]
    refs = [_hf_greedy(reference, p, n) for p, n in zip(prompts, budgets)]
    for mode, drafter in (("ar", None), ("domino", tiny_drafter(domino=True).to(activations))):
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


def test_packed_dtypes_are_cpu_dtypes() -> None:
    """Packed weights take bf16 activations where the CPU multiplies bf16 natively, else float32
    (only the packed kernels then see bf16 rows)."""
    for packing in ("int8", "int4"):
        assert resolve_dtype(packing, "cpu") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
        with pytest.raises(ValueError, match="DOMINO_DTYPE"):
            resolve_dtype(packing, "cuda")
    with pytest.raises(ValueError, match="int4"):
        resolve_dtype("int2", "cpu")


@pytest.mark.parametrize("packing", ["int8", "int4"])
def test_a_packed_dtype_builds_a_packed_engine_from_a_checkpoint(
    packing: str, tiny_target_dir: Path, tiny_drafter_dir: Path
) -> None:
    """What `DOMINO_DTYPE=int8|int4` starts: the target's linear layers packed, the rest in the
    CPU's activation dtype (bf16 with native bf16, else float32; the kernels' scales bf16 either
    way), the drafter borrowing the LM head's dense rows; it decodes. On a GPU it is refused, naming
    the setting."""
    from model.load.loading import build_engine

    engine, _ = build_engine(
        str(tiny_target_dir), str(tiny_drafter_dir), mode="domino", dtype=packing, device="cpu",
        max_batch_size=2, max_model_len=64,
    )  # fmt: skip
    layers = list(engine.target.hf_model.modules())
    kind = Int8Linear if packing == "int8" else Int4Linear
    assert sum(isinstance(m, kind) for m in layers) > 0 and not any(isinstance(m, nn.Linear) for m in layers)
    activations = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert engine.target.dtype == activations
    assert all(p.dtype == activations for p in engine.target.hf_model.parameters())
    packed = [m for m in layers if isinstance(m, PackedLinear)]
    assert all(m.wide.dtype == activations for m in packed)
    assert all(b.dtype != torch.float32 for m in packed for n, b in m.named_buffers() if n in ("scale", "scales_zeros"))
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert len(out[0][0]) == 6
    with pytest.raises(ValueError, match="DOMINO_DTYPE"):
        build_engine(str(tiny_target_dir), None, mode="ar", dtype=packing, device="cuda")


@pytest.mark.parametrize("dense", [torch.bfloat16, torch.float32])
def test_auto_on_a_cpu_keeps_the_faster_of_int4_and_dense(dense: torch.dtype) -> None:
    """`choose_cpu_format` (DOMINO_DTYPE=auto for the embedded default on a CPU: bf16 the dense
    format with native bf16, float32 without) times both formats of the same float32 weights and
    returns the one it names, ready to decode, its other ops in the dense dtype."""
    from model.load.cpu_format import choose_cpu_format

    reference = tiny_target()
    prompt = _prompts(1)[0]
    model, chosen, timings = choose_cpu_format(deepcopy(reference), dense)
    dense_name = str(dense).removeprefix("torch.")
    assert set(timings) == {"int4", dense_name} and all(ms > 0 for ms in timings.values())
    assert chosen == min(timings, key=lambda name: timings[name])
    packed = any(isinstance(m, Int4Linear) for m in model.modules())
    assert packed == (chosen == "int4")
    assert all(p.dtype == dense for p in model.parameters())
    engine = Engine(TargetModel(model), None, mode="ar", max_batch_size=1, max_model_len=64)
    assert len(engine.generate([prompt], SamplingParams(max_new_tokens=5))[0][0]) == 5


@pytest.mark.slow
def test_auto_serves_the_embedded_default_in_a_measured_format(caplog: pytest.LogCaptureFixture) -> None:
    """On a CPU `auto` measures int4 against the dense format (bf16 with native bf16, else float32)
    for the embedded default and says which it kept and why."""
    import logging

    from model.load.loading import DEFAULT_TARGET, load_target_as

    with caplog.at_level(logging.INFO, logger="model.load.loading"):
        model, _, dtype = load_target_as(DEFAULT_TARGET, "auto", "cpu")
    native = cpu_has_native_bf16()
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert "dtype auto:" in caplog.text and "ms int4" in caplog.text
    assert ("native bf16 on this CPU" if native else "no native bf16 on this CPU") in caplog.text
    packed = any(isinstance(m, Int4Linear) for m in model.modules())
    assert ("dtype auto: int4 weights" in caplog.text) == packed


def test_a_drafter_beside_an_int4_target_packs_its_layers_and_head_rows_and_stays_lossless() -> None:
    """`match_packing`: beside an int4 target the drafter's linear layers and its borrowed LM head
    rows are int4 too; its logits move by quantization only, and greedy `domino` output is still
    exactly the same engine's `ar` output."""
    from model.load.loading import match_packing

    model = tiny_target().to(torch.bfloat16)
    drafter = tiny_drafter(domino=True, draft_vocab_size=64).to(torch.bfloat16)
    assert match_packing(model, drafter) == 0  # a dense target leaves the drafter dense
    pack_weights(model, "int4")
    engine_ar = Engine(TargetModel(model), None, mode="ar", max_batch_size=3, max_model_len=96)
    dense_logits_engine = Engine(TargetModel(model), drafter, mode="domino", max_batch_size=3, max_model_len=96)
    hidden = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        dense_logits = drafter.base_logits(hidden)
    # Per layer q, k, v, o, gate, up, down, and fc; not the head's W1 (88 inputs) nor W2 (8 inputs).
    assert match_packing(model, drafter) == 2 * 7 + 1
    assert isinstance(drafter._lm_head, Int4Linear) and drafter._lm_head.out_features == 64
    with torch.inference_mode():
        packed_logits = drafter.base_logits(hidden)
    assert not torch.equal(packed_logits, dense_logits)
    torch.testing.assert_close(
        packed_logits.float(), dense_logits.float(), atol=0.15 * float(dense_logits.abs().max()), rtol=0
    )
    del dense_logits_engine
    domino = Engine(TargetModel(model), drafter, mode="domino", max_batch_size=3, max_model_len=96)
    prompts, budgets = _prompts(3), [10, 7, 12]
    params = [SamplingParams(max_new_tokens=n) for n in budgets]
    assert [t for t, _, _ in domino.generate(prompts, params)] == [t for t, _, _ in engine_ar.generate(prompts, params)]
