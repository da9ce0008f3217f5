"""bench/forward_breakdown.py's parts on a tiny random target (the benchmark runs the embedded default)."""

from __future__ import annotations

import pytest
import torch

from bench.forward_breakdown import layer_ms, linear_layers, profiled_split, step_ms
from model.engine.engine import Engine
from model.load.loading import pack_weights
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target


def test_the_parts_time_what_they_name() -> None:
    target = TargetModel(tiny_target())
    linears = linear_layers(target)
    assert len(linears) == 4 * 7 + 1 and linears[-1] is target.lm_head
    ms, nbytes = layer_ms(linears, target.dtype, warmup=1, repeats=3)
    assert ms > 0 and nbytes == sum(m.weight.numel() * 4 for m in linears)  # fp32, the LM head included
    prompt = list(range(3, 40))
    for mode, drafter in (("ar", None), ("domino", tiny_drafter())):
        engine = Engine(target, drafter, mode=mode, max_batch_size=1, max_model_len=200)
        ms, tokens = step_ms(engine, prompt, warmup=1, repeats=4)
        assert ms > 0 and (tokens == 1.0 if mode == "ar" else tokens >= 1.0)
        assert not engine.has_unfinished()  # the row is gone: the engine can measure the next
    split = profiled_split(engine, prompt, steps=3)
    parts = ("matmuls", "attention", "other ops", "in no op")
    assert split["matmuls"] > 0 and split["attention"] > 0 and split["other ops"] > 0
    assert sum(split[p] for p in parts) == pytest.approx(split["profiled step"])
    assert not engine.has_unfinished()


def test_packed_layers_count_their_packed_bytes() -> None:
    """int4: half a byte a weight plus a bf16 scale and zero per 32; the LM head int8 plus a scale a row."""
    model = tiny_target().to(torch.bfloat16)
    dense = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    pack_weights(model, "int4")
    linears = linear_layers(TargetModel(model))
    assert len(linears) == len(dense)
    ms, nbytes = layer_ms(linears, torch.bfloat16, warmup=1, repeats=2)
    *body, (head_in, head_out) = dense
    expected = sum(i * o // 2 + (i // 32) * o * 4 for i, o in body) + head_in * head_out + 2 * head_out
    assert ms > 0 and nbytes == expected
