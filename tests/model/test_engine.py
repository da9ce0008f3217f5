"""The engine: lossless greedy decoding, acceptance accounting, stops, limits, seeds.

Over 500 lines: one file per module under test, and the engine is the biggest one (its split,
the engine-loop step, splits these tests with it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from model.engine.config import DEFAULT_TOKEN_BUDGET
from model.engine.cost_probe import CHUNK_STALL, FIRST_CHUNK, STEP_STALL, ChunkProbe
from model.engine.engine import Engine, SamplingParams
from model.engine.proposers import Proposal
from model.engine.requests import ContextLengthError
from model.engine.row import Row
from model.engine.sampling import SamplingBatch
from model.nn.target import TargetModel
from tests.helpers import assert_lengths_mirrored, tiny_drafter, tiny_target

MODES = ("ar", "dflash", "domino")


def _prompts(n: int, vocab: int = 128, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 8, 1, 12, 5, 26, 9, 4, 14][:n]
    return [torch.randint(0, vocab - 1, (length,), generator=g).tolist() for length in lengths]


def _hf_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def _engine(model, mode: str, batch: int, **kwargs) -> Engine:
    drafter = tiny_drafter(domino=True) if mode != "ar" else None
    kwargs = {"kv_block_size": 4, **kwargs}  # small blocks: rows cross many block boundaries
    return Engine(TargetModel(model), drafter, mode=mode, max_batch_size=batch, max_model_len=96, **kwargs)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target_and_refs(request):
    model = tiny_target(request.param)
    prompts = _prompts(8)
    budgets = [20, 7, 13, 25, 4, 16, 11, 22]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    return model, prompts, budgets, refs


# The fixed policy verifies every draft, so each speculative case really checks drafts; the adaptive
# policy (whose choices follow measured step times) is run too, on one batch size.
GREEDY_CASES = [(m, b, "fixed") for m in MODES for b in (1, 3, 8)] + [(m, 3, "adaptive") for m in MODES[1:]]


@pytest.mark.parametrize(("mode", "batch", "policy"), GREEDY_CASES)
def test_greedy_matches_hf_generate(target_and_refs, mode: str, batch: int, policy: str) -> None:
    """Rows of different lengths and budgets; with batch < 8 rows join as others finish."""
    model, prompts, budgets, refs = target_and_refs
    engine = _engine(model, mode, batch, draft_policy=policy)
    params = [SamplingParams(max_new_tokens=n) for n in budgets]
    results = engine.generate(prompts, params)
    for (tokens, stats, reason), ref in zip(results, refs):
        assert tokens == ref
        assert reason == "length"
        assert sum(stats.acceptance_lengths) == len(ref) - 1  # the first token comes from prefill
        if mode == "ar":
            assert stats.draft_tokens == 0 and stats.steps_with_drafts == 0
        elif policy == "fixed":
            # Every budget here leaves room for drafts after the prefill token: drafts were verified.
            assert stats.draft_tokens > 0, stats
            assert 0 < stats.steps_with_drafts <= stats.verify_steps
    if mode == "ar":
        assert engine.draft_forwards == 0
    else:
        assert engine.draft_forwards > 0  # the adaptive policy starts by drafting


@pytest.mark.parametrize("mode", MODES)
def test_rows_join_while_others_decode(target_and_refs, mode: str) -> None:
    model, prompts, budgets, refs = target_and_refs
    engine = _engine(model, mode, 4)
    tokens: dict[str, list[int]] = {}
    pending = list(range(8))
    steps = 0
    while pending or engine.has_unfinished():
        # One new request every other step, joining a batch that is mid-decode.
        if pending and steps % 2 == 0:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=budgets[i]))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        assert engine.num_running <= 4
    assert [tokens[str(i)] for i in range(8)] == refs


class OracleProposer:
    """Proposes the known target continuation, optionally corrupted at chosen draft slots (a
    model.engine.proposers.DraftProposer in the drafter's place)."""

    def __init__(self, continuations: dict[str, list[int]], vocab_size: int, corrupt: set[int] = frozenset()) -> None:
        self.continuations = continuations
        self.vocab_size = vocab_size
        self.corrupt = set(corrupt)

    def propose(
        self, lo: int, rows: Sequence[Row], anchors: torch.Tensor, sampling: SamplingBatch, num_slots: int
    ) -> Proposal:
        d = num_slots
        out = torch.zeros(len(rows), d, dtype=torch.long)
        for i, row in enumerate(rows):
            cont = self.continuations[row.request_id]
            n = len(row.output_ids)
            future = cont[n : n + d] + [0] * d
            for j in range(d):
                out[i, j] = future[j]
                if j in self.corrupt:
                    out[i, j] = (future[j] + 1) % self.vocab_size
        return Proposal(out, torch.ones(len(rows), d), None, torch.ones(len(rows), d))


def oracle_engine(
    target: TargetModel, drafter: Any, *, continuations: dict[str, list[int]], corrupt: set[int] = frozenset(), **config
) -> Engine:
    """An engine whose drafts are the oracle's (the drafter still keeps its context cache)."""
    proposer = OracleProposer(continuations, target.vocab_size, corrupt)
    return Engine(target, drafter, proposer=proposer, **config)


def _oracle(model, continuations, corrupt=frozenset(), batch=4, draft_policy="fixed", ngram=False, **kwargs) -> Engine:
    # n-gram copies off by default: these tests count exactly what the oracle's drafts do.
    return oracle_engine(
        TargetModel(model),
        tiny_drafter(domino=False, block_size=5),  # 4 drafts per block
        mode="dflash",
        max_batch_size=batch,
        max_model_len=96,
        continuations=continuations,
        corrupt=corrupt,
        draft_policy=draft_policy,
        ngram=ngram,
        **kwargs,
    )


def test_oracle_perfect_drafts_accept_full_blocks() -> None:
    model = tiny_target()
    prompts = _prompts(3)
    refs = [_hf_greedy(model, p, 21) for p in prompts]
    engine = _oracle(model, {f"gen-{i}": r for i, r in enumerate(refs)})
    results = engine.generate(prompts, SamplingParams(max_new_tokens=21))
    for (tokens, stats, _), ref in zip(results, refs):
        assert tokens == ref
        # 1 token from prefill, then 4 full blocks of 4 accepted drafts + bonus = 20 tokens.
        assert stats.acceptance_lengths == [5, 5, 5, 5]
        assert stats.accepted_tokens == 16 and stats.draft_tokens == 16
        assert stats.accepted_per_position == [4, 4, 4, 4]


def test_oracle_adaptive_policy_verifies_and_accepts_drafts() -> None:
    """The adaptive policy with drafts that are always right: it must verify (and accept) them."""
    model = tiny_target()
    prompts = _prompts(3)
    refs = [_hf_greedy(model, p, 21) for p in prompts]
    engine = _oracle(model, {f"gen-{i}": r for i, r in enumerate(refs)}, draft_policy="adaptive")
    results = engine.generate(prompts, SamplingParams(max_new_tokens=21))
    for (tokens, stats, _), ref in zip(results, refs):
        assert tokens == ref
        assert stats.draft_tokens > 0 and stats.accepted_tokens == stats.draft_tokens
        assert max(stats.acceptance_lengths) >= 3


@pytest.mark.parametrize("bad_slot", [0, 2, 3])
def test_oracle_corrupted_drafts_exact_counts_and_bonus(bad_slot: int) -> None:
    model = tiny_target()
    prompts = _prompts(3)
    refs = [_hf_greedy(model, p, 17) for p in prompts]
    engine = _oracle(model, {f"gen-{i}": r for i, r in enumerate(refs)}, corrupt={bad_slot})
    results = engine.generate(prompts, SamplingParams(max_new_tokens=17))
    for (tokens, stats, _), ref in zip(results, refs):
        # The bonus token is the target's own choice at the corrupted slot: output stays exact.
        assert tokens == ref
        # Expected accounting: each step verifies min(4, budget - 1) drafts and accepts up to the bad slot.
        remaining, lengths, per_pos = 16, [], [0, 0, 0, 0]
        while remaining > 0:
            verified = min(4, remaining - 1)
            accepted = min(bad_slot, verified)
            lengths.append(accepted + 1)
            for j in range(accepted):
                per_pos[j] += 1
            remaining -= accepted + 1
        assert stats.acceptance_lengths == lengths
        assert stats.accepted_per_position == per_pos
        assert stats.accepted_tokens == sum(lengths) - len(lengths)


def test_stop_token_mid_block_ends_exactly_there() -> None:
    model = tiny_target()
    prompt = _prompts(1)[0]
    ref = _hf_greedy(model, prompt, 30)
    # A token whose first occurrence lies inside a block (not at its end).
    pos = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and (i - 1) % 5 != 4)
    stop = ref[pos]
    engine = _oracle(model, {"gen-0": ref})
    ((tokens, stats, reason),) = engine.generate([prompt], SamplingParams(max_new_tokens=30, stop_token_ids=(stop,)))
    assert reason == "stop"
    assert tokens == ref[: pos + 1]
    # Same through EOS, and ignore_eos runs past it.
    engine = _oracle(model, {"gen-0": ref}, eos_token_ids=(stop,))
    ((tokens, _, reason),) = engine.generate([prompt], SamplingParams(max_new_tokens=30))
    assert (tokens, reason) == (ref[: pos + 1], "stop")
    engine = _oracle(model, {"gen-0": ref}, eos_token_ids=(stop,))
    ((tokens, _, reason),) = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert (tokens, reason) == (ref, "length")


