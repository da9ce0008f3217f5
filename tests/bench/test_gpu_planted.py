"""bench.gpu_check.planted: the acceptance schedule, the planted copy target, and the oracle end to end at 1/16
width on the CPU."""

from __future__ import annotations

import pytest
import torch

from bench.common import build_target, scaled_shapes
from bench.gpu_check.planted import (
    COPY_OFFSET,
    accepted_at,
    check_planted,
    copy_continuation,
    copy_match,
    expected_acceptance,
    plant_copy,
)
from tests.helpers import planted_records


@pytest.mark.parametrize("tau", [1.0, 2.5, 4.0, 7.17, 17.0])
def test_schedule_mean_is_tau(tau: float) -> None:
    steps = 1000
    right = [accepted_at(tau, s) for s in range(steps)]
    assert all(0 <= a <= 16 for a in right)
    assert abs(sum(right) / steps - (tau - 1)) < 1e-2
    assert set(right) <= {int(tau - 1), int(tau - 1) + 1}  # as even as possible


def test_expected_acceptance_cuts_the_last_steps_to_the_budget() -> None:
    # 40 tokens: 1 from the prefill, nine steps of 3 drafts + bonus, then 2 drafts left (+ bonus).
    assert expected_acceptance(4.0, 40, 16) == [4] * 9 + [3]
    assert expected_acceptance(1.0, 5, 16) == [1, 1, 1, 1]
    assert expected_acceptance(7.17, 40, 16) == [7, 7, 7, 7, 7, 4]
    assert expected_acceptance(17.0, 40, 16) == [17, 17, 5]  # a full block of 16 drafts + bonus
    assert expected_acceptance(4.0, 10, 0) == [1] * 9  # ar: no drafts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planted_target_copies_from_its_context(dtype: torch.dtype) -> None:
    """The greedy next token is the one 32 positions back, with a wide margin, in bf16 too; and it
    comes through attention: change that earlier token and the prediction follows it."""
    target = build_target(scaled_shapes(16, 9), dtype, torch.device("cpu"))
    plant_copy(target, seed=3, embed_rms=32.0)
    check = check_planted(target, seed=4)
    assert check["greedy_is_copy"] == 1.0 and check["min_margin"] > 1.0, check
    ids = torch.randint(0, target.vocab_size, (1, COPY_OFFSET + 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = target.hf_model(input_ids=ids).logits[0, -1].argmax()
        assert int(before) == int(ids[0, -COPY_OFFSET])
        ids[0, -COPY_OFFSET] = (ids[0, -COPY_OFFSET] + 1) % target.vocab_size
        after = target.hf_model(input_ids=ids).logits[0, -1].argmax()
    assert int(after) == int(ids[0, -COPY_OFFSET]) != int(before)


def test_copy_continuation_and_match() -> None:
    seq = list(range(40))
    assert copy_continuation(seq, 32, 3) == [8, 9, 10]
    assert copy_continuation(list(range(4)), 4, 6) == [0, 1, 2, 3, 0, 1]  # past one period: periodic
    prompt = list(range(32))
    assert copy_match([prompt], [[0, 1, 2]]) == 1.0 and copy_match([prompt], [[0, 5]]) == 0.5


def test_oracle_decodes_at_the_scheduled_acceptance_on_the_cpu() -> None:
    """Eager and graph engines (on the CPU: static buckets run eagerly) at tau 1, 4 and 7.17: every
    row decodes the target's greedy continuation with exactly the scheduled acceptance lengths."""
    max_new = 24
    recs = planted_records(
        "cpu", ["eager", "graph"], [1.0, 4.0, 7.17], batch=2, max_new_tokens=max_new, max_model_len=64
    )
    keys = {(r["mode"], r["variant"], r["tau_target"]) for r in recs}
    assert keys == {("ar", v, 1.0) for v in ("eager", "graph")} | {
        ("domino", v, t) for v in ("eager", "graph") for t in (1.0, 4.0, 7.17)
    }
    for r in recs:
        assert r["copy_match"] == 1.0 and r["capacity"] >= 64, r
        num_drafts = 0 if r["mode"] == "ar" else 16
        assert r["acceptance_lengths_row0"] == expected_acceptance(r["tau_target"], max_new, num_drafts), r
        assert r["tau"] == pytest.approx(r["tau_expected"])
        assert r["decoded_tokens"] == 2 * (max_new - 1) and r["tokens_per_s"] > 0
        if r["variant"] == "graph":
            # On the CPU the graph engine builds every bucket eagerly: the static path did run
            # (batch buckets 1 and 2; verify T in {1, 2, 3, 5, 9, 17} and three proposals: greedy,
            # sampling rows with and without top-k/top-p; or T = 1 for ar).
            assert r["warmup"]["graphs"] == 0 and r["warmup"]["eager"] == (2 if r["mode"] == "ar" else 18)
        else:
            assert r["warmup"] is None
