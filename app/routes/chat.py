"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from app.chat_output import ChatOutputParser
from app.deps import ServiceDep
from app.errors import ERROR_RESPONSES, bad_request
from app.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCallOut,
    SpecDecodeStats,
    StreamOptions,
    ToolCallDelta,
    ToolCallOut,
    Usage,
    new_id,
    now,
)
from app.responses import chat_logprobs, collect, spec_decode_field, sse, sse_response, stream_events, totals, usage
from app.service import Prompt
from app.worker import SeqEvent

router = APIRouter(responses=ERROR_RESPONSES)


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    # A call ends the turn: the client runs it and answers. A cut answer stays "length".
    return "tool_calls" if called_tools and reason == "stop" else reason


class ChatStream:
    """SSE chunks of /v1/chat/completions: deltas carry only the keys that changed; reasoning and
    tool calls are split out of each choice's text as it streams."""

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        include_usage: bool,
        num_choices: int,
        new_parser: Callable[[], ChatOutputParser],
    ) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.parsers = [new_parser() for _ in range(num_choices)]
        self.calls = [0] * num_choices  # tool calls sent per choice (their stream index)
        # With include_usage every chunk carries "usage": null, as OpenAI's do.
        self.omit: tuple[str, ...] = ("spec_decode",) if include_usage else ("usage", "spec_decode")

    def _chunk(self, choices: list[ChatStreamChoice], spec: SpecDecodeStats | None, totals: Usage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=totals, spec_decode=spec
        )
        data = chunk.model_dump(mode="json")
        for choice in data["choices"]:  # OpenAI deltas carry only the keys that changed
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(data, omit_none=self.omit)

    def opening(self, num_choices: int, running: Usage | None = None) -> list[str]:
        # OpenAI opens every choice with the assistant role and empty content.
        delta = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(index=i, delta=delta)], None, running) for i in range(num_choices)]

    def event(self, event: SeqEvent, spec: SpecDecodeStats | None, running: Usage | None = None) -> str | None:
        i = event.index
        parsed = self.parsers[i].feed(event.text, final=event.finish_reason is not None)
        calls = []
        for call in parsed.tool_calls:  # each complete call in one delta: id, name and all arguments
            calls.append(
                ToolCallDelta(
                    index=self.calls[i], id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments)
                )
            )
            self.calls[i] += 1
        nothing = not (parsed.reasoning or parsed.content or calls) and not event.logprobs
        if nothing and event.finish_reason is None and running is None:
            return None
        delta = DeltaMessage(
            reasoning_content=parsed.reasoning or None, content=parsed.content or None, tool_calls=calls or None
        )
        logprobs = chat_logprobs(event.logprobs) if event.logprobs is not None else None
        finish = finish_reason(event.finish_reason, self.calls[i] > 0)
        choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self._chunk([choice], spec, running)

    def tail(self, totals: Usage, spec: SpecDecodeStats) -> str:
        return self._chunk([], spec, totals)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, service: ServiceDep) -> Response:
    service.check_model(body.model)
    n = service.check_counts(body, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    service.check_template_kwargs(body.chat_template_kwargs)
    service.check_tools(body)
    service.check_capacity(n)
    ids, prompt_text = await service.prepare(service.render_chat, body, param="messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # Without a limit the answer may use the rest of the context (at least one token).
    max_tokens = requested if requested is not None else max(1, service.max_model_len - len(ids))
    prompt = Prompt(ids, None)
    service.check_prompt(prompt, max_tokens, "messages", tokens_param)
    grammar = None
    if service.constrained(body) is not None:
        grammar = await service.prepare(service.grammar, body, prompt_text, param="response_format")
    handle = await service.submit(service.specs(body, [(prompt, max_tokens)], n, logprobs, grammar))
    rid, created = new_id("chatcmpl"), now()

    if body.stream:
        options = body.stream_options or StreamOptions()
        fmt = ChatStream(
            rid, created, service.model_name, options.include_usage, n, lambda: service.chat_parser(body, prompt_text)
        )
        return sse_response(stream_events(service, handle, fmt, len(ids), options, n))

    results = await collect(request, service, handle)
    if results is None:
        return Response(status_code=499)
    choices = []
    for index, result in enumerate(results):
        parsed = service.chat_parser(body, prompt_text).feed(result.text, final=True)
        calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in parsed.tool_calls
        ]
        # No answer besides the reasoning or the calls: null, as OpenAI sends with tool calls.
        content = parsed.content if parsed.content or not (calls or parsed.reasoning) else None
        message = ChatMessageOut(content=content, reasoning_content=parsed.reasoning or None, tool_calls=calls or None)
        choices.append(
            ChatChoice(
                index=index,
                message=message,
                logprobs=chat_logprobs(result.logprobs) if logprobs is not None else None,
                finish_reason=finish_reason(result.finish_reason, bool(calls)),
            )
        )
    stats, completion_tokens = totals(results)
    resp = ChatCompletionResponse(
        id=rid,
        created=created,
        model=service.model_name,
        choices=choices,
        usage=usage(len(ids), completion_tokens, stats, n),
        spec_decode=spec_decode_field(stats),
    )
    return JSONResponse(resp.model_dump(mode="json"))