def test_context_limit() -> None:
    model = tiny_target()
    engine = _engine(model, "domino", 2)
    with pytest.raises(ContextLengthError, match=r"prompt \(90 tokens\) \+ max_new_tokens \(7\) = 97 .* 96"):
        engine.add_request("a", [1] * 90, SamplingParams(max_new_tokens=7))
    # Exactly at the limit works and fills the context to the last slot.
    prompt = _prompts(1)[0][:6] * 15  # 90 tokens
    ((tokens, _, reason),) = engine.generate([prompt[:90]], SamplingParams(max_new_tokens=6))
    assert len(tokens) == 6 and reason == "length"
    assert tokens == _hf_greedy(model, prompt[:90], 6)


def test_engine_config_is_typed_and_checked() -> None:
    """One EngineConfig (the server builds it from its settings); keywords override its fields, and a
    value no engine can run with is refused naming the field."""
    from dataclasses import replace

    from model.engine.config import EngineConfig

    target = TargetModel(tiny_target())
    cfg = EngineConfig(mode="ar", max_batch_size=3, max_model_len=64)
    engine = Engine(target, None, cfg, max_batch_size=2)
    assert engine.config == replace(cfg, max_batch_size=2) and engine.max_batch_size == 2
    for field, value in [("mode", "beam"), ("draft_policy", "greedy"), ("max_batch_size", 0), ("max_drafts", 0)]:
        with pytest.raises(ValueError, match=field):
            Engine(target, None, cfg, **{field: value})
    with pytest.raises(TypeError):
        Engine(target, None, cfg, max_batchsize=2)  # a misspelt field is an error, not ignored


