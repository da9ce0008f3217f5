"""The KV room's storage (model/kv/paged.py): host lengths that mirror the device's through an
engine's whole life, row moves and row reads, dtype casts on write, and one cache layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model.engine.engine import Engine, SamplingParams
from model.engine.runner import cache_layout
from model.engine.static import batch_buckets
from model.kv.draft_cache import DraftContextCache
from model.kv.target_cache import RaggedKVCache
from model.nn.target import TargetModel
from tests.helpers import assert_lengths_mirrored, tiny_drafter, tiny_target


def _hf_greedy(model: Any, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("static_shapes", [False, True])
def test_host_lengths_mirror_the_device_after_every_step(static_shapes: bool) -> None:
    """Rows joining (one every other step) and leaving (finished, aborted), steps that fail in the
    drafter's append and are retried row by row, prefix-cache hits, a sampled row: after every step
    each cache's host lengths equal its device lengths, in every slot. Greedy rows stay exact."""
    model = tiny_target()
    engine = Engine(
        TargetModel(model), tiny_drafter(domino=True), mode="domino", max_batch_size=3, max_model_len=96,
        draft_policy="fixed", prefix_cache_tokens=256, static_shapes=static_shapes, kv_block_size=4,
    )  # fmt: skip
    assert engine.drafter is not None
    # The drafter's context write: a decode step's append on the dynamic path, inside the verify's
    # function on the static one (and a prefill's on both).
    real_write = engine.drafter.write_context
    calls = 0

    def flaky_write(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if calls in (4, 9):  # a decode step's write, after part of it
            real_write(*args, **kwargs)
            raise RuntimeError("drafter context write failed")
        real_write(*args, **kwargs)

    engine.drafter.write_context = flaky_write  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 120, (13,), generator=g).tolist()
    prompts = [system + torch.randint(3, 120, (n,), generator=g).tolist() for n in (2, 7, 1, 11, 4, 3)]
    budgets = [9, 14, 6, 30, 11, 8]
    params = [SamplingParams(max_new_tokens=n) for n in budgets]
    params[4] = SamplingParams(max_new_tokens=budgets[4], temperature=0.8, seed=3)
    waiting = list(range(len(prompts)))
    tokens: dict[str, list[int]] = {}
    cached = 0
    steps = 0
    while waiting or engine.has_unfinished():
        if waiting and (steps % 2 == 0 or not engine.has_unfinished()):
            i = waiting.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached += out.stats.cached_prompt_tokens if out.finished else 0
        steps += 1
        if steps == 10:  # request 3 joined at step 7
            engine.abort("3")  # the long one leaves early, from the middle of the batch
        assert_lengths_mirrored(engine)
    assert calls > 9 and cached > 0
    for i in (0, 1, 2, 5):
        assert tokens[str(i)] == _hf_greedy(model, prompts[i], budgets[i]), i
    assert len(tokens["4"]) == budgets[4] and len(tokens["3"]) < budgets[3]


