"""The static-shape path (model/engine/static.py), run eagerly on the CPU: padded batch and token buckets,
attention over the whole cache, no read of device values back to the host inside a bucket's
function (what a CUDA graph needs), and token-identical output to HF generate and to the dynamic
path in every mode, batch size and policy, with rows joining mid-decode and seeded sampling."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.engine.engine import Engine, SamplingParams
from model.engine.sampling import SamplingBatch
from model.engine.static import batch_buckets, bucket_for, verify_widths
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target
from tests.model.test_engine import _hf_greedy, _prompts, oracle_engine

MODES = ("ar", "ngram", "dflash", "domino")


def _engine(model: Any, mode: str, batch: int, static: bool = True, **kwargs: Any) -> Engine:
    drafter = tiny_drafter(domino=True) if mode in ("dflash", "domino") else None
    # Small blocks, and two spans (26 and the capacity) that rows grow across.
    kwargs = {"kv_block_size": 4, "static_min_span": 16, **kwargs}
    return Engine(
        TargetModel(model), drafter, mode=mode, max_batch_size=batch, max_model_len=96, static_shapes=static, **kwargs
    )


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_and_refs(request: pytest.FixtureRequest) -> tuple[Any, list[list[int]], list[int], list[list[int]]]:
    model = tiny_target(request.param)
    prompts = _prompts(8)
    budgets = [20, 7, 13, 25, 4, 16, 11, 22]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    return model, prompts, budgets, refs


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(9) == [1, 2, 4, 8, 16]
    assert bucket_for(3, [1, 2, 4]) == 4
    assert bucket_for(5, [1, 2, 4]) is None
    assert bucket_for(1, [1, 9]) == 1 and bucket_for(2, [1, 9]) == 9
    assert verify_widths(0) == [1]
    assert verify_widths(4) == [1, 2, 3, 5]
    assert verify_widths(8) == [1, 2, 3, 5, 9]
    assert verify_widths(16) == [1, 2, 3, 5, 9, 17]
    assert verify_widths(6) == [1, 2, 3, 5, 7]


CASES = [(m, b, "fixed") for m in MODES for b in (1, 3, 8)] + [(m, 3, "adaptive") for m in MODES[1:]]


@pytest.mark.parametrize(("mode", "batch", "policy"), CASES)
def test_static_greedy_matches_hf_generate(target_and_refs, mode: str, batch: int, policy: str) -> None:
    model, prompts, budgets, refs = target_and_refs
    engine = _engine(model, mode, batch, draft_policy=policy)
    assert engine.static is not None
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in budgets])
    assert [tokens for tokens, _, _ in results] == refs
    # The buckets really ran: every decode step went through one (batch 3 pads to 4 slots).
    verify_calls = sum(f.calls for f in engine.static.verify.values())
    assert verify_calls > 0
    assert set(engine.static.verify) == {
        (rb, t, c) for rb in batch_buckets(batch) for t in engine.static.verify_widths for c in engine.static.spans
    }
    if mode in ("dflash", "domino"):
        assert sum(f.calls for f in engine.static.propose.values()) > 0
    else:
        assert not engine.static.propose
    # Rows grew across the spans: both ran.
    assert {c for (_, _, c), f in engine.static.verify.items() if f.calls} == set(engine.static.spans)


@pytest.mark.parametrize("mode", MODES)
def test_static_rows_join_mid_decode(target_and_refs, mode: str) -> None:
    """Requests join every other step, so batches grow and shrink across buckets (1 -> 2 -> 4)."""
    model, prompts, budgets, refs = target_and_refs
    engine = _engine(model, mode, 4)
    tokens: dict[str, list[int]] = {}
    pending, steps, sizes = list(range(8)), 0, set()
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=budgets[i]))
        sizes.add(engine.num_running)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    assert [tokens[str(i)] for i in range(8)] == refs
    assert {1, 2, 3, 4} <= sizes
    assert {rb for (rb, _, _), f in engine.static.verify.items() if f.calls} == {1, 2, 4}


def test_static_oracle_accepts_full_blocks() -> None:
    """Perfect drafts through the padded verify: whole blocks are accepted and counted exactly."""
    model = tiny_target()
    prompts = _prompts(3)
    refs = [_hf_greedy(model, p, 21) for p in prompts]
    engine = oracle_engine(
        TargetModel(model),
        tiny_drafter(domino=False, block_size=5),
        mode="dflash",
        max_batch_size=3,
        max_model_len=96,
        continuations={f"gen-{i}": r for i, r in enumerate(refs)},
        draft_policy="fixed",
        ngram=False,
        static_shapes=True,
    )
    results = engine.generate(prompts, SamplingParams(max_new_tokens=21))
    for (tokens, stats, _), ref in zip(results, refs):
        assert tokens == ref
        assert stats.acceptance_lengths[:4] == [5, 5, 5, 5]
    assert engine.static is not None and engine.static.verify[(4, 5, engine.cache.capacity)].calls > 0


def test_static_seeded_sampling_same_as_dynamic() -> None:
    """Seeded sampling rows (and a greedy row beside them) choose the same tokens through the
    padded buckets as through the dynamic path."""
    model = tiny_target()
    prompts = _prompts(4)
    params = [
        SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234),
        SamplingParams(max_new_tokens=17, temperature=0),
        SamplingParams(max_new_tokens=20, temperature=1.2, seed=7),
        SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5, seed=99),
    ]
    for mode in ("domino", "ngram"):
        dynamic = _engine(model, mode, 4, static=False).generate(prompts, params)
        engine = _engine(model, mode, 4, static=True)
        static = engine.generate(prompts, params)
        assert [t for t, _, _ in static] == [t for t, _, _ in dynamic]
        if mode == "domino":  # the sampling rows drafted in the buckets, the filtered ones
            assert engine.static is not None
            assert sum(f.calls for (_, _, filters), f in engine.static.propose_sampled.items() if filters) > 0


@pytest.mark.parametrize("filtered", [False, True])
def test_static_sampling_proposal_is_the_eager_one(filtered: bool) -> None:
    """The sampling proposal's bucket (a full block, the rows' parameters and uniforms as inputs)
    gives, for the slots kept, the eager proposal's drafts, probabilities, confidences and
    distributions: for a batch of greedy and sampling rows, fewer slots than the block holds."""
    engine = _engine(tiny_target(), "domino", 3)
    prompts = _prompts(3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    proposer = engine.drafter_proposer
    assert proposer is not None and proposer.static is not None and engine.num_running == 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=7 if filtered else 0),
        SamplingParams(temperature=1.3, top_p=0.9 if filtered else 1.0),
    ]
    d = proposer.num_drafts - 2
    uniforms = np.random.default_rng(0).random((3, d), dtype=np.float32)
    anchors = torch.tensor([row.anchor for row in engine.rows])
    sampling = SamplingBatch.of_params(params, uniforms, anchors.device)
    calls = sum(f.calls for f in proposer.static.propose_sampled.values())
    with torch.inference_mode():
        static = proposer.propose(0, engine.rows, anchors, sampling, d)
        assert sum(f.calls for f in proposer.static.propose_sampled.values()) == calls + 1
        proposer.static, steps = None, proposer.static
        eager = proposer.propose(0, engine.rows, anchors, sampling, d)
        proposer.static = steps
    assert static.tokens.shape == eager.tokens.shape == (3, d)
    assert static.tokens.tolist() == eager.tokens.tolist()
    for name in ("token_probs", "confidence", "draft_probs"):
        torch.testing.assert_close(getattr(static, name), getattr(eager, name), rtol=1e-4, atol=1e-6)


def test_static_verify_writes_the_drafters_context_as_the_dynamic_append() -> None:
    """A static verify writes the drafter's context of its positions inside the bucket's function
    (acceptance then only moves the lengths): after the same greedy steps, every live row's
    drafter context in the static engine holds what the dynamic path's append wrote."""
    model = tiny_target()
    prompts = _prompts(3)
    engines = [_engine(model, "domino", 3, static=static, draft_policy="fixed") for static in (False, True)]
    for engine in engines:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_new_tokens=40, ignore_eos=True))
        for _ in range(6):
            engine.step()
    dynamic, static = engines
    assert static.draft_cache is not None and dynamic.draft_cache is not None
    lengths = static.draft_cache.host_lengths[:3]
    assert lengths == dynamic.draft_cache.host_lengths[:3] and sum(lengths) >= sum(map(len, prompts)) + 12
    for slot, n in enumerate(lengths):
        torch.testing.assert_close(
            static.draft_cache.row_kv(slot, 0, n), dynamic.draft_cache.row_kv(slot, 0, n), rtol=1e-4, atol=1e-5
        )