def test_invalid_requests_are_rejected() -> None:
    engine = _engine(tiny_target(), "ar", 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("x", [5, 128], SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("x", [], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("x", [1], SamplingParams(top_p=0.0))


def test_abort_frees_the_slot() -> None:
    model = tiny_target()
    engine = _engine(model, "domino", 1)
    engine.add_request("long", [1, 2, 3], SamplingParams(max_new_tokens=80))
    engine.add_request("next", [4, 5], SamplingParams(max_new_tokens=3))
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.num_waiting == 1
    engine.abort("long")
    outs = engine.step()
    assert any(o.request_id == "long" and o.finish_reason == "abort" for o in outs)
    # The freed slot is taken in the same step.
    assert engine.num_running == 1 and engine.num_waiting == 0
    done = {o.request_id: list(o.new_token_ids) for o in outs}
    while engine.has_unfinished():
        for o in engine.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert done["next"] == _hf_greedy(model, [4, 5], 3)


def test_seeded_sampling_same_alone_and_in_batch() -> None:
    model = tiny_target()
    prompts = _prompts(6)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = _engine(model, "domino", 1).generate([prompts[0]], seeded)[0][0]
    others = [
        SamplingParams(max_new_tokens=n, temperature=t) for n, t in zip([5, 30, 12, 9, 18], [1.0, 0, 0.7, 1.3, 0])
    ]
    batch = _engine(model, "domino", 4).generate(
        [prompts[3], prompts[1], prompts[0], *prompts[2:5]], [others[0], others[1], seeded, *others[2:5]]
    )
    assert batch[2][0] == alone
    again = _engine(model, "domino", 3).generate([prompts[0], prompts[5]], [seeded, others[1]])[0][0]
    assert again == alone
    different = _engine(model, "domino", 1).generate(
        [prompts[0]], SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    )[0][0]
    assert different != alone


def test_every_64_bit_seed_has_its_own_stream() -> None:
    """torch's CPU generator keeps only a seed's low 32 bits; the engine hashes all 64."""
    model = tiny_target()
    prompt = _prompts(1)[0]

    def sample(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=24, temperature=1.5, seed=seed)
        return _engine(model, "ar", 1).generate([prompt], params)[0][0]

    base = sample(7)
    assert sample(7) == base
    assert sample(7 + 2**32) != base
    assert sample(-(2**63)) != sample(2**63 - 1)


def test_logprobs_are_the_targets() -> None:
    model = tiny_target()
    prompt = _prompts(1)[0]
    engine = _engine(model, "domino", 2)
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=6, logprobs=3))
    tokens, lps = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            lps += o.logprobs or []
    assert len(lps) == len(tokens) == 6
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits, -1)
    for i, lp in enumerate(lps):
        assert lp.token_id == tokens[i]
        assert abs(lp.logprob - float(ref[i, tokens[i]])) < 1e-4
        assert [t for t, _ in lp.top] == ref[i].topk(3).indices.tolist()


@pytest.mark.parametrize("mode", ["ar", "domino"])
def test_prompt_logprobs_are_the_targets_forward(mode: str) -> None:
    """Scoring (lm-eval's loglikelihood): prompt tokens 1..n-1 get the target's own log-probabilities
    from the prefill, in a batch of ragged prompts split over several prefill forwards, with a prefix
    cache that must not cut the scored prompt short; max_new_tokens 0 generates nothing, and a
    generating row next to them is unchanged."""
    model = tiny_target()
    prompts = _prompts(4)
    engine = _engine(model, mode, 4, prefill_split_tokens=0, prefix_cache_tokens=64)
    engine.generate([prompts[1][:10]], SamplingParams(max_new_tokens=2))  # fills the prefix cache
    params = [
        SamplingParams(max_new_tokens=0, prompt_logprobs=2),
        SamplingParams(max_new_tokens=5, prompt_logprobs=0, logprobs=1),
        SamplingParams(max_new_tokens=7),
        SamplingParams(max_new_tokens=0, prompt_logprobs=3),
    ]
    got: dict[int, list] = {}
    outputs: list = []
    results = engine.generate(prompts, params, on_output=lambda i, o: outputs.append((i, o)))
    for i, out in outputs:
        if out.prompt_logprobs is not None:
            got[i] = out.prompt_logprobs
    assert sorted(got) == [0, 1, 3]
    assert results[0][0] == [] and results[0][2] == "length" and results[3][0] == []
    assert results[2][0] == _hf_greedy(model, prompts[2], 7)
    assert results[1][0] == _hf_greedy(model, prompts[1], 5)
    for i, lps in got.items():
        prompt = prompts[i]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)
        assert [lp.token_id for lp in lps] == prompt[1:]
        top_n = params[i].prompt_logprobs
        for t, lp in enumerate(lps):
            assert abs(lp.logprob - float(ref[t, prompt[t + 1]])) < 1e-4
            assert [tok for tok, _ in lp.top] == ref[t].topk(top_n).indices.tolist()[:top_n]
    assert engine.rows == [] and not engine.has_unfinished()


