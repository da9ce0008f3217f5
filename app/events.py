"""What the worker thread and the event loop pass each other, torch-free: the engine requests a
response is made of (`SequenceSpec`), what each step produced for one of them, as text
(`SeqEvent`), and how a token shows in logprobs (`TokenText`, `LogprobEntry`).

Everything on the wire side (protocol, errors, detokenizing, the serving layer) reads these without
importing the engine; the engine's own request types are model/engine/requests.py, torch-free too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.engine.requests import RequestStats, SamplingParams


@dataclass(frozen=True)
class TokenText:
    """How a token is shown in logprobs: its text (or `bytes:\\x..` for partial UTF-8) and bytes."""

    text: str
    bytes: list[int]


@dataclass
class LogprobEntry:
    token: TokenText
    logprob: float | None  # None: the prompt's first token (nothing comes before it)
    top: list[tuple[TokenText, float]]


@dataclass
class SequenceSpec:
    """One engine request: one prompt, one choice."""

    index: int  # choice index in the response
    prompt_ids: list[int]
    params: SamplingParams
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True


@dataclass
class SeqEvent:
    """What one engine step produced for one choice, as text."""

    index: int
    text: str = ""
    num_tokens: int = 0  # tokens generated this step (a stop token included)
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None
    stats: RequestStats | None = None  # on the final event (a copy: the engine keeps counting)
    error: str | None = None
    unavailable: bool = False  # the error is the server going away, not the request failing
    client_error: bool = False  # the request's own failure (its grammar): the message goes to the client
    prompt_logprobs: list[LogprobEntry] | None = None  # on the first event, when the prompt was scored

    @property
    def progressed(self) -> bool:
        """The step gave this choice tokens, logprobs or its end: a stream sends a chunk for it even
        where its text is held back (half a UTF-8 character, a skipped special token, a possible stop
        string), as vLLM does, so the stream's cadence stays the engine's."""
        return bool(self.num_tokens or self.logprobs or self.finish_reason)
