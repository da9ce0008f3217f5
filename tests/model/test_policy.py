"""The adaptive draft policy: calibrating the drafter's confidence against observed acceptance."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from model.engine.costs import AcceptanceCalibration, StepCosts
from model.engine.engine import SamplingParams
from model.engine.policy import best_shared_drafts
from tests.helpers import tiny_target
from tests.model.test_engine import _engine, _hf_greedy, _oracle, _prompts


class PriorCosts(StepCosts):
    """Step costs frozen at the prior curve (no measurements)."""

    def observe_verify(self, batch: int, tokens: int, seconds: float) -> None:
        pass

    def observe_draft(self, batch: int, seconds: float) -> None:
        pass


def test_short_verify_never_estimated_dearer_than_a_measured_longer_one() -> None:
    costs = StepCosts()
    costs.observe_verify(1, 2, 0.050)  # a noisy sample
    costs.observe_verify(1, 5, 0.020)
    assert costs.verify(1, 1) <= 0.020 and costs.verify(1, 2) == 0.020 and costs.verify(1, 5) == 0.020
    assert costs.verify(1, 9) > 0.020  # longer than anything measured: scaled up by the prior


def test_stalls_on_a_shared_machine_do_not_move_a_cost_estimate() -> None:
    # Interference only adds time: a few stalled forwards among many normal ones must not make a
    # verify width look dear (a moving average did, and the policy then stopped drafting).
    costs = StepCosts()
    for _ in range(12):
        costs.observe_verify(1, 3, 0.020)
        costs.observe_draft(1, 0.002)
    for _ in range(3):
        costs.observe_verify(1, 3, 0.400)
        costs.observe_draft(1, 0.100)
    assert costs.verify(1, 3) == 0.020 and costs.draft(1) == 0.002
    # A lasting change of speed is followed once it fills most of the window.
    for _ in range(14):
        costs.observe_verify(1, 3, 0.040)
    assert costs.verify(1, 3) == 0.040


def test_calibration_learns_over_confidence() -> None:
    cal = AcceptanceCalibration(bins=10, prior_weight=8.0, decay=1.0)
    conf = np.full((4, 3), 0.95, dtype=np.float32)
    # Untrained: the raw confidence stands.
    assert np.allclose(cal.calibrate(conf), conf)
    # 200 rows: slot 0 accepted 10 % of the time; later slots reached only after an acceptance.
    for step in range(50):
        accepted = np.array([1 if (step * 4 + r) % 10 == 0 else 0 for r in range(4)])
        cal.observe(conf, np.full(4, 3), accepted)
    est = float(cal.calibrate(np.array([[0.95]], dtype=np.float32))[0, 0])
    assert 0.08 < est < 0.2, est
    # Bins that saw nothing keep the raw value.
    assert abs(float(cal.calibrate(np.array([[0.35]], dtype=np.float32))[0, 0]) - 0.35) < 1e-6
    # Only reached slots count: 200 rows reached slot 0, 20 reached slot 1 (all rejected there).
    assert abs(float(cal.reached.sum()) - 220) < 1e-9 and abs(float(cal.accepted.sum()) - 20) < 1e-9


def test_calibration_keeps_a_well_calibrated_drafter_and_fades_old_evidence() -> None:
    cal = AcceptanceCalibration(bins=10, prior_weight=8.0, decay=0.9)
    gen = np.random.default_rng(0)
    for _ in range(300):
        conf = np.full((8, 1), 0.75, dtype=np.float32)
        accepted = (gen.random(8) < 0.75).astype(np.int64)
        cal.observe(conf, np.ones(8, dtype=np.int64), accepted)
    assert abs(float(cal.calibrate(np.array([[0.75]], dtype=np.float32))[0, 0]) - 0.75) < 0.1
    # With decay 0.9 the total weight stays bounded (about 8 / (1 - 0.9)), so new traffic wins quickly.
    assert float(cal.reached.sum()) < 100


def test_calibrated_confidence_turns_drafting_off_when_it_does_not_pay() -> None:
    costs = StepCosts()
    conf = np.full((1, 4), 0.9, dtype=np.float32)
    budget = np.array([100])
    assert best_shared_drafts(conf, budget, costs)[0] > 0
    cal = AcceptanceCalibration(decay=1.0)
    for _ in range(100):
        cal.observe(conf, np.array([4]), np.array([0]))
    assert best_shared_drafts(cal.calibrate(conf), budget, costs)[0] == 0


def test_adaptive_engine_stops_paying_for_confidently_wrong_drafts() -> None:
    """The oracle reports confidence 1.0 but its first draft is always wrong: the adaptive policy
    learns that and verifies (almost) no drafts, while a perfect oracle keeps full blocks."""
    model = tiny_target()
    prompts = _prompts(2)
    # A tiny target verifies 5 tokens as cheaply as 1, where any acceptance pays: judge the policy
    # against the step costs of the real default target (the prior curve), not this toy's.
    refs = [_hf_greedy(model, p, 60) for p in prompts]
    conts = {f"gen-{i}": r for i, r in enumerate(refs)}
    wrong = _oracle(model, conts, corrupt={0}, draft_policy="adaptive")
    wrong.policy.costs = PriorCosts()
    results = wrong.generate(prompts, SamplingParams(max_new_tokens=60))
    assert [t for t, _, _ in results] == refs
    steps = sum(s.verify_steps for _, s, _ in results)
    drafted = sum(s.draft_tokens for _, s, _ in results)
    assert drafted <= 0.3 * steps, (drafted, steps)  # uncalibrated: 4 drafts every step
    # Pauses back off: the drafter itself runs on only a few of the ~60 decode steps.
    assert wrong.draft_forwards <= 20, wrong.draft_forwards

    right = _oracle(model, conts, draft_policy="adaptive")
    right.policy.costs = PriorCosts()
    results = right.generate(prompts, SamplingParams(max_new_tokens=60))
    assert [t for t, _, _ in results] == refs
    lengths = [x for _, s, _ in results for x in s.acceptance_lengths]
    assert sum(lengths) / len(lengths) > 3.0, lengths
    # Drafting pays here, so it never pauses: the drafter runs on every decode step of the batch
    # but the few plain ones that measured a plain step at this batch size.
    probes = sum(right.policy.plain_probes.values())
    assert 0 < probes <= 3 * len(right.policy.plain_probes)
    assert right.draft_forwards == max(s.verify_steps for _, s, _ in results) - probes


def test_prior_curve_follows_where_the_target_runs() -> None:
    # Sampling rows decide by the prior alone: with a bandwidth-bound target (bf16, GPUs) a verify
    # over a whole block costs about one plain step, so a confident drafter drafts further.
    from model.engine.costs import (
        BANDWIDTH_BOUND_VERIFY_CURVE,
        CPU_BF16_VERIFY_CURVE,
        CPU_FP32_VERIFY_CURVE,
        CPU_INT4_FP32_VERIFY_CURVE,
        CPU_INT4_VERIFY_CURVE,
        prior_curve_for,
    )
    from model.engine.policy import stopping_drafts

    assert prior_curve_for("cpu", torch.float32) is CPU_FP32_VERIFY_CURVE
    assert prior_curve_for("cpu", torch.bfloat16) is CPU_BF16_VERIFY_CURVE
    assert prior_curve_for("cuda:0", torch.float32) is BANDWIDTH_BOUND_VERIFY_CURVE
    # Packed int4 weights: the kernel's time grows with its rows, with native bf16 or without.
    assert prior_curve_for("cpu", torch.bfloat16, int4=True) is CPU_INT4_VERIFY_CURVE
    assert prior_curve_for("cpu", torch.float32, int4=True) is CPU_INT4_FP32_VERIFY_CURVE
    confidence = np.full((1, 8), 0.6)
    budget = np.array([8])
    on_cpu_fp32 = int(stopping_drafts(confidence, budget, curve=CPU_FP32_VERIFY_CURVE)[0])
    bandwidth_bound = int(stopping_drafts(confidence, budget, curve=BANDWIDTH_BOUND_VERIFY_CURVE)[0])
    assert bandwidth_bound > on_cpu_fp32 >= 1


def test_same_batch_estimates_scale_by_tokens_per_forward() -> None:
    """At batch 8 on a CPU in bf16 a forward over 16 tokens costs ~1.15x one over 8 (the GEMMs
    leave their flat region), where at batch 1 two tokens cost ~1.01x one: an unmeasured plain
    step is estimated from the tokens in the forward, not from T alone (which made every width
    look as cheap as T = 1)."""
    from model.engine.costs import CPU_BF16_VERIFY_CURVE

    costs = StepCosts(prior=CPU_BF16_VERIFY_CURVE)
    for _ in range(3):
        costs.observe_verify(8, 2, 0.140)
        costs.observe_verify(1, 2, 0.065)
    assert costs.verify(8, 1) < 0.140 / 1.1  # 16 -> 8 tokens per forward
    assert costs.verify(1, 1) > 0.065 / 1.05  # 2 -> 1 token: about the same


def test_adaptive_policy_measures_a_plain_step_at_each_batch_size() -> None:
    """While drafting pays the policy never decodes plainly, so without probes the plain step's
    cost at a batch size stays the prior's guess: a few greedy steps per batch size go plain."""
    model = tiny_target()
    prompts = _prompts(3)
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, [30, 12, 20])]
    engine = _oracle(model, {f"gen-{i}": r for i, r in enumerate(refs)}, draft_policy="adaptive")
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=n) for n in (30, 12, 20)])
    assert [t for t, _, _ in results] == refs
    sizes = engine.policy.plain_probes
    assert set(sizes) <= {1, 2, 3} and 3 in sizes
    for batch in sizes:
        assert engine.policy.costs.verify_n.get((batch, 1), 0) >= min(3, sizes[batch])
    # Sampling rows are never probed: their draft counts must not depend on the batch.
    sampling = _engine(model, "domino", 1, draft_policy="adaptive")
    sampling.generate([prompts[0]], SamplingParams(max_new_tokens=12, temperature=0.8, seed=3))
    assert sampling.policy.plain_probes == {}