@pytest.mark.parametrize("fail_at", [1, 4])
def test_drafter_append_failing_once_keeps_caches_consistent(fail_at: int) -> None:
    """A decode step that fails in the drafter's append_context (after the verify forward) is retried
    row by row; the target cache must not have advanced for it, nor the drafter's context, so the
    retry continues exactly where the failed step started: output token-identical to the target alone."""
    model = tiny_target()
    prompts = _prompts(3)
    budgets = [14, 9, 12]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    engine = _engine(model, "domino", 3, draft_policy="fixed")
    assert engine.drafter is not None
    real_append = engine.drafter.append_context
    calls = 0

    def flaky_append(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == fail_at + 1:  # the first call is the prefill's
            real_append(*args, **kwargs)  # the write may be done in part before a failure
            raise RuntimeError("drafter append failed")
        return real_append(*args, **kwargs)

    engine.drafter.append_context = flaky_append
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=n))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        r = engine.num_running
        assert engine.draft_cache is not None
        assert engine.draft_cache.host_lengths[:r] == engine.cache.host_lengths[:r]
        assert_lengths_mirrored(engine)
    assert calls > fail_at + 1
    assert [tokens[str(i)] for i in range(3)] == refs


def test_engines_sharing_a_target_and_drafter_keep_their_own_settings() -> None:
    """Benchmarks build one engine per mode over the same target and drafter: a `dflash` engine
    built later must not turn the `domino` engine's head off, nor an `ar` engine clear its taps."""
    model = tiny_target()
    prompts = _prompts(3)
    params = SamplingParams(max_new_tokens=12)

    def run(engine: Engine) -> tuple[list[list[int]], list[list[list[int]]]]:
        """Output tokens, and every block the drafter proposed (recorded around the real call)."""
        assert engine.drafter is not None
        drafter, real = engine.drafter, engine.drafter.draft
        blocks: list[list[list[int]]] = []

        def recording(*args, **kwargs):
            result = real(*args, **kwargs)
            blocks.append(result.tokens.tolist())
            return result

        drafter.draft = recording  # type: ignore[method-assign]
        try:
            tokens = [t for t, _, _ in engine.generate(prompts, params)]
        finally:
            del drafter.draft
        return tokens, blocks

    kw = dict(draft_policy="fixed", ngram=False)
    alone = run(Engine(TargetModel(model), tiny_drafter(domino=True), mode="domino", **kw))
    head_off = run(Engine(TargetModel(model), tiny_drafter(domino=True), mode="dflash", **kw))
    assert alone[0] == head_off[0] and alone[1] != head_off[1]  # the head changes the drafts
    target, drafter = TargetModel(model), tiny_drafter(domino=True)
    domino = Engine(target, drafter, mode="domino", **kw)
    dflash = Engine(target, drafter, mode="dflash", **kw)
    Engine(target, None, mode="ar")  # no taps of its own
    assert run(domino) == alone
    assert run(dflash) == head_off


def test_prefill_groups_split_where_padding_costs_more_than_a_forward() -> None:
    from model.engine.prefill import prefill_groups

    # Two short prompts and two long ones: padding the short ones to 310 would waste ~600 tokens.
    assert prefill_groups([10, 12, 300, 310], 32) == [(0, 2), (2, 4)]
    # Similar lengths share one forward; so does everything when a forward is dear (a GPU).
    assert prefill_groups([100, 101, 103, 104], 32) == [(0, 4)]
    assert prefill_groups([10, 12, 300, 310], 10_000) == [(0, 4)]
    assert prefill_groups([7], 32) == [(0, 1)]
    # Never worse than one forward per row or one for all, and the groups cover every row in order.
    lengths = sorted([3, 40, 41, 90, 95, 200, 201, 202, 500])
    groups = prefill_groups(lengths, 32)
    assert [a for a, _ in groups][0] == 0 and groups[-1][1] == len(lengths)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(groups, groups[1:]))

    def cost(gs: list[tuple[int, int]]) -> int:
        return sum(32 + (b - a) * lengths[b - 1] for a, b in gs)

    assert cost(groups) <= min(cost([(0, len(lengths))]), cost([(i, i + 1) for i in range(len(lengths))]))


def test_prefill_of_very_different_prompt_lengths_matches_each_alone() -> None:
    """Rows admitted together are split into several prompt forwards; each row's greedy output is
    still the target's alone, and the drafter's context follows each group."""
    model = tiny_target()
    prompts = [list(range(3, 6)), list(range(10, 70)), list(range(20, 24)), list(range(5, 80))]
    refs = [_hf_greedy(model, p, 12) for p in prompts]
    for mode in ("ar", "domino"):
        engine = _engine(model, mode, 4)
        results = engine.generate(prompts, SamplingParams(max_new_tokens=12))
        assert [t for t, _, _ in results] == refs, mode


