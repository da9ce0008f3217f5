"""Admission's model work on its own (model/engine/prefill.py): prompts split into forwards or not,
the first token is the target's choice at each prompt's last position, and the caches move only once
every forward succeeded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model.engine.prefill import Prefiller
from model.engine.requests import SamplingParams
from model.engine.row import Row
from model.nn.drafter import new_context_cache
from model.nn.target import TargetModel
from tests.helpers import tiny_drafter, tiny_target

PROMPTS = [[5, 9, 14, 3, 77, 21, 8], [40, 2], [11, 12, 13, 14]]


def _prefiller(split_tokens: int) -> tuple[Prefiller, TargetModel]:
    target = TargetModel(tiny_target())
    drafter = tiny_drafter(domino=True)
    target.add_taps(list(drafter.config.target_layer_ids))
    drafter.bind_target(target.embed_tokens.weight, target.lm_head.weight)
    cache = target.new_cache(4, 32)
    draft_cache = new_context_cache(drafter.config, 4, 32, target.dtype, target.device)
    taps = list(drafter.config.target_layer_ids)
    return Prefiller(
        target, cache, drafter, draft_cache, taps, True, False, split_tokens, lambda rows, lo: None
    ), target


def _rows(prompts: list[list[int]]) -> list[Row]:
    params = SamplingParams(max_new_tokens=4, logprobs=0)
    return [Row(str(i), p, params, np.random.default_rng(0), frozenset()) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("split_tokens", [0, 1000])  # a forward per prompt, or one padded forward
def test_first_tokens_are_the_targets_argmax_and_the_caches_hold_each_prompt(split_tokens: int) -> None:
    prefiller, target = _prefiller(split_tokens)
    result = prefiller.run(_rows(PROMPTS), lo=1)
    assert [r.prompt_ids for r in result.rows] == sorted(PROMPTS, key=len)  # slots 1.. by length
    model = tiny_target().requires_grad_(False)
    for row, tok, lp in zip(result.rows, result.first_tokens, result.logprobs):
        logits = model(torch.tensor([row.prompt_ids])).logits[0, -1]
        assert tok == int(logits.argmax())
        assert lp is not None and lp[0].logprob == pytest.approx(float(torch.log_softmax(logits, -1)[tok]), abs=1e-4)
    lengths = [len(r.prompt_ids) for r in result.rows]
    assert prefiller.cache.host_lengths[1:4] == lengths
    assert prefiller.draft_cache is not None and prefiller.draft_cache.host_lengths[1:4] == lengths
    assert prefiller.cache.lengths[1:4].tolist() == lengths


def test_a_failing_forward_leaves_every_row_unadvanced() -> None:
    """The longest prompt holds a token outside the vocabulary, so the last of three forwards fails:
    the forwards before it must not have moved either cache."""
    prefiller, target = _prefiller(split_tokens=0)
    bad = [*PROMPTS[0][:-1], target.vocab_size + 5]
    with pytest.raises((IndexError, RuntimeError)):
        prefiller.run(_rows([bad, *PROMPTS[1:]]), lo=0)
    assert prefiller.cache.host_lengths[:3] == [0, 0, 0]
    assert prefiller.draft_cache is not None and prefiller.draft_cache.host_lengths[:3] == [0, 0, 0]