def _policy_state(engine: Any) -> list[Any]:
    """Everything the policy (and the rows' own copy records) could learn, as plain values."""
    p = engine.policy
    rows = [r for r in engine.rows if r.ngram_acceptance is not None]
    return [
        p.skip_steps, p.no_gain_streak, p.pause_len, p.draft_width, dict(p.plain_probes), p.drafter_gain,
        p.recent_confidence.tolist(),
        [None if r.draft_confidence is None else r.draft_confidence.tolist() for r in engine.rows],
        p.ngram_acceptance.reached.tolist(), p.ngram_acceptance.accepted.tolist(),
        p.calibration.reached.tolist(), p.calibration.accepted.tolist(), dict(p.costs.verify_s), dict(p.costs.draft_s),
        p.sampling_calibration.reached.tolist(), p.sampling_calibration.accepted.tolist(),
        [(r.ngram_acceptance.reached.tolist(), r.ngram_acceptance.accepted.tolist()) for r in rows],
    ]  # fmt: skip


def test_the_policys_queries_change_nothing_and_observe_learns() -> None:
    """plan, copy_estimates, drafter_rows and choose are queries: asked twice, they answer the same
    and leave the policy as it was; only observe (and the measured costs) change what it knows. Run
    over greedy and seeded sampling rows with copies, a random drafter (so the policy narrows and
    pauses) and plain probes."""
    model = tiny_target()
    loop = [5, 9, 14, 3, 77, 21, 8, 40]
    prompts = [loop * 3, _prompts(2)[1], loop * 2 + [5, 9]]
    refs = [_hf_greedy(model, p, 40) for p in prompts]
    engine = _engine(model, "domino", 3, draft_policy="adaptive", ngram=True)
    policy = engine.policy
    calls: dict[str, int] = {}
    learned = 0

    def query(name: str) -> None:
        real = getattr(policy, name)

        def asked_twice(*args: Any) -> Any:
            before = _policy_state(engine)
            first, second = real(*args), real(*args)
            assert _policy_state(engine) == before, name
            assert repr(first) == repr(second), name
            calls[name] = calls.get(name, 0) + 1
            return first

        setattr(policy, name, asked_twice)

    for name in ("plan", "copy_estimates", "drafter_rows", "choose"):
        query(name)
    real_observe = policy.observe

    def observe(step: Any) -> None:
        nonlocal learned
        before = _policy_state(engine)
        real_observe(step)
        learned += _policy_state(engine) != before

    policy.observe = observe
    params = [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, temperature=0.9, seed=4)]
    results = engine.generate(prompts, [params[0], params[1], params[0]])
    assert results[0][0] == refs[0] and results[2][0] == refs[2]  # greedy rows stay exact
    assert calls["plan"] == calls["copy_estimates"] >= 30 and calls["choose"] == calls["plan"]
    assert learned >= calls["plan"] // 2