def test_split_prefill_fills_both_caches_as_one_forward_does() -> None:
    model = tiny_target()
    prompts = [list(range(3, 6)), list(range(10, 70)), list(range(20, 24)), list(range(5, 80))]
    engines = []
    for split in (32, 10**6):
        engine = _engine(model, "domino", 4, prefill_split_tokens=split)  # the same seeded drafter
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_new_tokens=4))
        engine.step()  # the prefill
        engines.append(engine)
    split, whole = engines
    assert [r.request_id for r in split.rows] == [r.request_id for r in whole.rows]
    assert split.cache.host_lengths == whole.cache.host_lengths
    assert split.draft_cache.host_lengths == whole.draft_cache.host_lengths
    for i, n in enumerate(whole.cache.host_lengths):
        for cache in ("cache", "draft_cache"):
            a, b = getattr(split, cache).row_kv(i, 0, n), getattr(whole, cache).row_kv(i, 0, n)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _shared_beginning_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 120, (21,), generator=g).tolist()
    tails = [torch.randint(3, 120, (n,), generator=g).tolist() for n in (5, 1, 9, 3, 14)]
    return [system + t for t in tails] + [system[:10] + tails[0]]  # the last shares only 10 tokens


@pytest.mark.parametrize("mode", ["ar", "domino"])
def test_prefix_cache_reuses_shared_beginnings_and_stays_exact(mode: str) -> None:
    """Prompts beginning alike share the indexed blocks (block 4: 20 of the 21 shared tokens, 8 of
    the 10 the last prompt shares) and forward the rest; every output is still the target's alone."""
    model = tiny_target()
    prompts = _shared_beginning_prompts()
    refs = [_hf_greedy(model, p, 10) for p in prompts]
    engine = _engine(model, mode, 2, prefix_cache_tokens=256)
    results = engine.generate(prompts[:1], SamplingParams(max_new_tokens=10))  # fills the cache
    results += engine.generate(prompts[1:], SamplingParams(max_new_tokens=10))
    assert [t for t, _, _ in results] == refs
    cached = [s.cached_prompt_tokens for _, s, _ in results]
    # Prompt 2 is the 21 shared tokens plus one: all 5 shared blocks. Rows admitted together
    # (2 and 3, then 4 and 5) find what earlier admissions stored.
    assert cached == [0, 20, 20, 20, 20, 8]
    assert engine.kv_blocks.num_indexed >= 5  # shared blocks, indexed in the pool: nothing copies


def test_prefix_cache_fills_both_caches_as_a_full_prefill_does() -> None:
    model = tiny_target()
    first, second = _shared_beginning_prompts()[:2]
    engines = []
    for tokens in (256, 0):
        engine = _engine(model, "domino", 2, prefix_cache_tokens=tokens)
        engine.generate([first], SamplingParams(max_new_tokens=2))
        engine.add_request("r", second, SamplingParams(max_new_tokens=4))
        engine.step()  # the prefill
        engines.append(engine)
    reused, computed = engines
    assert reused.rows[0].stats.cached_prompt_tokens == 20 and computed.rows[0].stats.cached_prompt_tokens == 0
    n = len(second)
    for cache in ("cache", "draft_cache"):
        a, b = getattr(reused, cache), getattr(computed, cache)
        assert a.host_lengths[0] == b.host_lengths[0] == int(a.lengths[0]) == n
        torch.testing.assert_close(a.row_kv(0, 0, n), b.row_kv(0, 0, n), atol=1e-5, rtol=1e-5)


def test_shared_prefix_blocks_are_never_written() -> None:
    """A prompt that begins like a running one takes that row's blocks by
    reference (the same block ids, one more reference each, no copy), and neither row ever writes
    into them: their contents are unchanged after both rows decoded, and both answers are exact."""
    model = tiny_target()
    first, second = _shared_beginning_prompts()[:2]
    engine = _engine(model, "domino", 2, prefix_cache_tokens=256)  # blocks of 4
    pool = engine.kv_blocks
    engine.add_request("a", first, SamplingParams(max_new_tokens=12))
    engine.step()
    engine.add_request("b", second, SamplingParams(max_new_tokens=12))
    engine.step()
    tables = engine.runner.blocks
    shared = tables.table("a")[:5]  # 20 of the 21 shared tokens
    assert tables.table("b")[:5] == shared and tables.table("b")[5] not in tables.table("a")
    assert [pool.ref_counts[b] for b in shared] == [2] * 5
    caches = [engine.runner.cache, engine.runner.draft_cache]
    before = [torch.stack([k[shared] for k, _ in c.layer_kv()] + [v[shared] for _, v in c.layer_kv()]) for c in caches]
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    after = [torch.stack([k[shared] for k, _ in c.layer_kv()] + [v[shared] for _, v in c.layer_kv()]) for c in caches]
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert tokens == {"a": _hf_greedy(model, first, 12)[1:], "b": _hf_greedy(model, second, 12)[1:]}
    assert pool.num_used == 0 and pool.num_indexed >= 5  # freed, but still indexed for the next prompt


