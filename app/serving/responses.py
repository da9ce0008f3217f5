"""Turning a request's worker events into a response, written once for both generating endpoints.

`collect` + `ChoiceResult` build a JSON body and `totals` its usage and statistics; `stream_events`
is the one SSE loop (accumulating statistics and usage, ending with an error event or the usage tail
and `[DONE]`). The endpoint only says how one event becomes its chunk type (`StreamFormat`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from app.errors import generation_error
from app.events import LogprobEntry, SeqEvent
from app.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    SpecDecodeStats,
    StreamOptions,
    TopLogprob,
    Usage,
)
from app.worker import RequestHandle
from model.engine.requests import RequestStats

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"


# -- pieces of responses ----------------------------------------------------------------------------


def spec_decode_field(stats: RequestStats) -> SpecDecodeStats:
    return SpecDecodeStats(
        num_drafts=stats.verify_steps,
        num_steps_with_drafts=stats.steps_with_drafts,
        num_draft_tokens=stats.draft_tokens,
        num_accepted_tokens=stats.accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length,
    )


def usage(prompt_tokens: int, completion_tokens: int, stats: RequestStats, n: int) -> Usage:
    """Token counts; `stats` summed over the choices, `n` choices per prompt. Each choice runs its own
    prefill, so the cached prompt tokens are averaged over a prompt's choices (prompt tokens are
    counted once per prompt, as OpenAI counts them)."""
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_prompt_tokens // max(n, 1)),
    )


def completion_logprobs(entries: Sequence[LogprobEntry], offset: int) -> tuple[CompletionLogprobs, int]:
    """Logprobs in the completions shape, text offsets counted from `offset`; returns the next offset."""
    lp = CompletionLogprobs()
    for e in entries:
        lp.tokens.append(e.token.text)
        lp.token_logprobs.append(e.logprob)
        # The prompt's first token has no logprob, and no alternatives either (null, as OpenAI's).
        lp.top_logprobs.append({t.text: v for t, v in e.top} if e.logprob is not None else None)
        lp.text_offset.append(offset)
        offset += len(e.token.text) if not e.token.text.startswith("bytes:") else 0
    return lp, offset


def chat_logprobs(entries: Sequence[LogprobEntry]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token.text,
                logprob=e.logprob if e.logprob is not None else 0.0,  # chat never scores its prompt
                bytes=e.token.bytes,
                top_logprobs=[TopLogprob(token=t.text, logprob=v, bytes=t.bytes) for t, v in e.top],
            )
            for e in entries
        ]
    )


# Characters that many line readers (Python's str.splitlines, hence httpx's aiter_lines) treat as line
# breaks although SSE does not; JSON may escape them inside strings, and nothing else can hold them.
_LINE_BREAKS_TO_ESCAPE = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: BaseModel | dict[str, Any], omit_none: tuple[str, ...] = ()) -> str:
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
    for key in omit_none:
        if data.get(key) is None:
            data.pop(key, None)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_TO_ESCAPE)
    return f"data: {text}\n\n"


# -- whole responses --------------------------------------------------------------------------------


@dataclass
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    text: str
    logprobs: list[LogprobEntry]
    finish_reason: str | None
    stats: RequestStats
    num_tokens: int  # tokens generated (a stop token included)
    prompt_logprobs: list[LogprobEntry] | None = None  # echo with logprobs

    @classmethod
    def from_events(cls, events: list[SeqEvent]) -> ChoiceResult:
        last = events[-1]
        if last.finish_reason == "error":
            raise generation_error(last)
        return cls(
            text="".join(e.text for e in events),
            logprobs=[x for e in events if e.logprobs for x in e.logprobs],
            finish_reason=last.finish_reason,
            stats=last.stats or RequestStats(),
            num_tokens=sum(e.num_tokens for e in events),
            prompt_logprobs=events[0].prompt_logprobs,
        )


def totals(results: Sequence[ChoiceResult], prompt_tokens: int, n: int) -> tuple[Usage, SpecDecodeStats]:
    """A whole response's usage and speculative statistics, summed over its choices."""
    stats = RequestStats.summed([r.stats for r in results])
    completion_tokens = sum(r.num_tokens for r in results)
    return usage(prompt_tokens, completion_tokens, stats, n), spec_decode_field(stats)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, handle: RequestHandle) -> list[ChoiceResult] | None:
    """Every choice's result, in index order; None when the client went away first (its request is
    aborted). A failed choice raises its APIError."""
    per_choice: list[list[SeqEvent]] = [[] for _ in handle.specs]

    async def gather() -> None:
        finished = 0
        while finished < len(handle.specs):
            event = await handle.events.get()
            per_choice[event.index].append(event)
            if event.finish_reason == "error":
                return  # the whole response fails with this choice
            if event.finish_reason is not None:
                finished += 1

    gather_task = asyncio.ensure_future(gather())
    watch_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({gather_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not gather_task.done():
            gather_task.cancel()
            handle.abort()
    if not gather_task.done() or gather_task.cancelled():
        return None
    gather_task.result()
    failed = next((events[-1] for events in per_choice if events and events[-1].finish_reason == "error"), None)
    if failed is not None:
        handle.abort()  # the other choices would run on to max_tokens for nothing
        raise generation_error(failed)
    return [ChoiceResult.from_events(events) for events in per_choice]


# -- streams ----------------------------------------------------------------------------------------


class StreamFormat(Protocol):
    """How one endpoint renders its SSE chunks."""

    def opening(self, num_choices: int, running: Usage | None = None) -> list[str]:
        """Chunks sent before any event (`running`: the usage, with continuous_usage_stats)."""
        ...

    def event(self, event: SeqEvent, spec_decode: SpecDecodeStats | None, running: Usage | None = None) -> str | None:
        """The chunk for one event (None: nothing to send). `spec_decode` is set on the last event of the
        request when no usage tail follows; `running` is the usage so far, to be sent on the chunk
        (stream_options.continuous_usage_stats; then a chunk is always sent)."""
        ...

    def tail(self, usage: Usage, spec_decode: SpecDecodeStats) -> str:
        """The final chunk with usage (stream_options.include_usage)."""
        ...


async def stream_events(
    handle: RequestHandle, stream_format: StreamFormat, prompt_tokens: int, options: StreamOptions, n: int
) -> AsyncIterator[str]:
    """The SSE body: the endpoint's chunks, then the usage tail (if asked) and [DONE]; a failed choice
    ends the stream with an error event. Whatever still runs is aborted when the stream ends or the
    client goes away (this generator is then cancelled). With continuous_usage_stats (vLLM's
    extension) every chunk carries the usage so far."""
    include_usage = options.include_usage
    choice_stats: list[RequestStats] = []
    completion_tokens, finished = 0, 0
    num_choices = len(handle.specs)
    try:
        opened = usage(prompt_tokens, 0, RequestStats(), n) if options.continuous_usage_stats else None
        for chunk in stream_format.opening(num_choices, opened):
            yield chunk
        while finished < num_choices:
            event = await handle.events.get()
            completion_tokens += event.num_tokens
            if event.finish_reason == "error":
                handle.abort()
                yield sse(generation_error(event).body())
                yield DONE
                return
            spec_decode = None
            if event.finish_reason is not None:
                finished += 1
                choice_stats.append(event.stats or RequestStats())
                if finished == num_choices and not include_usage:
                    spec_decode = spec_decode_field(RequestStats.summed(choice_stats))
            running = None
            if options.continuous_usage_stats:
                running = usage(prompt_tokens, completion_tokens, RequestStats.summed(choice_stats), n)
            chunk = stream_format.event(event, spec_decode, running)
            if chunk is not None:
                yield chunk
        if include_usage:
            summed = RequestStats.summed(choice_stats)
            yield stream_format.tail(usage(prompt_tokens, completion_tokens, summed, n), spec_decode_field(summed))
        yield DONE
    finally:
        handle.abort()  # a no-op when everything finished


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