def test_costs_measured_at_start_up_are_interpolated_between_the_cells() -> None:
    """A GPU reads the weights once per forward and pays little per row and token. Probed at batch
    1 and 16 (what the engine does at start-up), the cells in between are interpolated from the
    measured ones, where the prior extrapolated linearly past 33 tokens per forward and made wide
    verifies look ~10x dearer at batch 16: the policy then verifies more drafts there."""
    from model.engine.costs import BANDWIDTH_BOUND_VERIFY_CURVE

    def gpu(batch: int, tokens: int) -> float:
        return 0.005 + 1e-5 * batch * tokens

    widths = [1, 2, 3, 5, 9, 17]
    seeded = StepCosts(prior=BANDWIDTH_BOUND_VERIFY_CURVE)
    seeded.seed({(b, t): [gpu(b, t)] * 3 for b in (1, 16) for t in widths}, {1: [0.001] * 3, 16: [0.002] * 3})
    for b, t in [(8, 5), (4, 17), (12, 9), (16, 4)]:
        assert abs(seeded.verify(b, t) / gpu(b, t) - 1) < 0.05, (b, t, seeded.verify(b, t), gpu(b, t))
    # Measured at batch 1 only (steps seen before a batch of 16 ran): the prior's extrapolation.
    prior_only = StepCosts(prior=BANDWIDTH_BOUND_VERIFY_CURVE)
    for t in widths:
        for _ in range(3):
            prior_only.observe_verify(1, t, gpu(1, t))
    assert prior_only.verify(16, 17) > 5 * gpu(16, 17)
    confidence, budget = np.full((16, 16), 0.8), np.full(16, 100)
    wide, _ = best_shared_drafts(confidence, budget, seeded)
    narrow, _ = best_shared_drafts(confidence, budget, prior_only)
    assert wide > narrow + 2, (wide, narrow)