# -- chunked prefill (EngineConfig.max_num_batched_tokens) ------------------------------------------


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "own-forward"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_matches_hf_generate(target_and_refs, mode: str, batch: int, policy: str, fold: bool) -> None:
    """Prompt chunks of at most 7 tokens, sharing steps with decoding rows (8 requests through
    `batch` rows: rows join and leave), carried in the verify forward or in one of their own:
    every output is still HF greedy's. The first request starts alone; the others arrive while it
    decodes. A step with no decoding row takes its prompts whole (at batch 1 every step is such)."""
    model, prompts, budgets, refs = target_and_refs
    engine = _engine(model, mode, batch, draft_policy=policy, max_num_batched_tokens=7, fold_chunks=fold)
    engine.add_request("0", prompts[0], SamplingParams(max_new_tokens=budgets[0]))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    chunked = []  # prompt tokens of each step that also decoded
    while engine.has_unfinished():
        decoding = bool(engine.rows)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if decoding:
            chunked.append(engine.last_prefill_tokens)
        if len(chunked) == 1:
            for i in range(1, len(prompts)):
                engine.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=budgets[i]))
    assert [tokens[str(i)] for i in range(len(prompts))] == refs
    assert not engine.prefilling and not engine.rows
    assert max(chunked) <= 7
    if batch > 1:  # prompts went in by chunks beside decoding rows
        assert sum(chunked) >= sum(len(p) for p in prompts[1:batch])


