"""KV memory by blocks (model/kv/blocks.py): the pool, the rows' block tables, the budget setting,
and an engine that admits by free blocks, stays exact and gives every block back."""

from __future__ import annotations

import pytest
import torch

from model.engine.engine import Engine, SamplingParams
from model.kv.blocks import BlockPool, BlockTables, kv_budget, memory_there_is
from model.kv.sizes import parse_memory
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target
from tests.model.test_engine import _hf_greedy, _prompts


def test_pool_counts_references_and_frees_a_block_when_nobody_holds_it() -> None:
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3 and pool.num_free == 1 and pool.usage == 0.75
    assert pool.allocate(2) is None and pool.num_free == 1  # all or nothing
    pool.share(a[:1])  # a second row holds the first block (a shared prefix)
    pool.release(a)
    assert pool.num_used == 1 and pool.ref_counts[a[0]] == 1
    pool.release(a[:1])
    assert pool.num_free == 4 and pool.usage == 0.0
    with pytest.raises(ValueError, match="already free"):
        pool.release(a[:1])
    with pytest.raises(ValueError, match="only blocks in use"):
        pool.share(a[:1])
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(4, 12)


def test_tables_grow_by_whole_blocks_and_give_them_back() -> None:
    tables = BlockTables(BlockPool(5, 4))
    assert tables.reserve("a", 5) and len(tables.table("a")) == 2  # positions 0..4: two blocks of 4
    assert tables.reserve("a", 8) and len(tables.table("a")) == 2  # still fits
    assert tables.reserve("b", 12) and tables.pool.num_free == 0
    assert not tables.reserve("c", 1) and "c" not in tables  # nothing taken
    tables.free("a")
    tables.free("a")  # a row leaving twice (an error, then its removal) frees once
    assert tables.pool.num_free == 2 and tables.reserve("c", 8)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1000", 1000),
        ("0.9", 0.9),
        ("1.0", 1.0),
    ],
)
def test_memory_settings_parse(text: str, value: int | float) -> None:
    assert parse_memory(text) == value and type(parse_memory(text)) is type(value)


@pytest.mark.parametrize("text", ["", "lots", "4 GiBs", "1.5", "0.0", "-1GiB", "0B"])
def test_bad_memory_settings_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_memory(text)


def test_the_budget_takes_bytes_fractions_and_never_more_than_there_is() -> None:
    cpu = torch.device("cpu")
    there_is = memory_there_is(cpu)
    assert kv_budget(64 * 2**20, cpu) == 64 * 2**20
    assert kv_budget(0.5, cpu) == there_is // 2
    assert kv_budget(None, cpu) == 2 * 2**30  # the CPU default does not grow with the batch
    with pytest.raises(ValueError, match="DOMINO_KV_CACHE_MEMORY"):
        kv_budget(there_is + 1, cpu)


def _engine(kv_cache_memory: int | None, batch: int = 4, **kwargs: object) -> Engine:
    return Engine(
        TargetModel(tiny_target()), tiny_drafter(domino=True), mode="domino", max_batch_size=batch,
        max_model_len=96, kv_block_size=8, kv_cache_memory=kv_cache_memory, draft_policy="fixed", **kwargs,
    )  # fmt: skip


def test_a_budget_that_cannot_hold_one_row_fails_at_start_naming_the_setting() -> None:
    bytes_per_token = _engine(None).runner.bytes_per_token
    with pytest.raises(ValueError, match=r"DOMINO_KV_CACHE_MEMORY.*one row at max_model_len 96 needs"):
        _engine(40 * bytes_per_token)


@pytest.mark.parametrize("static_shapes", [False, True])
def test_rows_wait_for_blocks_and_every_output_stays_exact(static_shapes: bool) -> None:
    """A budget of two rows at max_model_len and four rows to run them in: requests wait for blocks
    while rows are free, every output is HF greedy's, every running row's reservation covers all
    it may write (verify scratch included), and every block comes back."""
    per_token = _engine(None).runner.bytes_per_token
    engine = _engine(None, static_shapes=static_shapes)
    per_row = (engine.runner.lookahead + engine.max_model_len + 7) // 8
    engine = _engine(2 * per_row * 8 * per_token, static_shapes=static_shapes)
    assert engine.kv_blocks.num_blocks == 2 * per_row and engine.runner.rows_at_max_len == 2
    lookahead = engine.runner.lookahead
    prompts = _prompts(6)
    budgets = [60, 70, 64, 30, 50, 68]
    model = tiny_target()
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=n))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    waited_with_rows_free = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        waited_with_rows_free += engine.num_waiting > 0 and engine.num_running < engine.max_batch_size
        for slot, row in enumerate(engine.rows):
            reserved = len(engine.runner.blocks.table(row.request_id)) * 8
            assert reserved >= engine.cache.host_lengths[slot] + lookahead, row.request_id
        assert engine.kv_blocks.num_used <= engine.kv_blocks.num_blocks
    assert waited_with_rows_free > 0
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == refs
    assert engine.kv_blocks.num_used == 0


def test_a_request_id_runs_once_at_a_time() -> None:
    """Block tables are kept by request id: a second request under a live id is refused, and the id
    is free again once its request finished."""
    engine = _engine(None)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="already running or waiting"):
        engine.add_request("a", [4, 5], SamplingParams(max_new_tokens=2))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("a", [4, 5], SamplingParams(max_new_tokens=2))