def test_engine_probes_its_step_costs_before_serving() -> None:
    """With probe_costs the engine times verify forwards at batch 1 and its largest batch over every
    verify width, and a drafter block per batch, before any request: the policy starts from those
    cells (no plain probes needed there), the caches are left empty and output is unchanged."""
    from model.engine.costs import TRUSTED_SAMPLES
    from model.engine.static import verify_widths

    model = tiny_target()
    prompts = _prompts(3)
    refs = [_hf_greedy(model, p, 12) for p in prompts]
    engine = _engine(model, "domino", 3, draft_policy="adaptive", probe_costs=True)
    probe = engine.cost_probe
    assert probe is not None and probe.seconds > 0
    widths = verify_widths(engine.max_drafts_per_step)
    assert set(probe.verify) == {(b, t) for b in (1, 3) for t in widths} and set(probe.draft) == {1, 3}
    assert all(len(s) == TRUSTED_SAMPLES and min(s) > 0 for s in [*probe.verify.values(), *probe.draft.values()])
    assert engine.policy.costs.verify_n[(3, 1)] == TRUSTED_SAMPLES and engine.policy.costs.draft_n[3] == TRUSTED_SAMPLES
    assert "step costs measured" in probe.summary()
    for cache in (engine.cache, engine.draft_cache):
        assert cache is not None and cache.host_lengths == [0] * len(cache.host_lengths)
        assert cache.lengths.tolist() == [0] * len(cache.host_lengths)
        # Every block a row can own is as allocated (zeros): the probe wrote only into the trash block.
        assert all(float(kv[: cache.trash].abs().sum()) == 0 for kv in [*cache.keys, *cache.values])
    results = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [t for t, _, _ in results] == refs
    assert 3 not in engine.policy.plain_probes  # the batch-3 plain step was measured at start-up
    # Off (the engines tests and benchmarks build by default) and in `ar` mode, nothing is probed.
    assert _engine(model, "domino", 3).cost_probe is None
    assert _engine(model, "ar", 3, probe_costs=True).cost_probe is None


