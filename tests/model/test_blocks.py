"""KV memory by blocks (model/kv/blocks.py): the pool, the rows' block tables, the budget setting,
and an engine that admits by free blocks, stays exact and gives every block back."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model.engine.engine import Engine, SamplingParams
from model.kv.blocks import BlockPool, BlockTables, IndexedBlock, kv_budget, memory_there_is
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


def test_freed_prompt_blocks_stay_indexed_until_allocated_least_recently_used_first() -> None:
    tables = BlockTables(BlockPool(6, 4))
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks leave the last token to forward
    assert tables.share_prefix("a", prompt) == 0 and tables.reserve("a", 16)
    tables.index_prefix("a", prompt)
    a = tables.table("a")
    assert tables.pool.num_indexed == 3  # the 4th block holds the last prompt token: never shared
    assert tables.share_prefix("b", prompt[:9] + [99, 98]) == 8  # two blocks, by reference
    assert tables.table("b") == a[:2] and tables.pool.ref_counts[a[0]] == 2
    tables.free("a")
    tables.free("b")
    assert tables.pool.num_free == 6 and tables.pool.num_indexed == 3  # free, and still indexed
    assert tables.share_prefix("c", prompt + [7]) == 12 and tables.table("c") == a[:3]
    tables.free("c")
    # Allocating takes never-used blocks first, then the prompt's last blocks before its first.
    assert tables.reserve("d", 12) and tables.pool.num_indexed == 3
    assert tables.reserve("e", 4) and tables.pool.num_indexed == 2 and tables.table("e") == [a[2]]
    assert tables.share_prefix("f", prompt) == 8


def test_an_indexed_key_whose_tokens_differ_is_never_shared() -> None:
    """A hash collision: the key matches, the tokens do not."""
    pool = BlockPool(4, 4)
    prompt = [1, 2, 3, 4, 5]
    table = pool.allocate(2)
    assert table is not None
    pool.index(prompt, table)
    (block,) = pool.indexed
    pool.indexed[block] = IndexedBlock(pool.indexed[block].key, (9, 9, 9, 9), None)
    assert pool.lookup(prompt) == []


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


def _engine(kv_cache_memory: int | None, batch: int = 4, mode: str = "domino", **kwargs: object) -> Engine:
    drafter = None if mode in ("ar", "ngram") else tiny_drafter(domino=mode == "domino")
    return Engine(
        TargetModel(tiny_target()), drafter, mode=mode, max_batch_size=batch, max_model_len=64, kv_block_size=8,
        kv_cache_memory=kv_cache_memory, draft_policy="fixed", **kwargs,
    )  # fmt: skip


def _small_engine(rows: int, mode: str = "domino", **kwargs: object) -> Engine:
    """An engine whose KV budget holds `rows` rows at max_model_len (64 tokens), with 4 rows to run."""
    big = _engine(None, mode=mode, **kwargs)
    per_row = (big.runner.lookahead + big.max_model_len + 7) // 8
    return _engine(rows * per_row * 8 * big.runner.bytes_per_token, mode=mode, **kwargs)


def test_a_budget_that_cannot_hold_one_row_fails_at_start_naming_the_setting() -> None:
    bytes_per_token = _engine(None).runner.bytes_per_token
    with pytest.raises(ValueError, match=r"DOMINO_KV_CACHE_MEMORY.*one row at max_model_len 64 needs"):
        _engine(40 * bytes_per_token)


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Every request at once; when a decode step starts, every row's blocks cover what it holds and
    what the step may write (verify scratch included: invisible on slot storage, corruption on paged
    storage)."""
    decode = engine._decode

    def checked_decode(*args: Any, **kwargs: Any) -> Any:
        for slot, row in enumerate(engine.rows):
            reserved = len(engine.runner.blocks.table(row.request_id)) * 8
            assert reserved >= engine.cache.host_lengths[slot] + engine.runner.lookahead, row.request_id
        return decode(*args, **kwargs)

    engine._decode = checked_decode  # type: ignore[method-assign]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens[out.request_id] += out.new_token_ids
    assert engine.kv_blocks.num_used == 0  # every block came back
    return [tokens[f"r{i}"] for i in range(len(prompts))]


PROMPTS = _prompts(6)
BUDGETS = [40, 45, 50, 30, 44, 38]


@pytest.mark.parametrize("mode", ["ar", "ngram", "dflash", "domino"])
def test_preemption_by_recompute_keeps_every_output_exact(mode: str) -> None:
    """Six requests, four rows, blocks for two rows at max_model_len: rows are preempted (the newest
    first) and recomputed, and every output is still HF greedy's, token for token."""
    engine = _small_engine(2, mode=mode)
    assert engine.runner.rows_at_max_len == 2
    model = tiny_target()
    refs = [_hf_greedy(model, p, n) for p, n in zip(PROMPTS, BUDGETS)]
    assert _run(engine, PROMPTS, [SamplingParams(max_new_tokens=n) for n in BUDGETS]) == refs
    assert engine.num_preemptions > 0


def test_seeded_sampling_through_preemption_is_what_it_is_without() -> None:
    """A preempted row resumes with no new random draw: seeded rows sample the same text as in an
    engine with room for every row."""
    params = [SamplingParams(max_new_tokens=n, temperature=0.9, top_k=20, seed=100 + i) for i, n in enumerate(BUDGETS)]
    roomy = _run(_engine(None), PROMPTS, params)
    small = _small_engine(2)
    assert _run(small, PROMPTS, params) == roomy
    assert small.num_preemptions > 0


def test_a_preempted_row_scores_its_prompt_once() -> None:
    """Echo scoring (prompt_logprobs) comes with the first output only: a recomputed row does not
    send it again."""
    engine = _small_engine(2)
    for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS)):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=n, prompt_logprobs=0))
    scored: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            scored[out.request_id] = scored.get(out.request_id, 0) + (out.prompt_logprobs is not None)
    assert engine.num_preemptions > 0
    assert scored == {f"r{i}": 1 for i in range(len(PROMPTS))}


def test_pools_hold_the_budget_not_the_batch_times_the_length() -> None:
    """max_batch_size 64 x max_model_len 2048 with a budget of 8 x 2048 tokens: the pools hold the
    budget's bytes (a slot per row would hold 64 x 2048 tokens'), and 64 short rows all run in one step."""
    probe = Engine(TargetModel(tiny_target()), tiny_drafter(), mode="domino", max_batch_size=1, max_model_len=64)
    budget = 8 * 2048 * probe.runner.bytes_per_token
    engine = Engine(
        TargetModel(tiny_target()), tiny_drafter(), mode="domino", max_batch_size=64, max_model_len=2048,
        kv_cache_memory=budget, draft_policy="fixed",
    )  # fmt: skip
    held = engine.cache.nbytes + engine.draft_cache.nbytes
    trash = 16 * engine.runner.bytes_per_token  # the one block no row owns
    assert held <= budget + trash < 64 * 2048 * engine.runner.bytes_per_token
    prompts = [[(5 * i) % 120 + 3, 7, 9] for i in range(64)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=6))
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.num_running)
    assert most == 64 and engine.num_preemptions == 0