def test_move_row_and_row_kv_use_the_host_lengths() -> None:
    cache = DraftContextCache.contiguous(2, 3, 8, 2, 4, torch.float32, "cpu", block_size=4)
    index = cache.scatter_index(0, cache.starts(0, 2), 5)
    for layer in range(2):
        cache.write(layer, index, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    cache.set_lengths(0, [5, 3])
    assert cache.host_lengths == cache.lengths.tolist() == [5, 3, 0]
    cache.move_row(0, 2)
    assert cache.host_lengths == cache.lengths.tolist() == [5, 3, 5]
    torch.testing.assert_close(cache.row_kv(2, 0, 5), cache.row_kv(0, 0, 5), rtol=0, atol=0)
    assert cache.row_kv(2, 0, 5).shape == (2, 2, 2, 5, 4)  # [layers, keys/values, kv_heads, n, head_dim]
    cache.advance(1, torch.tensor([2, 1]), [2, 1])
    assert cache.host_lengths == cache.lengths.tolist() == [5, 5, 6]
    assert cache.attended(0, 2, 3) == 8 and cache.attended(0, 2, 3, span=8) == 8
    assert cache.attended(1, 1, 1) == 6


@pytest.mark.parametrize("cache_type", [RaggedKVCache, DraftContextCache])
def test_writes_cast_to_the_cache_dtype(cache_type: type) -> None:
    """Both caches store what they are given in their own dtype (an fp32 drafter over a bf16 cache)."""
    cache = cache_type.contiguous(1, 2, 6, 1, 4, torch.bfloat16, "cpu", block_size=4)
    k = torch.randn(2, 1, 3, 4, dtype=torch.float32)
    cache.write(0, cache.scatter_index(0, cache.starts(0, 2), 3), k, 2 * k)
    assert cache.keys[0].dtype == torch.bfloat16
    torch.testing.assert_close(cache.row_kv(1, 0, 3)[0, 1], (2 * k[1]).to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_one_cache_layout_for_both_caches(static_shapes: bool) -> None:
    engine = Engine(
        TargetModel(tiny_target()), tiny_drafter(), mode="domino", max_batch_size=3, max_model_len=40,
        static_shapes=static_shapes,
    )  # fmt: skip
    assert engine.draft_cache is not None
    slots, capacity = cache_layout(
        3, 40, max(engine.drafter.config.block_size, engine.max_drafts_per_step), static_shapes
    )
    assert slots == (batch_buckets(3)[-1] if static_shapes else 3) and capacity > 40
    for cache in (engine.cache, engine.draft_cache):
        assert (cache.num_slots, cache.capacity) == (slots, capacity)


def test_a_second_engine_keeps_the_draft_lm_head_where_the_first_bound_it() -> None:
    """Every engine binds the drafter to the target again; with a restricted draft vocabulary the
    drafter keeps its own LM-head rows. The first engine's captured graphs read that tensor, so a
    second engine must refill it in place, not allocate a new one (and free the old under them)."""
    target = TargetModel(tiny_target())
    drafter = tiny_drafter(draft_vocab_size=32)
    with torch.no_grad():
        drafter.draft_vocab_ids.copy_(torch.arange(0, 128, 4))
    first = Engine(target, drafter, mode="domino", max_batch_size=2, max_model_len=40)
    weight = drafter._lm_head_weight
    assert weight is not None
    address = weight.data_ptr()
    Engine(target, drafter, mode="dflash", max_batch_size=2, max_model_len=40, static_shapes=True)
    assert drafter._lm_head_weight is weight and weight.data_ptr() == address
    torch.testing.assert_close(weight, target.lm_head.weight[drafter.draft_vocab_ids], rtol=0, atol=0)
    prompt = [5, 9, 2, 7]
    expected = _hf_greedy(target.hf_model, prompt, 8)
    assert first.generate([prompt], SamplingParams(max_new_tokens=8))[0][0] == expected


def test_paged_writes_past_a_rows_blocks_land_in_the_trash_block() -> None:
    """A prefill group pads short rows to its longest: on paged storage those positions have no block
    of the row's own and go to the trash block, never into another row's blocks; compaction moves
    tables, not keys."""
    from model.kv.paged import PagedKV

    cache = PagedKV(1, 2, 16, 1, 2, torch.float32, "cpu", num_blocks=4, block_size=4)
    cache.set_table(0, [2])  # row 0 owns positions 0..3 only
    cache.set_table(1, [0, 1])
    k = torch.arange(1, 9, dtype=torch.float32).reshape(1, 1, 8, 1).expand(1, 1, 8, 2)
    index = cache.scatter_index(0, torch.tensor([0]), 8)  # row 0 writes 8 positions
    cache.write(0, index, k, k)
    assert torch.equal(cache.keys[0][2, :, 0, 0], torch.tensor([1.0, 2, 3, 4]))  # [block, offset, head, dim]
    assert torch.equal(cache.keys[0][0], torch.zeros(4, 1, 2)) and torch.equal(cache.keys[0][1], torch.zeros(4, 1, 2))
    assert cache.keys[0][cache.trash].abs().sum() > 0  # positions 4..7 went there
    cache.set_lengths(0, [4, 0])
    cache.move_row(0, 1)
    assert cache.host_tables[1] == [2] and cache.host_lengths[1] == 4
    keys, _ = cache.view(0, 1, 2, 4)
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([1.0, 2, 3, 4]))
