"""Logits processors under speculation (issue #16 items 3-4): every mode and batch size gives HF
`generate`'s greedy output with the same processors (HF's own classes; OpenAI's presence/frequency
formula and an llguidance mask written here as reference processors), rows with different processors
sharing each batch."""

from __future__ import annotations

from typing import Any

import llguidance
import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from model.engine.engine import Engine, SamplingParams
from model.engine.grammar import GrammarCompiler
from model.nn.target import TargetModel
from tests.fixtures.models import build_tiny_drafter, build_tiny_target, build_tiny_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "n", "color"],
    "additionalProperties": False,
}
MAX_NEW = 40


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's documented formula over the generated tokens only:
    mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).float() * self.presence


class GrammarMask(LogitsProcessor):
    """A fresh llguidance matcher fed the whole output at every step (no rollback involved)."""

    def __init__(self, compiler: GrammarCompiler, grammar: str, prompt_len: int) -> None:
        self.compiler, self.grammar, self.prompt_len = compiler, grammar, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        matcher = llguidance.LLMatcher(self.compiler.tokenizer, self.grammar)
        assert matcher.consume_tokens(input_ids[0, self.prompt_len :].tolist())
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None].long() >> torch.arange(8)) & 1).bool().flatten()[: scores.shape[-1]]
        return scores.masked_fill(~allowed, float("-inf"))


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    tok = build_tiny_tokenizer()
    model = build_tiny_target(tok)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tok, model.config.vocab_size, [eos])
    g = torch.Generator().manual_seed(5)
    # Phrases repeated, so n-gram copies are on offer from the first step.
    prompts = [
        torch.randint(4, len(tok), (n,), generator=g).tolist() * r
        for n, r in zip((5, 3, 7, 4, 6, 2, 5, 3), (3, 4, 2, 3, 2, 5, 3, 4))
    ]
    return {"tok": tok, "model": model, "eos": eos, "compiler": compiler, "prompts": prompts}


def _hf(world: dict[str, Any], prompt: list[int], processors: list[LogitsProcessor], stop: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = world["model"].generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            logits_processor=LogitsProcessorList(processors),
            eos_token_id=stop or None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _cases(world: dict[str, Any]) -> list[tuple[dict[str, Any], Any]]:
    """(SamplingParams fields, HF processors for a prompt length) per row; stop = the row's stop ids."""
    eos, compiler = world["eos"], world["compiler"]
    plain = _hf(world, world["prompts"][5], [], [])
    banned_pair, banned_one = plain[2:4], plain[6]  # bans that bite: the plain output has them
    schema = compiler.json_schema(SCHEMA)
    obj = compiler.json_object()
    return [
        ({}, lambda n: []),
        ({"grammar": schema, "stop_token_ids": (eos,)}, lambda n: [GrammarMask(compiler, schema.text, n)]),
        (
            {"repetition_penalty": 1.3, "grammar": schema, "stop_token_ids": (eos,)},
            lambda n: [RepetitionPenaltyLogitsProcessor(1.3), GrammarMask(compiler, schema.text, n)],
        ),
        ({"presence_penalty": 0.8, "frequency_penalty": 0.5}, lambda n: [OpenAIPenalties(n, 0.8, 0.5)]),
        (
            {"logit_bias": {7: 9.0, 100: -100.0}, "min_tokens": 6, "stop_token_ids": (7,)},
            lambda n: [
                SequenceBiasLogitsProcessor({(7,): 9.0, (100,): -100.0}),
                MinNewTokensLengthLogitsProcessor(n, 6, [7]),
            ],
        ),
        (
            {"bad_words_ids": (tuple(banned_pair), (banned_one,))},
            lambda n: [NoBadWordsLogitsProcessor([list(banned_pair), [banned_one]])],
        ),
        (
            {"grammar": obj, "stop_token_ids": (eos,), "frequency_penalty": -0.5},
            lambda n: [OpenAIPenalties(n, 0.0, -0.5), GrammarMask(compiler, obj.text, n)],
        ),
        (
            {"repetition_penalty": 0.8, "presence_penalty": -1.0, "logit_bias": {50: 3.0}},
            lambda n: [
                SequenceBiasLogitsProcessor({(50,): 3.0}),
                RepetitionPenaltyLogitsProcessor(0.8),
                OpenAIPenalties(n, -1.0, 0.0),
            ],
        ),
    ]


@pytest.fixture(scope="module")
def refs(world: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[int]]]:
    fields, want = [], []
    for (kw, procs), prompt in zip(_cases(world), world["prompts"]):
        fields.append(kw)
        want.append(_hf(world, prompt, procs(len(prompt)), list(kw.get("stop_token_ids", ()))))
    plain = [_hf(world, p, [], []) for p in world["prompts"]]
    # Every processor changed its row's output: the comparison checks the processors, not only the model.
    assert all(w != p for w, p in zip(want[1:], plain[1:])), (want, plain)
    return fields, want


