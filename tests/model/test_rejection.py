"""The rejection sampler on its own: drafts assembled from each row's chosen proposer, greedy and
speculative-sampling acceptance with the bonus token, and the drafter's distributions per row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.engine.proposers import Proposal
from model.engine.rejection import accept, assemble_drafts, choice_arrays, draft_dists
from model.engine.sampling import SamplingBatch
from model.engine.step import DecodeStep, Drafts, DrawLayout, StepChoice, StepPlan
from model.upload import upload

V = 8


def _draft(tokens: list[list[int]], probs: torch.Tensor | None = None) -> Proposal:
    t = torch.tensor(tokens)
    return Proposal(t, torch.full(t.shape, 0.5), probs, torch.full(t.shape, 0.9))


def _step(
    sampling: SamplingBatch,
    uniforms: torch.Tensor,
    width: int,
    draft: Proposal | None = None,
    span: tuple[int, int] = (0, 0),
    **fields: object,
) -> DecodeStep:
    """A step over len(temperatures) rows (no rows objects: the rejection sampler never reads them)."""
    r = sampling.temperature.shape[0]
    step = DecodeStep(
        lo=0, hi=r, rows=[], draws=DrawLayout(width), plan=StepPlan(False, width, True, False), ngram_width=width,
        greedy_rows=(sampling.temperature <= 0).tolist(), budgets=[width] * r, draft=draft, draft_span=span,
    )  # fmt: skip
    step.anchors, step.sampling, step.uniforms = torch.zeros(r, dtype=torch.long), sampling, uniforms
    for name, value in fields.items():
        setattr(step, name, value)
    return step


def _sampling(temperatures: list[float], uniforms: torch.Tensor) -> SamplingBatch:
    r = len(temperatures)
    return SamplingBatch(
        torch.tensor(temperatures), torch.ones(r), torch.zeros(r, dtype=torch.long), uniforms,
        host_all_greedy=all(t <= 0 for t in temperatures),
    )  # fmt: skip


def _drafts(
    tokens: list[list[int]], token_probs: torch.Tensor, counts: list[int], use_ngram: list[bool], temps: list[float]
) -> Drafts:
    """Drafts as `assemble_drafts` makes them: device tensors and the host's copy of the choice."""
    greedy = [i for i, t in enumerate(temps) if t <= 0]
    sampled = [i for i, t in enumerate(temps) if t > 0]
    return Drafts(
        torch.tensor(tokens), token_probs, torch.tensor(counts), torch.tensor(use_ngram),
        StepChoice(counts, use_ngram), greedy, torch.tensor(greedy, dtype=torch.long),
        sampled, torch.tensor(sampled, dtype=torch.long),
    )  # fmt: skip


