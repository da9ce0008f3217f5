"""Prompt-lookup (n-gram) proposals: the index, the learned acceptance, and lossless verification
(greedy token identity and sampling distributions) when the engine mixes them with the drafter's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.engine.costs import NgramAcceptance
from model.engine.engine import Engine, SamplingParams
from model.engine.ngram import NgramIndex
from model.engine.sampling import sample_with_uniform, verify_sampling
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target
from tests.model.test_engine import _hf_greedy
from tests.model.test_policy import PriorCosts
from tests.model.test_sampling import ALPHA, _chi_square, _exact_joint, chisquare_pvalue

# -- the index --------------------------------------------------------------------------------------


def test_longest_suffix_wins_and_the_latest_occurrence_of_it() -> None:
    ix = NgramIndex(max_n=3, min_n=1)
    #         0  1  2  3  4  5  6  7  8  9 10
    ix.extend([5, 1, 2, 7, 9, 1, 2, 8, 3, 1, 2])
    # Suffix (1, 2) occurred ending at 3 and 7; (3, 1, 2) never before: the 2-gram's latest wins.
    prop = ix.propose(3)
    assert prop is not None and prop.match_len == 2 and prop.tokens == [8, 3, 1]
    ix.extend([8])  # now the suffix (1, 2, 8) matched at 5..7 -> continues with 3, 1, 2
    prop = ix.propose(2)
    assert prop is not None and prop.match_len == 3 and prop.tokens == [3, 1]


def test_no_match_min_n_and_no_self_match() -> None:
    ix = NgramIndex(max_n=4, min_n=2)
    ix.extend([1, 2, 3, 4])
    assert ix.propose(4) is None  # every suffix is new
    ix.extend([1])
    assert ix.propose(4) is None  # (4, 1) is new and unigrams are below min_n
    ix.extend([2])
    prop = ix.propose(3)
    assert prop is not None and prop.match_len == 2 and prop.tokens == [3, 4, 1]
    assert ix.propose(0) is None
    with pytest.raises(ValueError):
        NgramIndex(max_n=1, min_n=2)


def test_a_loop_is_copied_past_the_end_of_the_sequence() -> None:
    ix = NgramIndex(max_n=2, min_n=1)
    ix.extend([4, 6, 4, 6, 4])
    prop = ix.propose(6)
    # Suffix (6, 4) last ended at 3 -> tokens[3:] = [6, 4], continued with its own period.
    assert prop is not None and prop.tokens == [6, 4, 6, 4, 6, 4]


def _brute_force(seq: list[int], max_n: int, min_n: int, k: int) -> tuple[list[int], int] | None:
    """The definition, spelled out: longest suffix with an earlier occurrence, its latest one."""
    for n in range(min(max_n, len(seq)), min_n - 1, -1):
        suffix = seq[len(seq) - n :]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                e = start + n
                out = seq[e : e + k]
                while len(out) < k:
                    out.append(out[len(out) - (len(seq) - e)])
                return out, n
    return None


def test_incremental_index_matches_the_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 5, (300,), generator=gen).tolist()
    ix = NgramIndex(max_n=4, min_n=1)
    pos = 0
    while pos < len(seq):
        step = int(torch.randint(1, 4, (1,), generator=gen))
        ix.extend(seq[pos : pos + step])
        pos += step
        prop = ix.propose(5)
        want = _brute_force(seq[:pos], 4, 1, 5)
        assert (None if prop is None else (prop.tokens, prop.match_len)) == want


def test_acceptance_estimate_learns_and_fades() -> None:
    acc = NgramAcceptance(max_n=3, max_slots=4, prior_weight=2.0, decay=0.9)
    assert np.allclose(acc.estimate(2, 3, 0.3), np.full(3, 0.3))
    for _ in range(100):
        acc.observe(2, verified=3, accepted=1)  # slot 0 always accepted, slot 1 always rejected
    est = acc.estimate(2, 3, 0.3)
    assert est[0] > 0.85 and est[1] < 0.1 and abs(float(est[2]) - 0.3) < 1e-9  # slot 2 never reached
    assert float(acc.estimate(1, 1, 0.3)[0]) == pytest.approx(0.3)  # other match lengths: untouched
    for _ in range(60):
        acc.observe(2, verified=1, accepted=0)
    assert float(acc.estimate(2, 1, 0.3)[0]) < 0.1  # old successes faded


# -- verification of a deterministic proposal ------------------------------------------------------


def test_onehot_draft_single_position_matches_p() -> None:
    """q one-hot on the draft x: accepted with probability p(x), else resampled from p without x."""
    torch.manual_seed(0)
    n, v = 200_000, 6
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    # Copies are fixed per context, not drawn: mostly one token (a uniform mix of drafts would hide
    # a rejection that resamples from p instead of the residual), some rows a zero-mass token.
    drafts = torch.tensor([1, 1, 1, 3, 3, 5])[torch.randint(0, 6, (n,))]
    target = torch.stack([p, p]).expand(n, 2, v)
    accepted, bonus = verify_sampling(
        target,
        drafts[:, None],
        torch.ones(n, 1),
        None,
        torch.ones(n, dtype=torch.long),
        torch.rand(n, 1),
        torch.rand(n),
        onehot=torch.ones(n, dtype=torch.bool),
    )
    first = torch.where(accepted == 1, drafts, bonus)
    counts = torch.bincount(first, minlength=v)
    assert counts[5] == 0
    pvalue = chisquare_pvalue(counts[:5].tolist(), (p[:5] * n).tolist())
    print(f"one-hot single position: p-value {pvalue:.3g}")
    assert pvalue > ALPHA
    assert abs(accepted.float().mean() - p[drafts].mean()) < 0.01


def test_mixed_rows_with_a_restricted_draft_vocabulary() -> None:
    """Drafter rows (q over a 4-token draft vocabulary) and one-hot rows (drafts outside it) in one
    call: each row's first token is distributed as p."""
    torch.manual_seed(1)
    n, v = 200_000, 6
    vocab_ids = torch.tensor([1, 2, 3, 4])
    p = torch.tensor([0.1, 0.35, 0.05, 0.25, 0.15, 0.1])
    q = torch.tensor([0.4, 0.1, 0.3, 0.2])  # over vocab_ids
    onehot = torch.arange(n) % 2 == 0
    drafted = vocab_ids[sample_with_uniform(q.expand(n, 4), torch.rand(n))]
    copied = torch.tensor([0, 5])[torch.arange(n) % 4 // 2]  # tokens the draft vocabulary lacks
    drafts = torch.where(onehot, copied, drafted)
    q_of_draft = torch.zeros(v).index_copy_(0, vocab_ids, q)[drafts]
    accepted, bonus = verify_sampling(
        torch.stack([p, p]).expand(n, 2, v),
        drafts[:, None],
        torch.where(onehot, torch.ones(n), q_of_draft)[:, None],
        q.expand(n, 1, 4),
        torch.ones(n, dtype=torch.long),
        torch.rand(n, 1),
        torch.rand(n),
        vocab_ids,
        onehot=onehot,
    )
    first = torch.where(accepted == 1, drafts, bonus)
    for name, rows in (("one-hot", onehot), ("drafter", ~onehot)):
        counts = torch.bincount(first[rows], minlength=v)
        pvalue = chisquare_pvalue(counts.tolist(), (p * int(rows.sum())).tolist())
        print(f"mixed batch, {name} rows: p-value {pvalue:.3g}")
        assert pvalue > ALPHA


# -- the engine: greedy output is the target's -----------------------------------------------------


def _repeating_prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so the context offers n-gram matches from the first step."""
    g = torch.Generator().manual_seed(11)
    phrases = [torch.randint(0, 127, (length,), generator=g).tolist() for length in (5, 9, 4, 7, 6)[:n]]
    return [p * reps for p, reps in zip(phrases, (3, 2, 4, 3, 2))]


def _engine(model, mode: str, batch: int, **kwargs) -> Engine:
    drafter = tiny_drafter(domino=True) if mode in ("domino", "dflash") else None
    engine = Engine(TargetModel(model), drafter, mode=mode, max_batch_size=batch, max_model_len=128, **kwargs)
    # Judge the policy by the prior step costs of the real default target: this toy's measured
    # costs are noise on a shared CPU, and the tests must see the same choices every run.
    engine.policy.costs = PriorCosts()
    return engine


@pytest.fixture(scope="module")
def greedy_refs():
    model = tiny_target()
    prompts = _repeating_prompts(5)
    budgets = [40, 25, 33, 12, 30]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    return model, prompts, budgets, refs


@pytest.mark.parametrize("mode", ["ngram", "domino", "dflash"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_with_ngram_matches_hf_generate(greedy_refs, mode: str, batch: int) -> None:
    """With batch 3 rows join while others decode; the copies are verified and some accepted."""
    model, prompts, budgets, refs = greedy_refs
    engine = _engine(model, mode, batch)
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in budgets])
    for (tokens, stats, reason), ref in zip(results, refs):
        assert tokens == ref
        assert reason == "length"
        assert sum(stats.acceptance_lengths) == len(ref) - 1
        assert sum(stats.draft_tokens_by_proposer.values()) == stats.draft_tokens
        assert sum(stats.accepted_tokens_by_proposer.values()) == stats.accepted_tokens
    drafted = sum(s.draft_tokens_by_proposer.get("ngram", 0) for _, s, _ in results)
    accepted = sum(s.accepted_tokens_by_proposer.get("ngram", 0) for _, s, _ in results)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    if mode == "ngram":
        assert engine.draft_forwards == 0 and engine.drafter is None


def test_rows_join_mid_decode_with_ngram() -> None:
    model = tiny_target()
    prompts = _repeating_prompts(5)
    budgets = [20, 60, 40, 10, 30]  # prompt 1's greedy continuation falls into a loop: copies pay there
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    for mode in ("ngram", "domino"):
        engine = _engine(model, mode, 3)
        tokens: dict[str, list[int]] = {}
        proposers: set[str | None] = set()
        pending = list(range(5))
        steps = 0
        while pending or engine.has_unfinished():
            if pending and steps % 3 == 0:  # one request joins every third step
                i = pending.pop(0)
                engine.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=budgets[i]))
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.step_accepted:
                    proposers.add(out.step_proposer)
            steps += 1
        assert [tokens[str(i)] for i in range(5)] == refs, mode
        assert "ngram" in proposers, mode


def test_ngram_off_means_drafter_only() -> None:
    model = tiny_target()
    prompts = _repeating_prompts(2)
    results = _engine(model, "domino", 2, ngram=False).generate(prompts, SamplingParams(max_new_tokens=20))
    assert all("ngram" not in s.draft_tokens_by_proposer for _, s, _ in results)
    with pytest.raises(ValueError, match="needs a drafter"):
        Engine(TargetModel(model), None, mode="domino")


# -- the engine: seeded sampling reproduces, sampling is distributed as the target's ---------------


@pytest.mark.parametrize("mode", ["ngram", "domino"])
def test_seeded_sampling_with_ngram_same_alone_and_in_batch(mode: str) -> None:
    model = tiny_target()
    prompts = _repeating_prompts(5)
    seeded = SamplingParams(max_new_tokens=30, temperature=0.6, top_k=20, seed=77)
    alone = _engine(model, mode, 1).generate([prompts[0]], seeded)[0]
    assert alone[1].draft_tokens_by_proposer.get("ngram", 0) > 0  # the copies were in play
    others = [SamplingParams(max_new_tokens=n, temperature=t) for n, t in zip([9, 30, 14, 22], [1.0, 0, 0.7, 0])]
    batch = _engine(model, mode, 3).generate([prompts[1], prompts[0], *prompts[2:5]], [others[0], seeded, *others[1:]])
    assert batch[1][0] == alone[0]
    different = _engine(model, mode, 1).generate(
        [prompts[0]], SamplingParams(max_new_tokens=30, temperature=0.6, top_k=20, seed=78)
    )
    assert different[0][0] != alone[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "temperature", "top_k", "prior"),
    [
        ("ngram", 1.0, 0, None),
        ("ngram", 0.7, 0, 0.9),  # a confident prior: copies of several tokens per step
        ("domino", 1.0, 0, 0.9),  # drafter and copies in one batch, restricted draft vocabulary
        ("domino", 1.0, 3, 0.9),  # with the default prior the drafter wins every choice here
    ],
    ids=["ngram-T1", "ngram-T0.7-long", "domino+ngram-T1-long", "domino+ngram-top_k3"],
)
def test_sampling_with_ngram_matches_target_distribution(
    mode: str, temperature: float, top_k: int, prior: float | None
) -> None:
    vocab, depth, n = 8, 3, 20_000
    model = tiny_target(vocab=vocab, seed=3)
    drafter = None
    if mode == "domino":
        # Draft vocabulary {0..4}: copies of 5 and 6 are outside it.
        drafter = tiny_drafter(vocab=vocab, block_size=4, std=0.3, seed=4, draft_vocab_size=5)
    engine = Engine(TargetModel(model), drafter, mode=mode, max_batch_size=128, max_model_len=24)
    if prior is not None:
        engine.policy.ngram_prior = prior
    prompt = [1, 2, 3, 5, 6, 1, 2, 3, 5, 6, 1, 2]  # the continuation 3, 5, 6, ... is on offer
    params = [SamplingParams(max_new_tokens=5, temperature=temperature, top_k=top_k, seed=i) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    counts: dict[tuple, int] = {}
    for tokens, _, _ in results:
        key = tuple(tokens[:depth])
        counts[key] = counts.get(key, 0) + 1
    by = {
        who: (
            sum(s.draft_tokens_by_proposer.get(who, 0) for _, s, _ in results),
            sum(s.accepted_tokens_by_proposer.get(who, 0) for _, s, _ in results),
        )
        for who in ("ngram", "drafter")
    }
    drafted, accepted = by["ngram"]
    # Copies were verified, and both branches (accept, reject-then-resample) ran.
    assert 0.03 < accepted / drafted < 0.97, by
    if prior is not None:
        assert max(max(s.acceptance_lengths) for _, s, _ in results) >= 3
    if mode == "domino":
        assert by["drafter"][0] > 0, by

    expected = _exact_joint(model, prompt, depth, temperature, top_k, 1.0)
    pvalue = _chi_square(counts, expected, n)
    print(f"{mode} T={temperature} top_k={top_k} prior={prior}: by proposer {by}, p-value {pvalue:.3g}")
    assert pvalue > ALPHA
    # Power: the same samples reject a slightly different distribution with the same support.
    wrong = _exact_joint(model, prompt, depth, temperature * 1.15, top_k, 1.0)
    assert set(wrong) == set(expected)
    wrong_p = _chi_square(counts, wrong, n)
    print(f"  against T x 1.15: p-value {wrong_p:.3g}")
    assert wrong_p < ALPHA


def test_metrics_split_draft_counters_by_proposer() -> None:
    from prometheus_client import generate_latest

    from app.metrics import Metrics

    m = Metrics("tiny", 4, 2)
    m.num_draft_tokens["ngram"].inc(3)
    m.num_accepted_tokens["ngram"].inc(2)
    text = generate_latest(m.registry).decode()
    # Both series exist from the start (rate() and sums work before the first copy is accepted).
    assert 'domino_spec_decode_num_draft_tokens_total{model_name="tiny",proposer="ngram"} 3.0' in text
    assert 'domino_spec_decode_num_accepted_tokens_total{model_name="tiny",proposer="ngram"} 2.0' in text
    assert 'domino_spec_decode_num_accepted_tokens_total{model_name="tiny",proposer="drafter"} 0.0' in text
