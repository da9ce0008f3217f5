"""Per-request logits processors under speculation (docs/design.md §1.6).

A processor turns the target's logits at one position into the scores the request samples from:
logit_bias, repetition penalty, presence/frequency penalties, banned token sequences, min_tokens and
a grammar mask, in that order (logit bias before the repetition penalty as in HF `generate` and vLLM;
a ban is -inf and commutes with the rest). Each is a function of the sequence before the position
only, so the verify forward can apply it at every position of `[anchor, d1..dk]` with the prefix
*including the drafts before it*: greedy output then equals HF `generate` with the same processors
and speculative sampling stays exact (the target's distribution is whatever function of the prefix
the request asks for; drafts it gives probability 0 are simply rejected).

`RowProcessor` holds one row's state, advanced only by committed tokens (`commit`): counts of the
output (presence/frequency: OpenAI counts generated tokens only), the set of prompt + output tokens
(repetition penalty: HF and vLLM count the prompt too), the tail that multi-token bans are matched
against, and the grammar matcher. Rows without any processor have none, and a batch without any
pays nothing (`process_logits` returns the logits untouched).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

NEG_INF = float("-inf")
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


class Matcher(Protocol):
    """What a row needs from a grammar matcher (model/engine/grammar.py wraps llguidance's)."""

    # Why the committed output can no longer be a valid completion (client-safe), None while it
    # can; once set it stays set and `allowed` lets only EOS through.
    error: str | None

    def allowed(self, drafts: list[int], positions: int) -> torch.Tensor:
        """Allowed tokens [positions, V] after the committed prefix plus drafts[:j], for each j; rows
        past the first draft the grammar refuses are all True (they are never used)."""
        ...

    def commit(self, tokens: list[int]) -> None: ...


def check_params(params: Any, vocab_size: int) -> None:
    """Raise ValueError for processor settings the engine cannot apply (params: SamplingParams)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
    if not params.repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    if params.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {params.min_tokens}")
    for tok, bias in params.logit_bias.items():
        if not 0 <= tok < vocab_size:
            raise ValueError(f"logit_bias: token id {tok} is outside the vocabulary (size {vocab_size})")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: values must be in [-100, 100], got {bias}")
    for seq in params.bad_words_ids:
        if not seq or any(not 0 <= t < vocab_size for t in seq):
            raise ValueError(f"bad_words_ids: {list(seq)[:8]} is empty or outside the vocabulary")


def wants_processor(params: Any) -> bool:
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.logit_bias
        or params.min_tokens
        or params.bad_words_ids
        or params.grammar is not None
    )


class RowProcessor:
    """One row's processors and the state they read, kept in step with its committed tokens."""

    def __init__(
        self, params: Any, prompt_ids: list[int], stop_ids: frozenset[int], vocab_size: int, device: torch.device
    ) -> None:
        self.vocab_size = vocab_size
        self.presence, self.frequency = float(params.presence_penalty), float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.min_tokens = int(params.min_tokens)
        # min_tokens holds back every token that would end the row (EOS and stop_token_ids), as vLLM does.
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        self.num_output = 0
        self.bias_ids = self.bias_values = None
        if params.logit_bias:
            ids, values = zip(*sorted(params.logit_bias.items()))
            self.bias_ids = torch.tensor(ids, dtype=torch.long, device=device)
            self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)
        self.counts = torch.zeros(vocab_size, device=device) if self.presence or self.frequency else None
        self.seen = None
        if self.repetition != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.banned = torch.tensor(
            sorted({s[0] for s in params.bad_words_ids if len(s) == 1}), dtype=torch.long, device=device
        )
        self.sequences = [tuple(s) for s in params.bad_words_ids if len(s) > 1]
        self.tail_len = max((len(s) - 1 for s in self.sequences), default=0)
        self.tail = list(prompt_ids[len(prompt_ids) - self.tail_len :]) if self.tail_len else []
        # The matcher is told the row's stop tokens: one that ends a complete output is no error.
        self.matcher: Matcher | None = None
        if params.grammar is not None:
            self.matcher = params.grammar.matcher(frozenset(stop_ids))

    @property
    def grammar_error(self) -> str | None:
        """Why the row's grammar failed, in words fit for the client; None without a grammar or
        while the output can still be valid. The contract: check it after every `commit`; once it
        is set (it stays set) the row must finish with finish_reason "error", never as a normal
        completion, even when the same commit ended it with EOS or a stop token (the grammar was
        not complete there, or the matcher failed)."""
        return None if self.matcher is None else self.matcher.error

    def commit(self, tokens: list[int]) -> None:
        """Tokens appended to the row's output (then read `grammar_error`)."""
        if not tokens:
            return
        self.num_output += len(tokens)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.stop_ids.device)
        if self.counts is not None:
            self.counts.index_put_((ids,), torch.ones_like(ids, dtype=self.counts.dtype), accumulate=True)
        if self.seen is not None:
            self.seen[ids] = True
        if self.tail_len:
            self.tail = (self.tail + tokens)[-self.tail_len :]
        if self.matcher is not None:
            self.matcher.commit(tokens)

    def process(self, scores: torch.Tensor, drafts: list[int]) -> None:
        """Apply in place to scores [n, V] (float32): position j follows the committed prefix and drafts[:j]."""
        n = scores.shape[0]
        drafts = drafts[: n - 1]
        if self.bias_ids is not None:
            scores[:, self.bias_ids] += self.bias_values
        if self.seen is not None:
            seen = self.seen.expand(n, -1).clone()
            for j, tok in enumerate(drafts):
                seen[j + 1 :, tok] = True
            # HF's rule: a positive logit is divided by the penalty, a negative one multiplied.
            penalised = torch.where(scores < 0, scores * self.repetition, scores / self.repetition)
            scores.copy_(torch.where(seen, penalised, scores))
        if self.counts is not None:
            counts = self.counts.expand(n, -1).clone()
            for j, tok in enumerate(drafts):
                counts[j + 1 :, tok] += 1
            # OpenAI's formula: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty.
            scores -= counts * self.frequency + (counts > 0).float() * self.presence
        if self.banned.numel():
            scores[:, self.banned] = NEG_INF
        if self.sequences:
            self._ban_sequences(scores, drafts)
        if self.num_output < self.min_tokens and self.stop_ids.numel():
            short = self.min_tokens - self.num_output  # positions 0..short-1 come before min_tokens
            scores[:short, self.stop_ids] = NEG_INF
        if self.matcher is not None:
            scores.masked_fill_(~self.matcher.allowed(drafts, n).to(scores.device), NEG_INF)
        self._never_empty(scores)

    def _ban_sequences(self, scores: torch.Tensor, drafts: list[int]) -> None:
        # HF NoBadWordsLogitsProcessor: ban a sequence's last token where the context ends with the rest.
        context = self.tail + drafts
        base = len(self.tail)
        for j in range(scores.shape[0]):
            end = base + j
            for seq in self.sequences:
                m = len(seq) - 1
                if end >= m and tuple(context[end - m : end]) == seq[:-1]:
                    scores[j, seq[-1]] = NEG_INF

    def _never_empty(self, scores: torch.Tensor) -> None:
        """A position where every token is banned (e.g. a finished grammar while min_tokens holds
        back EOS) ends the row instead: its stop tokens get their logits back, or, without any, every
        token does. Still a function of the prefix alone, so lossless."""
        dead = torch.isneginf(scores).all(-1)
        if not bool(dead.any()):
            return
        rows = dead.nonzero().squeeze(1)
        if self.stop_ids.numel():
            scores[rows[:, None], self.stop_ids[None, :]] = 0.0
        else:
            scores[rows] = 0.0


def new_row_processor(
    params: Any, prompt_ids: list[int], stop_ids: frozenset[int], vocab_size: int, device: torch.device
) -> RowProcessor | None:
    if not wants_processor(params):
        return None
    check_params(params, vocab_size)
    return RowProcessor(params, prompt_ids, stop_ids, vocab_size, device)


def process_logits(
    processors: list[RowProcessor | None], logits: torch.Tensor, drafts: torch.Tensor | None
) -> torch.Tensor:
    """Scores [R, n, V] to choose from: logits with each row's processors applied at every position
    (position j after the row's drafts[:, :j]). Without any processor, the logits themselves."""
    if all(p is None for p in processors):
        return logits
    scores = logits.float().clone()
    draft_lists = drafts.tolist() if drafts is not None and drafts.shape[1] else [[] for _ in processors]
    for i, proc in enumerate(processors):
        if proc is not None:
            proc.process(scores[i], draft_lists[i])
    return scores