class HostReads(TorchDispatchMode):
    """Counts ops that read a device value back to the host (.item(), int(t), bool(t), ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (
            torch.ops.aten.item.default,
            torch.ops.aten._local_scalar_dense.default,
            torch.ops.aten.is_nonzero.default,
        ):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_no_forward_and_no_row_move_reads_back_to_the_host(kind: str) -> None:
    """A CUDA graph cannot contain a host sync: the static verify and proposal functions must not
    read any device value. Nor does a dynamic forward (target or drafter) to size itself, or a row
    move: the longest row's length comes from the caches' host mirror (model/kv/paged.py)."""
    engine = _engine(tiny_target(kind), "domino", 3)
    engine.add_request("a", _prompts(1)[0], SamplingParams(max_new_tokens=6))
    engine.add_request("b", _prompts(2)[1][:5], SamplingParams(max_new_tokens=6))
    engine.step()  # the prefill: rows with real, unequal lengths
    engine.step()
    assert engine.draft_cache is not None and engine.cache.host_lengths[0] != engine.cache.host_lengths[1]
    tokens = torch.zeros(2, engine.max_drafts_per_step + 1, dtype=torch.long)
    block = torch.zeros(2, engine.drafter.config.block_size, dtype=torch.long)
    with torch.inference_mode():
        with HostReads() as static_reads:
            engine.runner.static_verify(tokens, span=engine.cache.capacity)
            engine.drafter_proposer.static_block(torch.zeros(2, dtype=torch.long), span=engine.draft_cache.capacity)
        with HostReads() as dynamic_reads:
            engine.target.forward(engine.cache, 0, tokens)
            engine.drafter.forward_block(engine.draft_cache, 0, block)
            engine.cache.move_row(1, 2)
            engine.draft_cache.move_row(1, 2)
        with HostReads() as probe:
            int(engine.cache.lengths[0])  # the check can fail: this is a read
    assert static_reads.reads == [] and dynamic_reads.reads == []
    assert probe.reads


def test_padded_slots_are_never_counted() -> None:
    """Batch 3 runs in the 4-row bucket: the padding slot's cache length never moves."""
    model = tiny_target()
    engine = _engine(model, "domino", 3, draft_policy="fixed")
    assert engine.cache.num_slots == 4
    engine.generate(_prompts(3), SamplingParams(max_new_tokens=12))
    assert engine.cache.host_lengths[3] == int(engine.cache.lengths[3]) == 0


