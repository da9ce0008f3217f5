"""`Service`: the engine client, the one place that owns the engine (through its worker), the
tokenizer and the metrics, with the checks every endpoint shares (model, counts, capacity, context
length), the thread budget for tokenizing and rendering, and submission. Each endpoint's own flow
is in app/serving/."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from app.errors import APIError, bad_request, server_error
from app.events import SequenceSpec
from app.metrics import Metrics
from app.protocol import SamplingFields
from app.settings import Settings
from app.worker import EngineWorker, Overloaded, RequestHandle, Unavailable

if TYPE_CHECKING:
    from model.engine.engine import Engine
    from model.engine.grammar import Grammar

log = logging.getLogger(__name__)
T = TypeVar("T")

# Prompt preparations running at once in threads: one that overruns its time budget keeps its thread
# (a thread cannot be cancelled), so bound how many can.
PREPARE_SLOTS = 4


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the prompt as text, when the client sent text (echo)


class Service:
    """Owns the engine (through its worker), the tokenizer and the metrics."""

    def __init__(self, settings: Settings, engine: Engine, tokenizer: Any) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = settings.model_name
        self.created = int(time.time())
        self.vocab_size = engine.target.vocab_size
        self.max_model_len = engine.max_model_len
        self.metrics = Metrics(self.model_name, engine.num_drafts, engine.max_batch_size)
        self.worker = EngineWorker(engine, tokenizer, self.metrics, settings.max_waiting)
        self.eos_token_ids = frozenset(engine.eos_token_ids)
        self._prepare_slots = asyncio.Semaphore(PREPARE_SLOTS)

    @property
    def capacity(self) -> int:
        return self.worker.capacity

    # -- validation --------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist (this server serves '{self.model_name}').",
                param="model",
                code="model_not_found",
            )

    def check_counts(self, body: SamplingFields, num_prompts: int) -> int:
        """Deployment limits on n, stops and the sequences a request needs; returns n."""
        n = body.n if body.n is not None else 1
        if n > self.settings.max_n:
            raise bad_request(f"n: must be at most {self.settings.max_n}, got {n}", param="n")
        if len(body.stop_list) > self.settings.max_stop:
            raise bad_request(
                f"stop: at most {self.settings.max_stop} stop strings, got {len(body.stop_list)}", param="stop"
            )
        stop_ids = body.stop_token_ids or []
        if len(stop_ids) > self.settings.max_stop:
            raise bad_request(
                f"stop_token_ids: at most {self.settings.max_stop} ids, got {len(stop_ids)}", param="stop_token_ids"
            )
        bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"stop_token_ids: {bad[:5]} outside the vocabulary (size {self.vocab_size})", param="stop_token_ids"
            )
        bad = [k for k in body.logit_bias or {} if int(k) >= self.vocab_size]
        if bad:
            raise bad_request(
                f"logit_bias: token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})",
                param="logit_bias",
            )
        if n * num_prompts > self.capacity:
            raise bad_request(
                f"the request needs {n * num_prompts} sequences (n x prompts) but the server admits at most "
                f"{self.capacity} at a time",
                param="n",
            )
        return n

    def check_capacity(self, num_sequences: int) -> None:
        """429 before any work on the prompt: an overloaded server should not tokenize or render first
        (the worker checks again, atomically, when the request is submitted)."""
        if self.worker.healthy:
            try:
                self.worker.check_capacity(num_sequences)
            except Overloaded as exc:
                raise _overloaded(str(exc)) from None

    def check_prompt(self, prompt: Prompt, max_tokens: int, param: str, tokens_param: str) -> None:
        if not prompt.ids:
            raise bad_request(f"{param}: the prompt is empty (it encodes to no tokens)", param=param)
        bad = [t for t in prompt.ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{param}: token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})", param=param
            )
        total = len(prompt.ids) + max_tokens
        if total > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt.ids)} in the {param}, {max_tokens} for the completion). "
                f"Please reduce the length of the {param} or {tokens_param}.",
                param=param if len(prompt.ids) >= self.max_model_len else tokens_param,
                code="context_length_exceeded",
            )

    # -- admission ---------------------------------------------------------------------------------
    def specs(
        self,
        body: SamplingFields,
        prompts: list[tuple[Prompt, int]],
        n: int,
        logprobs: int | None,
        grammar: Grammar | None = None,
        prompt_logprobs: int | None = None,
    ) -> list[SequenceSpec]:
        """Choice index = prompt index * n + sample index (OpenAI's order); seeds advance per sample."""
        out = []
        bad_words = self.bad_words_ids(body.bad_words or [])
        for pi, (prompt, max_tokens) in enumerate(prompts):
            if body.min_tokens and body.min_tokens > max_tokens:
                raise bad_request(
                    f"min_tokens: {body.min_tokens} is more than the {max_tokens} tokens the completion may have",
                    param="min_tokens",
                )
            for j in range(n):
                params = body.sampling_params(max_tokens, logprobs, seed_offset=j)
                params.bad_words_ids = bad_words
                params.grammar = grammar
                params.prompt_logprobs = prompt_logprobs
                out.append(SequenceSpec(pi * n + j, prompt.ids, params, tuple(body.stop_list)))
        return out

    async def submit(self, specs: list[SequenceSpec]) -> RequestHandle:
        try:
            return await self.worker.submit(specs)
        except Overloaded as exc:
            raise _overloaded(str(exc)) from None
        except Unavailable as exc:
            raise APIError(
                503, str(exc), "server_error", code="service_unavailable", headers={"Retry-After": "5"}
            ) from None
        except ValueError as exc:  # the engine's own checks (bad params, context length)
            raise bad_request(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - e.g. an engine bug while adding
            raise server_error("could not admit the request", f"{type(exc).__name__}: {exc}") from None

    # -- tokenization (call off the event loop) ------------------------------------------------------
    async def prepare(self, fn: Callable[..., T], *args: Any, param: str) -> T:
        """fn(*args) (tokenizing or rendering a prompt) in a thread, within the render time budget."""
        budget = self.settings.render_timeout
        try:
            # A free slot is taken at once (no timer: a tiny budget must not refuse an idle server).
            if self._prepare_slots.locked():
                await asyncio.wait_for(self._prepare_slots.acquire(), budget)
            else:
                await self._prepare_slots.acquire()
        except TimeoutError:
            raise APIError(
                503,
                "the server is busy preparing other prompts; retry later",
                "server_error",
                code="service_unavailable",
                headers={"Retry-After": "1"},
            ) from None
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        task.add_done_callback(self._prepared)
        try:
            return await asyncio.wait_for(asyncio.shield(task), budget)
        except TimeoutError:
            raise bad_request(
                f"{param}: preparing the prompt took longer than {budget:g} s", param=param, code="prompt_too_complex"
            ) from None

    def _prepared(self, task: asyncio.Future[Any]) -> None:
        self._prepare_slots.release()
        if not task.cancelled():
            task.exception()  # retrieved here: a request that timed out no longer awaits it

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Token sequences that ban each word: its tokens as written and after a space (how a word
        inside text is usually tokenized), as vLLM does."""
        out: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids:
                    out[ids] = None
        return tuple(out)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _overloaded(message: str) -> APIError:
    return APIError(429, message, "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"})
