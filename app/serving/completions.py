"""POST /v1/completions, whole: prompts (text or token ids), echo and the prompt's logprobs
(scoring), submission, the stream and the JSON body."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from app.errors import bad_request
from app.events import SeqEvent
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
from app.service import Prompt, Service
from app.serving.responses import collect, completion_logprobs, sse, sse_response, stream_events, totals


def split_prompts(prompt: Any) -> list[str | list[int]]:
    """A request's prompts: a string, a list of strings, token ids or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, int) for x in prompt):
        return [prompt]
    return list(prompt)


class CompletionStream:
    """SSE chunks of one response: echo text (and the prompt's logprobs) open each choice; logprob
    text offsets run on."""

    def __init__(self, rid: str, created: int, model: str, echo_texts: list[str], include_usage: bool) -> None:
        self.rid, self.created, self.model, self.echo_texts = rid, created, model, echo_texts
        self.offsets = [0] * len(echo_texts)
        self.started = [False] * len(echo_texts)
        # With include_usage every chunk carries "usage": null, as OpenAI's do.
        self.omit: tuple[str, ...] = ("spec_decode",) if include_usage else ("usage", "spec_decode")

    def opening(self, num_choices: int, running: Usage | None = None) -> list[str]:
        return []

    def event(self, event: SeqEvent, spec_decode: SpecDecodeStats | None, running: Usage | None = None) -> str | None:
        i, text = event.index, event.text
        logprobs = None
        if not self.started[i]:
            self.started[i] = True
            text = self.echo_texts[i] + text
            if event.prompt_logprobs is not None:  # echo with logprobs: the prompt's come first
                logprobs = completion_logprobs(event.prompt_logprobs, 0)[0]
            self.offsets[i] = len(self.echo_texts[i])
        if not (text or event.progressed or running is not None):
            return None
        if event.logprobs is not None:
            generated, self.offsets[i] = completion_logprobs(event.logprobs, self.offsets[i])
            logprobs = generated if logprobs is None else logprobs.extended(generated)
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=event.finish_reason)
        chunk = CompletionResponse(
            id=self.rid,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=running,
            spec_decode=spec_decode,
        )
        return sse(chunk, omit_none=self.omit)

    def tail(self, usage: Usage, spec_decode: SpecDecodeStats) -> str:
        chunk = CompletionResponse(
            id=self.rid, created=self.created, model=self.model, choices=[], usage=usage, spec_decode=spec_decode
        )
        return sse(chunk)


class CompletionServing:
    """Owns the flow of a completion; one per app, over the shared `Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def _tokenize(self, raw_prompts: list[str | list[int]]) -> list[Prompt]:
        encode = self.service.encode_text
        return [Prompt(encode(raw), raw) if isinstance(raw, str) else Prompt(list(raw), None) for raw in raw_prompts]

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        service = self.service
        service.check_model(body.model)
        raw_prompts = split_prompts(body.prompt)
        n = service.check_counts(body, len(raw_prompts))
        echo = bool(body.echo)
        if body.max_tokens == 0 and not echo:
            raise bad_request("max_tokens: 0 is only accepted with echo (scoring the prompt)", param="max_tokens")
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        service.check_capacity(n * len(raw_prompts))
        prompts = await service.prepare(self._tokenize, raw_prompts, param="prompt")
        for prompt in prompts:
            service.check_prompt(prompt, max_tokens, "prompt", "max_tokens")
        # Choice i answers prompt i // n; with echo it opens with that prompt's text.
        echo_texts = [""] * (n * len(prompts))
        if echo:
            texts = [pr.text if pr.text is not None else service.decode(pr.ids) for pr in prompts]
            echo_texts = [texts[i // n] for i in range(n * len(prompts))]
        # echo with logprobs scores the prompt too (lm-eval's loglikelihood), from the target's prefill.
        prompt_logprobs = body.logprobs if echo else None
        specs = service.specs(
            body, [(pr, max_tokens) for pr in prompts], n, body.logprobs, prompt_logprobs=prompt_logprobs
        )
        handle = await service.submit(specs)
        prompt_tokens = sum(len(pr.ids) for pr in prompts)
        rid, created = new_id("cmpl"), now()
        if body.stream:
            options = body.stream_options or StreamOptions()
            stream = CompletionStream(rid, created, service.model_name, echo_texts, options.include_usage)
            return sse_response(stream_events(handle, stream, prompt_tokens, options, n))

        results = await collect(request, handle)
        if results is None:
            return Response(status_code=499)
        choices = []
        for index, result in enumerate(results):
            prefix = echo_texts[index]
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
        usage, spec_decode = totals(results, prompt_tokens, n)
        resp = CompletionResponse(
            id=rid, created=created, model=service.model_name, choices=choices, usage=usage, spec_decode=spec_decode
        )
        return JSONResponse(resp.model_dump(mode="json"))
