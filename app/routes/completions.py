"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.deps import ServiceDep
from app.errors import ERROR_RESPONSES, bad_request
from app.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SpecDecodeStats,
    StreamOptions,
    Usage,
    new_id,
    now,
)
from app.responses import (
    collect,
    completion_logprobs,
    spec_decode_field,
    sse,
    sse_response,
    stream_events,
    totals,
    usage,
)
from app.service import Prompt, Service
from app.worker import SeqEvent

router = APIRouter(responses=ERROR_RESPONSES)


def _split_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, int) for x in prompt):
        return [prompt]
    return list(prompt)


def _tokenize(service: Service, raw_prompts: list[str | list[int]]) -> list[Prompt]:
    return [
        Prompt(service.encode_text(raw), raw) if isinstance(raw, str) else Prompt(list(raw), None)
        for raw in raw_prompts
    ]


class CompletionStream:
    """SSE chunks of /v1/completions: echo text opens each choice; logprob offsets run on."""

    def __init__(
        self, rid: str, created: int, model: str, echo_text: Callable[[int], str], num_choices: int, include_usage: bool
    ) -> None:
        self.rid, self.created, self.model, self.echo_text = rid, created, model, echo_text
        self.offsets = [0] * num_choices
        self.started = [False] * num_choices
        # With include_usage every chunk carries "usage": null, as OpenAI's do.
        self.omit: tuple[str, ...] = ("spec_decode",) if include_usage else ("usage", "spec_decode")

    def opening(self, num_choices: int, running: Usage | None = None) -> list[str]:
        return []

    def event(self, event: SeqEvent, spec: SpecDecodeStats | None, running: Usage | None = None) -> str | None:
        i, text = event.index, event.text
        logprobs = None
        if not self.started[i]:
            self.started[i] = True
            text = self.echo_text(i) + text
            if event.prompt_logprobs is not None:  # echo with logprobs: the prompt's come first
                logprobs = completion_logprobs(event.prompt_logprobs, 0)[0]
            self.offsets[i] = len(self.echo_text(i))
        if not text and event.finish_reason is None and not event.logprobs and running is None:
            return None
        if event.logprobs is not None:
            generated, self.offsets[i] = completion_logprobs(event.logprobs, self.offsets[i])
            logprobs = generated if logprobs is None else logprobs.extended(generated)
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=event.finish_reason)
        chunk = CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=[choice], usage=running, spec_decode=spec
        )
        return sse(chunk, omit_none=self.omit)

    def tail(self, totals: Usage, spec: SpecDecodeStats) -> str:
        chunk = CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=[], usage=totals, spec_decode=spec
        )
        return sse(chunk)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, service: ServiceDep) -> Response:
    service.check_model(body.model)
    raw_prompts = _split_prompts(body.prompt)
    n = service.check_counts(body, len(raw_prompts))
    echo = bool(body.echo)
    if body.max_tokens == 0 and not echo:
        raise bad_request("max_tokens: 0 is only accepted with echo (scoring the prompt)", param="max_tokens")
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    service.check_capacity(n * len(raw_prompts))
    prompts = await service.prepare(_tokenize, service, raw_prompts, param="prompt")
    for prompt in prompts:
        service.check_prompt(prompt, max_tokens, "prompt", "max_tokens")
    echo_texts: list[str] = []
    if echo:
        echo_texts = [pr.text if pr.text is not None else service.decode(pr.ids) for pr in prompts]
    # echo with logprobs scores the prompt too (lm-eval's loglikelihood), from the target's prefill.
    prompt_logprobs = body.logprobs if echo else None
    specs = service.specs(body, [(pr, max_tokens) for pr in prompts], n, body.logprobs, prompt_logprobs=prompt_logprobs)
    handle = await service.submit(specs)
    prompt_tokens = sum(len(pr.ids) for pr in prompts)
    rid, created = new_id("cmpl"), now()

    def echo_text(index: int) -> str:
        return echo_texts[index // n] if echo else ""

    if body.stream:
        options = body.stream_options or StreamOptions()
        fmt = CompletionStream(rid, created, service.model_name, echo_text, len(specs), options.include_usage)
        return sse_response(stream_events(service, handle, fmt, prompt_tokens, options, n))

    results = await collect(request, service, handle)
    if results is None:
        return Response(status_code=499)
    choices = []
    for index, result in enumerate(results):
        prefix = echo_text(index)
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(result.logprobs, len(prefix))[0]
            if result.prompt_logprobs is not None:
                logprobs = completion_logprobs(result.prompt_logprobs, 0)[0].extended(logprobs)
        choices.append(
            CompletionChoice(
                index=index, text=prefix + result.text, logprobs=logprobs, finish_reason=result.finish_reason
            )
        )
    stats, completion_tokens = totals(results)
    resp = CompletionResponse(
        id=rid,
        created=created,
        model=service.model_name,
        choices=choices,
        usage=usage(prompt_tokens, completion_tokens, stats, n),
        spec_decode=spec_decode_field(stats),
    )
    return JSONResponse(resp.model_dump(mode="json"))
