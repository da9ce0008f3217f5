"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.deps import ServiceDep
from app.errors import ERROR_RESPONSES, bad_request
from app.protocol import CompletionChoice, CompletionRequest, CompletionResponse, SpecDecodeStats, Usage, new_id, now
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

    def opening(self, num_choices: int) -> list[str]:
        return []

    def event(self, event: SeqEvent, spec: SpecDecodeStats | None) -> str | None:
        i, text = event.index, event.text
        if not self.started[i]:
            self.started[i] = True
            text = self.echo_text(i) + text
            self.offsets[i] = len(self.echo_text(i))
        if not text and event.finish_reason is None and not event.logprobs:
            return None
        logprobs = None
        if event.logprobs is not None:
            logprobs, self.offsets[i] = completion_logprobs(event.logprobs, self.offsets[i])
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=event.finish_reason)
        chunk = CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=[choice], spec_decode=spec
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
    if echo and body.logprobs is not None:
        raise bad_request(
            "echo: logprobs of the prompt are not available; do not combine echo with logprobs", param="echo"
        )
    max_tokens = body.max_tokens if body.max_tokens is not None else 16
    service.check_capacity(n * len(raw_prompts))
    prompts = await service.prepare(_tokenize, service, raw_prompts, param="prompt")
    for prompt in prompts:
        service.check_prompt(prompt, max_tokens, "prompt", "max_tokens")
    echo_texts: list[str] = []
    if echo:
        echo_texts = [pr.text if pr.text is not None else service.decode(pr.ids) for pr in prompts]
    specs = service.specs(body, [(pr, max_tokens) for pr in prompts], n, body.logprobs)
    handle = await service.submit(specs)
    prompt_tokens = sum(len(pr.ids) for pr in prompts)
    rid, created = new_id("cmpl"), now()

    def echo_text(index: int) -> str:
        return echo_texts[index // n] if echo else ""

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = CompletionStream(rid, created, service.model_name, echo_text, len(specs), include_usage)
        return sse_response(stream_events(service, handle, fmt, prompt_tokens, include_usage, n))

    results = await collect(request, service, handle)
    if results is None:
        return Response(status_code=499)
    choices = []
    for index, result in enumerate(results):
        prefix = echo_text(index)
        logprobs = completion_logprobs(result.logprobs, len(prefix))[0] if body.logprobs is not None else None
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
