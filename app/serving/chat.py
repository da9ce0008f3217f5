"""POST /v1/chat/completions, whole: validation, rendering, the grammar, submission, the stream and
the JSON body. Reasoning and tool calls are split out of each choice's text as it streams."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from app.chat_output import ChatOutputParser
from app.errors import bad_request
from app.events import SeqEvent
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
from app.reasoning import THINK_END, ReasoningParser, prompt_opens_reasoning, reasoning_mode
from app.service import Prompt, Service
from app.serving.render import ChatRenderer
from app.serving.responses import chat_logprobs, collect, sse, sse_response, stream_events, totals
from app.tool_parser import ToolCallParser

if TYPE_CHECKING:
    from model.engine.grammar import Grammar, GrammarCompiler


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    # A call ends the turn: the client runs it and answers. A cut answer stays "length".
    return "tool_calls" if called_tools and reason == "stop" else reason


def one_call(body: ChatCompletionRequest) -> bool:
    """At most one call: parallel_tool_calls false, or a named tool_choice (as OpenAI and vLLM
    answer a forced function: one call of it)."""
    return body.parallel_tool_calls is False or body.forced_tool is not None


def constrained(body: ChatCompletionRequest) -> str | None:
    """What constrained decoding enforces: "tools" (only calls), "tools_auto" (free text, but a call
    follows its function's parameters where the function is strict), "json" or None."""
    if body.tools and (body.tool_choice == "required" or body.forced_tool is not None):
        return "tools"
    if body.response_format is not None and body.response_format.type != "text":
        return "json"
    if body.use_tools and any(t.function.strict for t in body.tools or []):
        return "tools_auto"
    return None


class ChatStream:
    """SSE chunks of one response: deltas carry only the keys that changed."""

    def __init__(
        self, rid: str, created: int, model: str, include_usage: bool, parsers: list[ChatOutputParser]
    ) -> None:
        self.rid, self.created, self.model = rid, created, model
        self.parsers = parsers
        self.calls = [0] * len(parsers)  # tool calls sent per choice (their stream index)
        # With include_usage every chunk carries "usage": null, as OpenAI's do.
        self.omit: tuple[str, ...] = ("spec_decode",) if include_usage else ("usage", "spec_decode")

    def _chunk(
        self, choices: list[ChatStreamChoice], spec_decode: SpecDecodeStats | None, usage: Usage | None = None
    ) -> str:
        chunk = ChatCompletionChunk(
            id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage, spec_decode=spec_decode
        )
        data = chunk.model_dump(mode="json")
        for choice in data["choices"]:  # OpenAI deltas carry only the keys that changed
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(data, omit_none=self.omit)

    def opening(self, num_choices: int, running: Usage | None = None) -> list[str]:
        # OpenAI opens every choice with the assistant role and empty content.
        delta = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(index=i, delta=delta)], None, running) for i in range(num_choices)]

    def event(self, event: SeqEvent, spec_decode: SpecDecodeStats | None, running: Usage | None = None) -> str | None:
        i = event.index
        parsed = self.parsers[i].feed(event.text, final=event.finish_reason is not None)
        calls = []
        for call in parsed.tool_calls:  # each complete call in one delta: id, name and all arguments
            function = FunctionCallOut(name=call.name, arguments=call.arguments)
            calls.append(ToolCallDelta(index=self.calls[i], id=call.id, function=function))
            self.calls[i] += 1
        nothing = not (parsed.reasoning or parsed.content or calls)
        # Held-back text still sends a chunk (`SeqEvent.progressed`); its delta is then empty (`{}`, as
        # OpenAI's last chunk), not `content: ""`, which clients could read as the start of a text
        # answer during a tool call.
        if nothing and not (event.progressed or running is not None):
            return None
        delta = DeltaMessage(
            reasoning_content=parsed.reasoning or None, content=parsed.content or None, tool_calls=calls or None
        )
        logprobs = chat_logprobs(event.logprobs) if event.logprobs is not None else None
        finish = finish_reason(event.finish_reason, self.calls[i] > 0)
        choice = ChatStreamChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish)
        return self._chunk([choice], spec_decode, running)

    def tail(self, usage: Usage, spec_decode: SpecDecodeStats) -> str:
        return self._chunk([], spec_decode, usage)