class LinearCosts(PriorCosts):
    """A verify over T tokens per row costs T plain steps and a drafter block half of one: no draft
    can pay for itself."""

    def verify(self, batch: int, tokens: int) -> float:
        return float(tokens)

    def draft(self, batch: int) -> float:
        return 0.5


def test_sampling_rows_without_a_seed_pause_drafting_that_does_not_pay() -> None:
    """The policy decides before a step's drafts exist, so sampling rows without a seed choose with
    the batch by measured costs, like greedy rows (lossless either way): where plain decoding is
    faster they verify no drafts and drafting pauses. A seeded row keeps its row-local rule on the
    prior curve, whatever the costs, so its seed gives the same text in any batch."""
    model = tiny_target()
    prompts = _prompts(2)
    free = _engine(model, "domino", 2, draft_policy="adaptive", ngram=False)
    free.policy.costs = LinearCosts()
    results = free.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0))
    steps = max(s.verify_steps for _, s, _ in results)
    assert steps >= 30 and sum(s.draft_tokens for _, s, _ in results) == 0
    assert free.draft_forwards <= steps // 3, (free.draft_forwards, steps)

    seeded = _engine(model, "domino", 2, draft_policy="adaptive", ngram=False)
    seeded.policy.costs = LinearCosts()
    results = seeded.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=5))
    assert seeded.draft_forwards == max(s.verify_steps for _, s, _ in results)
    assert sum(s.draft_tokens for _, s, _ in results) > 0


def test_a_new_request_gets_one_probe_not_a_fresh_start_where_drafting_does_not_pay() -> None:
    """Where drafting never pays (costs linear in tokens, a random drafter), each admission shortens
    the current pause so that the new text is tried soon, but keeps the pause's length: one drafting
    step that does not pay pauses again. (Restarting from the shortest pause cost three drafting
    steps per admission: at concurrency 8 that was most of `domino`'s loss to `ar`.)"""
    model = tiny_target()
    prompts = _prompts(8)
    engine = _engine(model, "domino", 2, draft_policy="adaptive", ngram=False)
    engine.policy.costs = LinearCosts()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert all(len(tokens) == 24 for tokens, _, _ in results)
    # 3 failing drafting steps before the first pause, then at most one probe per admission (7
    # here; 16 when each admission restarted from the shortest pause).
    assert engine.draft_forwards <= 3 + len(prompts), engine.draft_forwards