@pytest.mark.parametrize("mode", ["ar", "dflash", "domino", "ngram"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_with_processors_matches_hf_generate(world, refs, mode: str, batch: int) -> None:
    fields, want = refs
    model = world["model"]
    drafter = None
    if mode in ("dflash", "domino"):
        drafter = build_tiny_drafter(model.config, world["tok"].convert_tokens_to_ids("<|mask|>"), block_size=4)
    engine = Engine(
        TargetModel(model), drafter, mode=mode, max_batch_size=batch, max_model_len=256, draft_policy="fixed"
    )
    params = [SamplingParams(max_new_tokens=MAX_NEW, **kw) for kw in fields]
    results = engine.generate(world["prompts"], params)
    for i, ((tokens, _, _), ref) in enumerate(zip(results, want)):
        assert tokens == ref, (i, fields[i])
    if mode != "ar":
        assert sum(s.accepted_tokens for _, s, _ in results) > 0  # drafts were verified and some kept


# -- sampling stays exact: chi-square against the exact joint of the first tokens ------------------


def _joint(step: Any, depth: int, stop: int | None = None) -> dict[tuple, float]:
    """Exact probability of every first-`depth`-token sequence (shorter where `stop` ends it);
    step(prefix) -> the distribution of the next token after the generated prefix."""
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float) -> None:
        if len(prefix) == depth or (prefix and prefix[-1] == stop):
            out[prefix] = out.get(prefix, 0.0) + prob
            return
        for tok, p in enumerate(step(list(prefix)).tolist()):
            if p > 0:
                walk((*prefix, tok), prob * p)

    walk((), 1.0)
    return out


def _sample_counts(engine: Engine, prompt: list[int], params: list[SamplingParams], depth: int, stop: int | None):
    results = engine.generate([prompt] * len(params), params)
    counts: dict[tuple, int] = {}
    for tokens, _, _ in results:
        key = tuple(tokens[:depth])
        if stop in key:
            key = key[: key.index(stop) + 1]
        counts[key] = counts.get(key, 0) + 1
    drafted = sum(s.draft_tokens for _, s, _ in results)
    accepted = sum(s.accepted_tokens for _, s, _ in results)
    assert 0.03 < accepted / drafted < 0.97, (accepted, drafted)  # both branches ran
    return counts


@pytest.mark.slow
def test_sampling_with_penalties_matches_the_penalised_distribution() -> None:
    from tests.helpers import tiny_drafter, tiny_target
    from tests.model.test_sampling import ALPHA, _chi_square, assert_power

    vocab, depth, n = 8, 3, 12_000
    model = tiny_target(vocab=vocab, seed=3)
    drafter = tiny_drafter(vocab=vocab, block_size=4, std=0.3, seed=4)
    engine = Engine(TargetModel(model), drafter, mode="domino", max_batch_size=128, max_model_len=16)
    prompt = [1, 2, 3, 1, 2]  # the n-gram copies propose 3, 1, 2, ...
    kw = {"presence_penalty": 0.7, "frequency_penalty": 0.4, "repetition_penalty": 1.5, "logit_bias": {5: 1.0}}
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=i, **kw) for i in range(n)]
    counts = _sample_counts(engine, prompt, params, depth, None)
    procs = [
        SequenceBiasLogitsProcessor({(5,): 1.0}),
        RepetitionPenaltyLogitsProcessor(1.5),
        OpenAIPenalties(len(prompt), 0.7, 0.4),
    ]

    def step(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + prefix])
        with torch.no_grad():
            scores = model(ids).logits[:, -1].float()
        for proc in procs:
            scores = proc(ids, scores)
        return torch.softmax(scores[0], -1)

    expected = _joint(step, depth)
    assert _chi_square(counts, expected, n) > ALPHA
    assert_power(counts, expected, n)


@pytest.mark.slow
def test_sampling_with_a_grammar_matches_the_masked_distribution(world: dict[str, Any]) -> None:
    from tests.model.test_sampling import ALPHA, _chi_square, assert_power

    tok, model, eos, compiler = world["tok"], world["model"], world["eos"], world["compiler"]
    depth, n = 3, 12_000
    grammar = compiler.lark("start: /[ab]+/")  # a few tokens allowed at each position, EOS after one
    prompt = tok.encode("ab ab ab a", add_special_tokens=False)  # copies propose b, a, ... (allowed)
    drafter = build_tiny_drafter(model.config, tok.convert_tokens_to_ids("<|mask|>"), block_size=4)
    engine = Engine(
        TargetModel(model), drafter, mode="domino", max_batch_size=128, max_model_len=64, eos_token_ids=[eos]
    )
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=i, grammar=grammar) for i in range(n)]
    counts = _sample_counts(engine, prompt, params, depth, eos)

    def step(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + prefix])
        with torch.no_grad():
            scores = model(ids).logits[:, -1].float()
        return torch.softmax(GrammarMask(compiler, grammar.text, len(prompt))(ids, scores)[0], -1)

    expected = _joint(step, depth, stop=eos)
    assert len(expected) > 10
    assert _chi_square(counts, expected, n) > ALPHA
    assert_power(counts, expected, n)
