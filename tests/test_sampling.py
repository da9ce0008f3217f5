"""Speculative sampling preserves the target's distribution (statistical tests)."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from model.engine import Engine, SamplingParams
from model.sampling import processed_probs, sample_with_uniform, verify_sampling
from model.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target

ALPHA = 1e-3  # a correct sampler fails with this probability; seeds are fixed, so the test is deterministic


def chisquare_pvalue(observed: list[float], expected: list[float]) -> float:
    """Pearson chi-square goodness of fit; expected is rescaled to the observed total."""
    total_obs, total_exp = sum(observed), sum(expected)
    stat = 0.0
    for o, e in zip(observed, expected):
        e = e * total_obs / total_exp
        stat += (o - e) ** 2 / e
    return float(chi2.sf(stat, len(observed) - 1))


def _chi_square(counts: dict[tuple, int], expected_probs: dict[tuple, float], n: int) -> float:
    """Chi-square p-value, pooling cells whose expected count is below 5 (the test's validity rule)."""
    obs, exp = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for cell, prob in expected_probs.items():
        if prob * n < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += prob * n
        else:
            obs.append(counts.get(cell, 0))
            exp.append(prob * n)
    unexpected = sum(c for cell, c in counts.items() if cell not in expected_probs)
    assert unexpected == 0, "sampled a sequence the target gives zero probability"
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    return chisquare_pvalue(obs, exp)


def test_verify_sampling_single_position_matches_p() -> None:
    """One draft slot, explicit p and q: the committed token is distributed as p."""
    torch.manual_seed(0)
    n, v = 200_000, 6
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    drafts = sample_with_uniform(q.expand(n, v), torch.rand(n))
    target = torch.stack([p, p]).expand(n, 2, v)
    accepted, bonus = verify_sampling(
        target,
        drafts[:, None],
        q[drafts][:, None],
        q.expand(n, 1, v),
        torch.ones(n, dtype=torch.long),
        torch.rand(n, 1),
        torch.rand(n),
    )
    first = torch.where(accepted == 1, drafts, bonus)
    counts = torch.bincount(first, minlength=v)
    assert counts[5] == 0
    pvalue = chisquare_pvalue(counts[:5].tolist(), (p[:5] * n).tolist())
    assert pvalue > ALPHA
    # The expected acceptance rate of standard speculative sampling is sum(min(p, q)).
    assert abs(accepted.float().mean() - torch.minimum(p, q).sum()) < 0.01


def _exact_joint(model, prompt: list[int], depth: int, temperature: float, top_k: int, top_p: float) -> dict:
    """Exact probability of every first-`depth`-token sequence under the target's sampling."""
    vocab = model.config.vocab_size
    out: dict[tuple, float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=depth - 1):
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1 :]
            probs = processed_probs(logits, torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p))
            prefix_prob = 1.0
            for i, tok in enumerate(seq):
                prefix_prob *= float(probs[i, tok])
            if prefix_prob == 0:
                continue
            for last in range(vocab):
                pr = prefix_prob * float(probs[depth - 1, last])
                if pr > 0:
                    out[(*seq, last)] = pr
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "policy", "threshold"),
    [
        (1.0, 1.0, 0, "fixed", 0.0),
        (0.7, 0.8, 0, "fixed", 0.0),
        (1.0, 1.0, 3, "fixed", 0.0),
        # Draft counts chosen per step from the drafter's confidence must stay lossless too.
        (1.0, 1.0, 0, "adaptive", 0.0),
        (1.0, 1.0, 0, "fixed", 0.45),
    ],
    ids=["T1", "T0.7-top_p0.8", "top_k3", "T1-adaptive", "T1-threshold"],
)
def test_speculative_sampling_matches_target_distribution(
    temperature: float, top_p: float, top_k: int, policy: str, threshold: float
) -> None:
    vocab, depth, n = 8, 3, 20_000
    model = tiny_target(vocab=vocab, seed=3)
    drafter = tiny_drafter(vocab=vocab, block_size=4, std=0.3, seed=4)  # its q differs from the target's p
    engine = Engine(
        TargetModel(model),
        drafter,
        mode="domino",
        max_batch_size=128,
        max_model_len=16,
        draft_policy=policy,
        draft_threshold=threshold,
    )
    prompt = [1, 2, 3]
    params = [
        SamplingParams(max_new_tokens=5, temperature=temperature, top_p=top_p, top_k=top_k, seed=i) for i in range(n)
    ]
    results = engine.generate([prompt] * n, params)
    counts: dict[tuple, int] = {}
    for tokens, _, _ in results:
        key = tuple(tokens[:depth])
        counts[key] = counts.get(key, 0) + 1
    drafted = sum(r[1].draft_tokens for r in results)
    accepted = sum(r[1].accepted_tokens for r in results)
    # Both branches (accept and reject-then-resample) are exercised, over multi-draft blocks.
    assert 0.03 < accepted / drafted < 0.97, (accepted, drafted)
    assert max(max(r[1].acceptance_lengths) for r in results) >= (3 if policy == "fixed" and not threshold else 2)
    if policy != "fixed" or threshold:
        # The rule really varied the number of drafts per step.
        assert 0 < drafted < sum(r[1].verify_steps for r in results) * drafter.config.num_drafts

    expected = _exact_joint(model, prompt, depth, temperature, top_k, top_p)
    pvalue = _chi_square(counts, expected, n)
    print(f"T={temperature} top_p={top_p} top_k={top_k}: acceptance {accepted / drafted:.3f}, p-value {pvalue:.3g}")
    assert pvalue > ALPHA
    # The test has power: the same samples are rejected against a slightly different distribution.
    wrong = _exact_joint(model, prompt, depth, temperature * 1.15, top_k, top_p)
    if set(wrong) == set(expected):
        assert _chi_square(counts, wrong, n) < ALPHA
