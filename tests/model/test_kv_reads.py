"""The KV-bytes-read counter (model/nn/attention.py): what a step's attention reads is the longest
live row's span on the dynamic path, and the step's span on the static one."""

from __future__ import annotations

from model.engine.engine import Engine, SamplingParams
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target

PROMPTS = [[5, 9, 13, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5]]  # 5 and 9 tokens


def _decode_step_reads(mode: str, **kwargs) -> tuple[int, Engine]:
    """Bytes the engine's second step (the first decode step of both rows) read."""
    model = tiny_target()
    drafter = tiny_drafter(domino=True) if mode != "ar" else None
    engine = Engine(TargetModel(model), drafter, mode=mode, max_batch_size=2, max_model_len=512, **kwargs)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()  # prefill
    assert len(engine.rows) == 2
    before = engine.kv_bytes_read
    engine.step()
    return engine.kv_bytes_read - before, engine


def _bytes(engine: Engine, rows: int, tokens: int) -> int:
    """Keys and values of `tokens` positions of `rows` rows in every target layer."""
    target = engine.target
    return target.num_layers * rows * tokens * 2 * target.kv_heads * target.head_dim * target.dtype.itemsize


def test_a_dynamic_step_reads_the_longest_live_row() -> None:
    reads, engine = _decode_step_reads("ar")
    # One new token per row, attended over the longer row's 9 cached positions plus itself.
    assert reads == _bytes(engine, rows=2, tokens=9 + 1)


def test_a_static_step_reads_its_span() -> None:
    """max_model_len 512: one span, the capacity (the smallest is 512 positions)."""
    reads, engine = _decode_step_reads("ar", static_shapes=True)
    assert engine.static is not None and engine.static.spans == [engine.runner.cache.capacity]
    assert reads == _bytes(engine, rows=2, tokens=engine.runner.cache.capacity)


def test_drafter_reads_are_counted() -> None:
    dynamic, engine = _decode_step_reads("domino", draft_policy="fixed", ngram=False)
    target_only, _ = _decode_step_reads("ar")
    assert dynamic > target_only  # the drafter's context and a verify of several tokens
    static, _ = _decode_step_reads("domino", static_shapes=True, draft_policy="fixed", ngram=False)
    assert static > 10 * dynamic  # 512 positions a row, against about 20
