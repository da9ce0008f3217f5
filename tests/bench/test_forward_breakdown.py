"""bench/forward_breakdown.py's parts on a tiny random target (the benchmark runs the embedded default)."""

from __future__ import annotations

import pytest
import torch

from bench.forward_breakdown import profiled_split, step_ms, weights_ms
from model.engine.engine import Engine
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target


def test_the_parts_time_what_they_name() -> None:
    target = TargetModel(tiny_target())
    ms, nbytes = weights_ms(target, warmup=1, repeats=3)
    linears = [m for m in target.hf_model.modules() if isinstance(m, torch.nn.Linear)]
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