@pytest.mark.parametrize("fail", ["packed-forward-1", "append-1", "append-2", "append-3"])
def test_a_failure_in_a_step_carrying_chunks_is_retried_and_output_unchanged(fail: str) -> None:
    """A step whose verify forward carries prompt chunks fails once: in the forward itself, or in
    the drafter's append (the n-th call once the long prompt arrived: 1 and 3 a chunk's, 2 a
    decode's). The decode is retried row by row and the chunks go alone; no request fails and every
    output is HF greedy's."""
    model = tiny_target()
    prompts = [*_prompts(2), (_prompts(10)[6] * 2)[:40]]
    budgets = [16, 12, 6]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    engine = _engine(model, "domino", 3, draft_policy="fixed", max_num_batched_tokens=8)
    assert engine.drafter is not None
    where, n = fail.rsplit("-", 1)
    calls, failed = 0, 0
    owner, name = (engine.target, "forward_packed") if where == "packed-forward" else (engine.drafter, "append_context")
    real = getattr(owner, name)

    def flaky(*args, **kwargs):
        nonlocal calls, failed
        calls += 1
        if calls == int(n):
            failed += 1
            if where == "append":
                real(*args, **kwargs)  # the write may be done in part before a failure
            raise RuntimeError(f"{name} failed")
        return real(*args, **kwargs)

    for i, (p, b) in enumerate(zip(prompts[:2], budgets)):
        engine.add_request(str(i), p, SamplingParams(max_new_tokens=b, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    for out in engine.step():  # the first two go in whole (nothing decodes yet); the long one by chunks
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.add_request("2", prompts[2], SamplingParams(max_new_tokens=budgets[2], ignore_eos=True))
    setattr(owner, name, flaky)
    while engine.has_unfinished():
        for out in engine.step():
            assert out.finish_reason != "error", out.error
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert_lengths_mirrored(engine)
    assert failed == 1
    assert [tokens[str(i)] for i in range(3)] == refs


def test_auto_token_budget_is_the_largest_chunk_within_two_decode_steps() -> None:
    """max_num_batched_tokens="auto": with costs probed, one-row chunks are timed from 64 tokens,
    doubling, and the budget is the largest whose cost beyond a forward's fixed cost is at most
    CHUNK_STALL x a decode step of the largest batch; without a probe it is the device's default."""
    model = tiny_target()
    assert _engine(model, "domino", 3, max_num_batched_tokens="auto").token_budget == DEFAULT_TOKEN_BUDGET["cpu"]
    for mode in ("domino", "ar"):
        drafter = tiny_drafter(domino=True) if mode != "ar" else None
        engine = Engine(
            TargetModel(model), drafter, mode=mode, max_batch_size=3, max_model_len=1024,
            max_num_batched_tokens="auto", probe_costs=True,
        )  # fmt: skip
        probe = engine.chunk_probe
        assert probe is not None and engine.token_budget == probe.budget
        sizes = sorted(probe.chunk)
        assert sizes[0] == FIRST_CHUNK and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
        assert probe.fixed_seconds == max(0.0, 2 * probe.chunk[64] - probe.chunk[128])
        within = [n for n in sizes if probe.chunk[n] - probe.fixed_seconds <= CHUNK_STALL * probe.decode_seconds]
        assert within == sizes[: len(within)]  # doubling stopped at the first chunk over the line
        assert probe.budget == (within[-1] if within else FIRST_CHUNK)
        assert len(within) == len(sizes) or sizes[-1] not in within
        assert f"chunked prefill: {probe.budget} tokens a step" in engine.chunking_summary()
        assert probe.far == min(4 * probe.context, 1024 - 64) and probe.growth >= 0
    assert "off" in _engine(model, "ar", 3).chunking_summary()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        _engine(model, "ar", 3, max_num_batched_tokens="large")


def test_a_steps_chunks_are_held_to_the_streams_usual_step() -> None:
    """With the budget measured, a step's chunk tokens are what the cost model fits in what this
    step's modelled decode leaves of (1 + STEP_STALL) x the median recent decode step, between a
    quarter of the budget and what decoding left of it; with a budget as set, what decoding left."""
    model, drafter = tiny_target(), tiny_drafter(domino=True)
    kwargs = dict(mode="domino", max_batch_size=3, max_model_len=1024, probe_costs=True)
    assert Engine(TargetModel(model), drafter, max_num_batched_tokens=400, **kwargs)._chunk_budget(3, 5) == 385
    engine = Engine(TargetModel(model), drafter, max_num_batched_tokens="auto", **kwargs)
    probe, budget = engine.chunk_probe, engine.token_budget
    assert probe is not None and budget is not None
    least, left = budget // 4, budget - 3 * 5
    step_s = engine.policy.costs.verify(3, 5)
    engine.recent_decode_seconds.extend([step_s / 4] * 5)  # this step is wide: no room for a chunk
    assert engine._chunk_budget(3, 5) == least
    engine.recent_decode_seconds.extend([1e3] * 32)  # the streams step slowly: what decoding left
    assert engine._chunk_budget(3, 5) == left
    n = (least + left) // 2
    usual = (step_s + probe.token_seconds * (n + 0.5)) / (1 + STEP_STALL)  # room for n chunk tokens
    engine.recent_decode_seconds.extend([usual] * 32)
    assert engine._chunk_budget(3, 5) == n


def _decoding_two_streams(max_batch_size: int, max_new_tokens: int) -> Engine:
    """An engine with the chunk budget measured ("auto", costs probed) and two streams decoding."""
    engine = Engine(
        TargetModel(tiny_target()), tiny_drafter(domino=True), mode="domino", max_batch_size=max_batch_size,
        max_model_len=1024, max_num_batched_tokens="auto", probe_costs=True,
    )  # fmt: skip
    for i, prompt in enumerate(_prompts(2)):
        engine.add_request(f"s{i}", prompt, SamplingParams(max_new_tokens=max_new_tokens))
    while len(engine.rows) < 2:
        engine.step()
    return engine


def test_a_short_prompt_goes_whole_where_the_clock_would_cut_it() -> None:
    """With the budget measured, a prompt not begun that fits in what decoding left of the budget
    goes in one step even where the step's clock allows only a quarter of it; a longer one is cut."""
    engine = _decoding_two_streams(max_batch_size=4, max_new_tokens=200)
    budget = engine.token_budget
    assert budget is not None
    engine.recent_decode_seconds.extend([1e-6] * 32)  # the streams step fast: the clock gives the least
    width = engine.max_drafts_per_step + 1
    least, left = budget // 4, budget - 2 * width
    assert engine._chunk_budget(2, width) == least < left
    gen = torch.Generator().manual_seed(5)
    for rid, n in (("short", left), ("long", budget + 1)):
        engine.add_request(rid, torch.randint(0, 127, (n,), generator=gen).tolist(), SamplingParams(max_new_tokens=4))
    engine.step()
    assert [row.request_id for row in engine.rows] == ["s0", "s1", "short"]  # all its prompt in one step
    (long,) = engine.prefilling
    assert long.prefilled == 0  # the step's room went to the short prompt
    engine.step()
    assert 0 < long.prefilled <= least + 1  # a long prompt is cut by the clock


def test_chunks_shrink_when_steps_carrying_them_overran_their_plan() -> None:
    """A step carrying chunks records its time over its forward as the cost models planned it; the next chunks
    are sized as if the streams stepped that much faster (the median of the last 4, within [0.5, 2])."""
    engine = _decoding_two_streams(max_batch_size=3, max_new_tokens=64)
    assert engine.chunk_overrun == 1.0 and not engine.recent_chunk_overruns
    long = torch.randint(0, 127, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.add_request("long", long, SamplingParams(max_new_tokens=1))
    chunks = engine.num_prefill_chunks
    engine.step()  # the decode carries the prompt's first chunk in its forward
    assert engine.num_prefill_chunks == chunks + 1 and engine.prefilling and len(engine.recent_chunk_overruns) == 1
    assert engine.recent_chunk_overruns[0] > 0
    engine.recent_chunk_overruns.extend([50.0] * 4)
    assert engine.chunk_overrun == 2.0  # one odd run of steps cannot stop chunking
    probe = engine.chunk_probe
    assert probe is not None
    usual = engine.policy.costs.verify(3, 5) + probe.token_seconds * 40
    for overrun in (0.8, 1.3):
        engine.recent_chunk_overruns.clear()
        engine.recent_decode_seconds.extend([usual / overrun] * 32)
        as_if_faster = engine._chunk_budget(3, 5)
        engine.recent_chunk_overruns.extend([overrun] * 4)
        engine.recent_decode_seconds.extend([usual] * 32)
        assert engine._chunk_budget(3, 5) == as_if_faster


@pytest.mark.parametrize("growth", [0.0, 0.001, 0.02])
def test_chunk_cost_grows_with_the_prefix_and_chunks_are_the_most_that_fit(growth: float) -> None:
    """ChunkProbe.cost: n tokens after a prefix cost n budget tokens up to the probe's context, more
    after it; tokens_within is the most tokens whose cost fits (at least one)."""
    probe = ChunkProbe(128, 0.1, (8, 3), context=256, far=1024, growth=growth)
    assert probe.cost(100, 0) == 100 and probe.cost(100, 200) == 100
    for prefix in (0, 256, 700, 1400, 5000):
        for budget in (1, 7, 32, 96, 128.5):
            n = probe.tokens_within(budget, prefix)
            assert n >= 1 and (n == 1 or probe.cost(n, prefix) <= budget)
            assert probe.cost(n + 1, prefix) > budget
            if growth == 0:
                assert n == max(1, int(budget))
    assert probe.cost(100, 1400) > probe.cost(100, 700) > probe.cost(100, 256) if growth else True


def test_decoding_rows_emit_every_step_while_a_long_prompt_prefills() -> None:
    """Two rows decode while a 60-token prompt arrives: it goes in in chunks (budget 8) over several
    steps, and every one of those steps gives each decoding row at least one token."""
    model = tiny_target()
    engine = _engine(model, "domino", 3, draft_policy="fixed", max_num_batched_tokens=8)
    short = _prompts(2)
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", p, SamplingParams(max_new_tokens=60, ignore_eos=True))
    while engine.num_running < 2 or engine.prefilling:
        engine.step()
    long_prompt = (_prompts(10)[6] * 3)[:60]
    engine.add_request("long", long_prompt, SamplingParams(max_new_tokens=5))
    chunked_steps = 0
    while engine.prefilling or engine.num_waiting:
        outputs = {o.request_id: o for o in engine.step()}
        chunked_steps += 1
        for rid in ("s0", "s1"):
            assert rid in outputs and outputs[rid].new_token_ids, (chunked_steps, rid)
    assert chunked_steps >= 3
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens["long"][-4:] == _hf_greedy(model, long_prompt, 5)[1:]


def test_chunked_prefill_keeps_seeded_sampling_prompt_logprobs_and_sharing() -> None:
    """Seeded sampled rows draw at their last chunk what they draw unchunked; a prompt scored for its
    logprobs gets the same scores; prompts beginning alike share blocks once the first is in."""
    model = tiny_target()
    prompts = _shared_beginning_prompts()[:4]
    params = [
        SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, seed=11),
        SamplingParams(max_new_tokens=9, temperature=1.1, seed=12),
        SamplingParams(max_new_tokens=6, prompt_logprobs=2),
        SamplingParams(max_new_tokens=10),
    ]
    scores: dict[str, Any] = {}

    def keep_scores(label: str) -> Any:
        def on_output(i: int, out: Any) -> None:
            if out.prompt_logprobs is not None:
                scores[label] = out.prompt_logprobs

        return on_output

    def run(engine: Engine, label: str) -> list[Any]:  # the first prompt first: the others share its blocks
        first = engine.generate(prompts[:1], params[:1])
        return first + engine.generate(prompts[1:], params[1:], keep_scores(label))

    whole = run(_engine(model, "domino", 4, prefix_cache_tokens=256), "whole")
    chunked = run(_engine(model, "domino", 4, prefix_cache_tokens=256, max_num_batched_tokens=5), "chunked")
    assert [t for t, _, _ in chunked] == [t for t, _, _ in whole]
    assert scores["chunked"] == scores["whole"] and len(scores["whole"]) == len(prompts[2]) - 1
    assert [s.cached_prompt_tokens for _, s, _ in chunked] == [0, 20, 0, 20]  # the scored prompt shares none


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_a_step_carrying_prompt_chunks_reads_the_device_once(sampling: str) -> None:
    """Decode and prompt chunks in one step (issue 53 with issue 54's one copy): the decode's results
    and the first token of a prompt its last chunk finished come back in one device read, and what
    the chunks need on the device travels in non-blocking copies only."""
    from bench.host_reads import ReadCounter

    model = tiny_target()
    cpu = torch.device("cpu")
    counter = ReadCounter(cpu)
    temperature = 0.0 if sampling == "greedy" else 1.0
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=temperature)
    with counter:  # residency tracking from the engine's construction on (bench/host_reads.py)
        engine = _engine(model, "domino", 3, draft_policy="fixed", max_num_batched_tokens=8)
        for i, p in enumerate(_prompts(2)):
            engine.add_request(f"s{i}", p, params)
        engine.step()  # both go in whole: nothing decodes yet
        engine.add_request("long", (_prompts(10)[6] * 2)[:30], params)
    counter.counting = True
    carried = []  # (device reads, blocking copies to the device, prompt tokens) of each step with chunks
    while engine.prefilling or engine.num_waiting:
        reads, copies = counter.total("device:read"), counter.total("device:h2d")
        with counter:
            engine.step()
        carried.append((counter.total("device:read") - reads, counter.total("device:h2d") - copies))
    assert len(carried) >= 3 and engine.num_prefill_chunks >= 3
    assert carried == [(1, 0)] * len(carried), (counter.counts["device:read"], counter.counts["device:h2d"])