def _block_snapshot(engine: Engine) -> list[torch.Tensor]:
    return [t.clone() for c in (engine.cache, engine.draft_cache) for k, v in c.layer_kv() for t in (k, v)]


def test_padding_rows_never_write_a_live_block() -> None:
    """Batch 3 in the 4-row bucket, with the padding slot's table pointing at a live
    row's blocks and a stale length inside them (what a departed row leaves when its blocks go to
    another row): the step vacates the slot first, so around the padded verify and proposal every
    block keeps its committed positions, and nothing but the live rows' own new positions and the
    trash block changes."""
    model = tiny_target()
    engine = _engine(model, "domino", 3, draft_policy="fixed")
    prompts = _prompts(3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=40))
    engine.step()
    engine.step()
    assert engine.num_running == 3 and engine.cache.num_slots == 4
    tables = {r.request_id: engine.runner.blocks.table(r.request_id) for r in engine.rows}
    lengths = {r.request_id: engine.cache.host_lengths[i] for i, r in enumerate(engine.rows)}
    for cache in (engine.cache, engine.draft_cache):  # slot 3 as a departed row would leave it
        cache.set_table(3, tables["1"])
        cache.set_lengths(3, [2])
    before = _block_snapshot(engine)
    calls = sum(f.calls for f in engine.static.verify.values())
    engine.step()
    assert sum(f.calls for f in engine.static.verify.values()) == calls + 1  # the padded bucket ran
    after = _block_snapshot(engine)
    assert engine.num_running == 3
    tables = {r.request_id: engine.runner.blocks.table(r.request_id) for r in engine.rows}  # grown for the step
    bs, trash = engine.cache.block_size, engine.cache.trash
    for x, y in zip(before, after):
        for b in range(trash):
            owner = next((rid for rid, t in tables.items() if b in t), None)
            # A live row writes its step's tokens at its length and on; nothing else is written.
            keep = (lengths[owner] - tables[owner].index(b) * bs) if owner is not None else bs
            assert torch.equal(x[b, : max(keep, 0)], y[b, : max(keep, 0)]), (b, owner)
    assert engine.cache.host_tables[3] == [] and engine.cache.host_lengths[3] == 0