class ChatServing:
    """Owns the flow of a chat completion; one per app, over the shared `Service`."""

    def __init__(self, service: Service, renderer: ChatRenderer) -> None:
        self.service = service
        self.renderer = renderer
        self.reasoning = reasoning_mode(service.settings.reasoning_parser, renderer.template)
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request (~1 s)
        self._grammars_lock = threading.Lock()

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        service = self.service
        service.check_model(body.model)
        n = service.check_counts(body, 1)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        self.check_tools(body)
        self.renderer.check(body)
        service.check_capacity(n)
        ids, prompt_text = await service.prepare(self.renderer.render, body, param="messages")
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        # Without a limit the answer may use the rest of the context (at least one token).
        max_tokens = requested if requested is not None else max(1, service.max_model_len - len(ids))
        prompt = Prompt(ids, None)
        service.check_prompt(prompt, max_tokens, "messages", tokens_param)
        grammar = None
        if constrained(body) is not None:
            grammar = await service.prepare(self.grammar, body, prompt_text, param="response_format")
        handle = await service.submit(service.specs(body, [(prompt, max_tokens)], n, logprobs, grammar))
        rid, created = new_id("chatcmpl"), now()
        if body.stream:
            options = body.stream_options or StreamOptions()
            parsers = [self.output_parser(body, prompt_text) for _ in range(n)]
            stream = ChatStream(rid, created, service.model_name, options.include_usage, parsers)
            return sse_response(stream_events(handle, stream, len(ids), options, n))

        results = await collect(request, handle)
        if results is None:
            return Response(status_code=499)
        choices = []
        for index, result in enumerate(results):
            parsed = self.output_parser(body, prompt_text).feed(result.text, final=True)
            calls = [
                ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                for c in parsed.tool_calls
            ]
            # No answer besides the reasoning or the calls: null, as OpenAI sends with tool calls.
            content = parsed.content if parsed.content or not (calls or parsed.reasoning) else None
            message = ChatMessageOut(
                content=content, reasoning_content=parsed.reasoning or None, tool_calls=calls or None
            )
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=chat_logprobs(result.logprobs) if logprobs is not None else None,
                    finish_reason=finish_reason(result.finish_reason, bool(calls)),
                )
            )
        usage, spec_decode = totals(results, len(ids), n)
        resp = ChatCompletionResponse(
            id=rid, created=created, model=service.model_name, choices=choices, usage=usage, spec_decode=spec_decode
        )
        return JSONResponse(resp.model_dump(mode="json"))

    def check_tools(self, body: ChatCompletionRequest) -> None:
        if body.tool_choice not in (None, "none") and not body.tools:
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        names = [t.function.name for t in body.tools or []]
        if body.forced_tool is not None and body.forced_tool not in names:
            raise bad_request(f"tool_choice: no tool is named {body.forced_tool!r}", param="tool_choice")
        kind = constrained(body)
        if kind and body.ignore_eos:
            raise bad_request("ignore_eos: cannot be combined with constrained output (it ends at EOS)", "ignore_eos")
        json_format = body.response_format is not None and body.response_format.type != "text"
        if kind == "tools" and json_format:
            raise bad_request(
                "response_format: cannot be combined with tool_choice 'required' or a named function",
                param="response_format",
            )
        if json_format and body.use_tools and any(t.function.strict for t in body.tools or []):
            raise bad_request(
                "response_format: cannot be combined with strict tools (their calls are constrained already)",
                param="response_format",
            )

    def output_parser(self, body: ChatCompletionRequest, prompt_text: str) -> ChatOutputParser:
        """How one choice's text is split into reasoning, answer and tool calls."""
        reasoning = None
        if self.reasoning is not None:
            in_reasoning = self.reasoning == "deepseek_r1" or prompt_opens_reasoning(prompt_text)
            reasoning = ReasoningParser(in_reasoning)
        tools = None
        if body.use_tools:
            names = {t.function.name for t in body.tools or []}
            tools = ToolCallParser(names, max_calls=1 if one_call(body) else None)
        return ChatOutputParser(reasoning, tools)

    def grammar_compiler(self) -> GrammarCompiler:
        from model.engine.grammar import GrammarCompiler

        with self._grammars_lock:
            if self._grammars is None:
                tokenizer = self.service.tokenizer
                eos = sorted(self.service.eos_token_ids) or [tokenizer.eos_token_id]
                self._grammars = GrammarCompiler(tokenizer, self.service.vocab_size, eos)
            return self._grammars

    def grammar(self, body: ChatCompletionRequest, prompt_text: str) -> Grammar | None:
        """The grammar a chat request's output must follow (call off the event loop), or None.
        A reasoning model may think first: the grammar starts after its `</think>`."""
        kind = constrained(body)
        if kind is None:
            return None
        think = "none"  # no reasoning parser, or the template closed the block (Qwen3 enable_thinking: false)
        if self.reasoning is not None and not prompt_text.rstrip().endswith(THINK_END):
            opened = self.reasoning == "deepseek_r1" or prompt_opens_reasoning(prompt_text)
            think = "open" if opened else "optional"
        compiler = self.grammar_compiler()
        if kind in ("tools", "tools_auto"):
            # Under auto only strict tools promise their parameters; the others' arguments are any object.
            tools = {
                t.function.name: t.function.parameters if kind == "tools" or t.function.strict else None
                for t in body.tools or []
            }
            if body.forced_tool is not None:
                tools = {body.forced_tool: tools[body.forced_tool]}
            parallel = not one_call(body)
            try:
                if kind == "tools":
                    return compiler.tool_calls(tools, parallel=parallel, think=think)
                return compiler.tool_calls_auto(tools, parallel=parallel, think=think)
            except ValueError as exc:
                raise bad_request(
                    f"tools: a function's parameters are not a usable JSON Schema: {exc}", "tools"
                ) from None
        response_format = body.response_format
        assert response_format is not None
        schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
        if response_format.type == "json_object" or schema is None:
            return compiler.json_object(think)
        try:
            return compiler.json_schema(schema, think)
        except ValueError as exc:
            raise bad_request(
                f"response_format.json_schema.schema: {exc}", param="response_format.json_schema.schema"
            ) from None