def _on_device(arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """The choice's arrays as `DecodeStep.load` hands them back (on the CPU: the buffer's views)."""
    return upload(arrays, torch.device("cpu"))


def _scores(argmax: list[list[int]], margin: float = 20.0) -> torch.Tensor:
    """Scores [R, T, V] whose argmax (and, by the margin, nearly all probability) is `argmax`."""
    s = torch.zeros(len(argmax), len(argmax[0]), V)
    for i, row in enumerate(argmax):
        for j, tok in enumerate(row):
            s[i, j, tok] = margin
    return s


def test_assemble_takes_each_rows_chosen_proposer() -> None:
    # Rows 0..1 ran the drafter (span 0..2); row 1 and row 2 verify their n-gram copies instead.
    copies = Proposal(torch.tensor([[0, 0, 0], [4, 4, 4], [6, 0, 0]]), counts=[0, 3, 1], match_lens=[0, 3, 1])
    choice = StepChoice(counts=[3, 2, 1], use_ngram=[False, True, True])
    sampling = _sampling([0.0, 0.0, 0.0], None)  # type: ignore[arg-type]
    step = _step(sampling, torch.zeros(3, 7), 3, _draft([[1, 2, 3], [5, 5, 5]]), (0, 2), copies=copies, choice=choice)
    d = assemble_drafts(step, _on_device(choice_arrays(step)))
    assert d.tokens.tolist() == [[1, 2, 3], [4, 4, 0], [6, 0, 0]]
    assert d.token_probs.tolist() == [[0.5, 0.5, 0.5], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]  # a copy is one-hot
    assert d.counts.tolist() == [3, 2, 1] and d.from_ngram.tolist() == [False, True, True]


def test_the_fixed_policy_cuts_drafter_rows_at_their_first_doubtful_draft_on_the_device() -> None:
    # Rows 0..2 ran the drafter; the choice verifies up to 3 (row 2's budget: 1), cut at the first
    # confidence below 0.5, without the host seeing the confidences.
    confidence = torch.tensor([[0.9, 0.4, 0.9], [0.9, 0.8, 0.7], [0.1, 0.9, 0.9]])
    draft = Proposal(torch.tensor([[1, 2, 3], [4, 5, 6], [7, 0, 1]]), torch.full((3, 3), 0.5), None, confidence)
    choice = StepChoice(counts=[3, 3, 1], use_ngram=[False] * 3, threshold=0.5)
    sampling = _sampling([0.0, 0.0, 0.0], None)  # type: ignore[arg-type]
    step = _step(sampling, torch.zeros(3, 7), 3, draft, (0, 3), choice=choice)
    d = assemble_drafts(step, _on_device(choice_arrays(step)))
    assert d.counts.tolist() == [1, 3, 0]
    assert d.tokens.tolist() == [[1, 2, 3], [4, 5, 6], [7, 0, 1]]  # past a count: verified, never counted


def test_the_draw_layout_names_each_part_of_a_rows_uniforms() -> None:
    layout = DrawLayout(width=3)
    u = torch.arange(2 * layout.per_row, dtype=torch.float32).reshape(2, layout.per_row)
    assert layout.per_row == 7
    assert layout.draft_slots(u, 2).tolist() == [[0, 1], [7, 8]]
    assert layout.acceptance_tests(u, 2).tolist() == [[3, 4], [10, 11]]
    assert layout.final_token(u).tolist() == [6, 13]


def test_greedy_rows_accept_while_the_draft_is_the_argmax_then_take_the_bonus() -> None:
    drafts = _drafts([[1, 2, 3], [1, 9 % V, 3], [4, 4, 4]], torch.ones(3, 3), [3, 3, 1], [False] * 3, [0.0] * 3)
    # Target argmax after [anchor, d1, d2, d3]: 1, 2, 3, then 7.
    scores = _scores([[1, 2, 3, 7], [1, 2, 3, 7], [4, 5, 5, 5]])
    sampling = _sampling([0.0, 0.0, 0.0], None)  # type: ignore[arg-type]
    accepted, bonus = accept(scores, _step(sampling, torch.zeros(3, 7), 3, drafts=drafts), None)
    # Row 0: all three, bonus 7; row 1: the second draft (1) is not 2; row 2: its one draft, bonus 5.
    assert accepted.tolist() == [3, 1, 1] and bonus.tolist() == [7, 2, 5]


def test_sampling_rows_accept_what_the_target_would_draw_and_reject_what_it_never_would() -> None:
    """Temperature 1, target mass all but certain on token 2 at every position: a copy of 2s is
    accepted whatever the uniforms; a drafter draft of 5 (target probability ~e^-20) is rejected and
    the residual draw is 2. Mixed with a greedy row in the same call."""
    drafts = _drafts(
        [[2, 2], [5, 2], [2, 2]], torch.tensor([[1.0, 1.0], [0.9, 0.5], [1.0, 1.0]]), [2, 2, 2],
        [True, False, False], [1.0, 1.0, 0.0],
    )  # fmt: skip
    scores = _scores([[2, 2, 2]] * 3)
    dist = torch.zeros(3, 2, V)
    dist[:, :, 5], dist[:, :, 2] = 0.9, 0.1
    draft = _draft([[5, 2], [5, 2], [5, 2]], dist)
    for seed in range(5):
        u = torch.rand(3, 5, generator=torch.Generator().manual_seed(seed))
        sampling = _sampling([1.0, 1.0, 0.0], u)
        accepted, bonus = accept(scores, _step(sampling, u, 2, draft, (0, 3), drafts=drafts), None)
        assert accepted.tolist() == [2, 0, 2] and bonus.tolist() == [2, 2, 2], seed


def test_draft_dists_give_rows_the_drafter_did_not_draft_zeros() -> None:
    probs = torch.rand(2, 3, V)
    draft = _draft([[1, 1, 1], [2, 2, 2]], probs)
    full = draft_dists(draft, 4, (1, 3), k=2)  # the drafter drafted rows 1..2 of 4
    assert full is not None and full.shape == (4, 2, V)
    assert torch.equal(full[0], torch.zeros(2, V)) and torch.equal(full[3], torch.zeros(2, V))
    assert torch.equal(full[1:3], probs[:, :2])
    wider = draft_dists(draft, 2, (0, 2), k=4)  # more drafts verified than it drafted: zeros past them
    assert wider is not None and torch.equal(wider[:, :3], probs) and not wider[:, 3].any()
    every = draft_dists(draft, 2, (0, 2), k=2)
    assert every is not None and torch.equal(every, probs[:, :2])
    assert draft_dists(None, 4, (1, 3), k=2) is None


def test_sampling_rows_verifying_drafter_drafts_need_its_distributions() -> None:
    """Decided on the host (no device read): a sampling row that verifies the drafter's drafts
    without the drafter's distributions is an error, not a silently wrong residual."""
    drafts = _drafts([[2, 2]], torch.ones(1, 2), [2], [False], [1.0])
    u = torch.rand(1, 5, generator=torch.Generator().manual_seed(0))
    step = _step(_sampling([1.0], u), u, 2, _draft([[2, 2]]), (0, 1), drafts=drafts)
    with pytest.raises(ValueError, match="distributions"):
        accept(_scores([[2, 2, 2]]), step, None)
