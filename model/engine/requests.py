"""What a request asks of the engine and what the engine reports back, per step and per request.

`SamplingParams` (validated on `Engine.add_request`), `RequestOutput` (one step's tokens of one
request) with its running `RequestStats`, and `StepTiming` for the worker's metrics. The engine
module re-exports them; they live apart, torch-free, so the wire side can read them without the
step code (tests/test_packaging.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the wire side imports this module: torch only for the annotation
    import torch

MAX_LOGPROBS = 20
PROPOSERS = ("drafter", "ngram")  # who proposed a step's drafts (metrics labels)


class ContextLengthError(ValueError):
    """prompt + max_new_tokens does not fit the engine's max_model_len."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 16  # 0: score the prompt only (prompt_logprobs), generate nothing
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top alternatives per token (None: no logprobs)
    # Log-probabilities of the prompt's tokens 1..n-1 from the target's prefill, with this many top
    # alternatives each (None: none). Such a prompt is forwarded whole: no prefix-cache hit.
    prompt_logprobs: int | None = None
    # Logits processors (model/engine/logits_processors.py), applied to the target at every verify position.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0  # stop tokens are held back until this many tokens were generated
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # token sequences that must not be generated
    grammar: Any = None  # model.engine.grammar.Grammar: its matcher masks the target; None: free text

    @property
    def greedy(self) -> bool:
        """Greedy decoding (argmax): a temperature of 0. The one place this rule is written."""
        return self.temperature <= 0

    @property
    def seeded(self) -> bool:
        """Sampled with a seed of its own: the draft policy must choose for it as if it were alone,
        so that the seed gives the same text in any batch."""
        return self.seed is not None and not self.greedy

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")


def check_prompt(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    """ValueError (ContextLengthError where it is the length) for a request no engine row can run."""
    params.validate()
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    total = len(prompt_ids) + params.max_new_tokens
    if total > max_model_len:
        raise ContextLengthError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
            f"exceeds the maximum context length of {max_model_len} tokens"
        )


@dataclass
class RequestStats:
    verify_steps: int = 0
    steps_with_drafts: int = 0  # verify steps that verified at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # per verify step: accepted + 1
    accepted_per_position: list[int] = field(default_factory=list)  # per draft slot
    # The same counts split by who proposed the drafts: "drafter" or "ngram".
    draft_tokens_by_proposer: dict[str, int] = field(default_factory=dict)
    accepted_tokens_by_proposer: dict[str, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0  # prompt tokens copied from the prefix cache, not computed

    @classmethod
    def summed(cls, stats: list[RequestStats]) -> RequestStats:
        """One request's statistics over its choices (counts add, per-step lists concatenate)."""
        total = cls()
        for s in stats:
            total.verify_steps += s.verify_steps
            total.steps_with_drafts += s.steps_with_drafts
            total.draft_tokens += s.draft_tokens
            total.accepted_tokens += s.accepted_tokens
            total.acceptance_lengths += s.acceptance_lengths
            total.cached_prompt_tokens += s.cached_prompt_tokens
            for who, n in s.draft_tokens_by_proposer.items():
                total.draft_tokens_by_proposer[who] = total.draft_tokens_by_proposer.get(who, 0) + n
            for who, n in s.accepted_tokens_by_proposer.items():
                total.accepted_tokens_by_proposer[who] = total.accepted_tokens_by_proposer.get(who, 0) + n
        return total

    def record_verify(self, proposer: str | None, drafted: int, accepted: int) -> None:
        """One verify step: `drafted` drafts from `proposer` (None: no drafts), the first `accepted` accepted."""
        self.verify_steps += 1
        self.steps_with_drafts += drafted > 0
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if proposer is not None:
            self.draft_tokens_by_proposer[proposer] = self.draft_tokens_by_proposer.get(proposer, 0) + drafted
            self.accepted_tokens_by_proposer[proposer] = self.accepted_tokens_by_proposer.get(proposer, 0) + accepted
        self.acceptance_lengths.append(accepted + 1)
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        if not self.acceptance_lengths:
            return None
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None
    stop_token_id: int | None = None  # the stop/EOS token that ended the request, if any
    error: str | None = None
    client_error: bool = False  # the request's own failure (its grammar), the message fit for the client
    # With SamplingParams.prompt_logprobs, on the prefill output: prompt tokens 1..n-1 (the first
    # token has no logprob: nothing comes before it).
    prompt_logprobs: list[TokenLogprob] | None = None
    step_draft_tokens: int = 0  # drafts verified for this request in this step
    step_accepted: list[int] = field(default_factory=list)  # accepted draft slots in this step
    is_verify_step: bool = False
    step_proposer: str | None = None  # "drafter" | "ngram" | None (no drafts verified this step)
    # With capture_taps: target features [n, K*H] of the inputs committed this step (the prompt at
    # prefill, then anchor + accepted drafts), i.e. of every position but the last token.
    features: torch.Tensor | None = None


@dataclass
class StepTiming:
    """What an engine step took (model/engine/timing.py on the device's clock): a decode step's
    drafter block (0 when it did not run) and verify forward; a prefill's whole time."""

    kind: str  # "prefill" | "decode"
    batch_size: int
    draft_seconds: float
    verify_seconds: float
    num_drafts: int = 0  # drafts per row in the verify forward (max over rows)