def test_static_steps_read_what_the_longest_row_needs_not_the_capacity() -> None:
    """KV bytes read by a static step with a 1k-token row: the same at max_model_len 32k as at 2k
    (the span is taken from the longest live row; over the capacity it would be 16x)."""
    model = tiny_target()
    prompt = _prompts(1)[0] * 40  # ~1k tokens
    reads = {}
    for max_len in (2048, 32768):
        engine = Engine(TargetModel(model), None, mode="ar", max_batch_size=1, max_model_len=max_len,
                        static_shapes=True)  # fmt: skip
        engine.add_request("a", prompt, SamplingParams(max_new_tokens=4))
        engine.step()
        before = engine.kv_bytes_read
        engine.step()
        reads[max_len] = engine.kv_bytes_read - before
        assert engine.static is not None and sum(f.calls for f in engine.static.verify.values()) == 1
    assert 0 < reads[32768] <= 1.1 * reads[2048]


def test_pools_tables_and_lengths_never_move() -> None:
    """What a captured graph reads stays at one address across admission, preemption (a budget of
    about two rows), compaction, and a second engine built over the same target and drafter."""
    model = tiny_target()
    target, drafter = TargetModel(model), tiny_drafter(domino=True)

    def build(memory: int | None = None) -> Engine:
        return Engine(target, drafter, mode="domino", max_batch_size=4, max_model_len=64, static_shapes=True,
                      kv_block_size=4, static_min_span=16, kv_cache_memory=memory,
                      draft_policy="fixed")  # fmt: skip

    row_bytes = build().runner.bytes_per_token * 80  # a row at max_model_len and its lookahead, about
    engine = build(int(1.5 * row_bytes))
    caches = (engine.cache, engine.draft_cache)

    def addresses() -> list[int]:
        return [t.data_ptr() for c in caches for t in (*c.keys, *c.values, c.tables, c.lengths)]

    start = addresses()
    refs = [_hf_greedy(model, p, 30) for p in _prompts(6)]
    results = engine.generate(_prompts(6), SamplingParams(max_new_tokens=30))
    assert [t for t, _, _ in results] == refs and engine.num_preemptions > 0
    other = build(int(1.5 * row_bytes))
    assert other.generate(_prompts(2), SamplingParams(max_new_tokens=5))
    assert addresses() == start
    assert [t for t, _, _ in engine.generate(_prompts(2), SamplingParams(max_new_tokens=30))] == refs[:2]
