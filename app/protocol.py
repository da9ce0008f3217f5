"""Wire format: OpenAI-compatible request and response models.

Requests are strict (no string-to-number coercion, no NaN/inf) and closed: a field that is not part
of the API gets a 400 naming it, and so does an OpenAI field this server does not honour, unless it
carries the value that means "off" (a silent drop would answer as if it had been honoured). Fields
that only concern billing or tracing (`IGNORED_FIELDS`) are accepted and ignored. Numbers that depend
on the deployment (n, stop counts, context length) are checked in the routes against the settings.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from model.engine import SamplingParams

MAX_LOGPROBS = 5  # top alternatives per token, as OpenAI allows for completions
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# Bounds on what a client can make the server hold or scan: top_k goes into an int64 tensor; stop
# strings are searched in every chunk of text; messages are rendered by the chat template.
MAX_TOP_K = 2**31 - 1
MAX_STOP_CHARS = 256  # per stop string
MAX_STOP_BYTES = 4096  # all stop strings together, UTF-8
MAX_MESSAGES = 512
MAX_MESSAGE_CHARS = 1 << 17  # per message (the body limit caps the total)
MAX_TEMPLATE_KWARG_CHARS = 256  # a string value of chat_template_kwargs
MAX_TOOLS = 128  # as OpenAI allows


_SURROGATE = re.compile("[\ud800-\udfff]")


def _first_surrogate(value: Any, path: str = "") -> str | None:
    """Where in value (str, or lists/dicts of them) a lone UTF-16 surrogate sits, or None. JSON can
    carry them ("\\ud800") but they are not Unicode scalar values: no tokenizer or UTF-8 encoder
    takes them."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, list):
        for i, item in enumerate(value):
            hit = _first_surrogate(item, f"{path}[{i}]")
            if hit is not None:
                return hit
    if isinstance(value, dict):
        for key, item in value.items():
            hit = _first_surrogate(key, path) or _first_surrogate(item, f"{path}.{key}")
            if hit is not None:
                return hit
    return None


# OpenAI fields that only concern billing, tracing or storage on OpenAI's side: they change nothing
# in the output, so they are accepted and ignored.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")


def _is_zero(value: Any) -> bool:
    return value == 0


def _is_empty(value: Any) -> bool:
    return not value


# OpenAI fields this server does not honour: (accepted when, why not / what to use instead). Any
# other value gets a 400 naming the field; null is always accepted (it means the default, "off").
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_is_zero, "only 0 is accepted (penalties are not implemented yet)"),
    "presence_penalty": (_is_zero, "only 0 is accepted (penalties are not implemented yet)"),
    "logit_bias": (_is_empty, "only {} is accepted (not implemented yet)"),
    "response_format": (
        lambda v: v == {"type": "text"},
        "only {'type': 'text'} is accepted: json_object and json_schema need constrained decoding, "
        "which is not available yet",
    ),
    "functions": (_is_empty, "deprecated by OpenAI; use tools"),
    "function_call": (lambda v: v == "none", "deprecated by OpenAI; use tool_choice"),
    "audio": (lambda v: False, "audio output is not available"),
    "modalities": (lambda v: v == ["text"], "only ['text'] is accepted"),
    "prediction": (lambda v: False, "predicted outputs are not available"),
    "reasoning_effort": (
        lambda v: False,
        "for Qwen3, chat_template_kwargs.enable_thinking switches thinking off",
    ),
    "verbosity": (lambda v: False, "there is no verbosity control"),
    "web_search_options": (lambda v: False, "web search is not available"),
    "suffix": (_is_empty, "only an empty suffix is accepted (insertion is not implemented)"),
}


def _reject_unless_off(value: Any, info: ValidationInfo) -> Any:
    accepted, why = UNSUPPORTED[str(info.field_name)]
    if value is not None and not accepted(value):
        raise ValueError(f"not supported by this server; {why}")
    return value


def _unsupported(description: str = "not supported: only null or the value meaning 'off'") -> Any:
    return Field(None, description=description)


class _Request(BaseModel):
    # Closed: an unknown field is an error (app.errors names it), never silently dropped.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_scalars_only(cls, value: Any) -> Any:
        where = _first_surrogate(value)
        if where is not None:
            raise ValueError(f"contains a lone surrogate{f' (at {where})' if where else ''}: not valid Unicode text")
        return value


class StreamOptions(_Request):
    include_usage: bool = False


class IgnoredFields(_Request):
    """OpenAI's billing/tracing fields: accepted, and ignored (they do not change the output)."""

    user: str | None = Field(None, description="accepted and ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored (nothing is stored)")
    service_tier: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")


class SamplingFields(IgnoredFields):
    """Fields shared by completions and chat completions. `None` means the default."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="0 or -1: off")
    n: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = _unsupported("only 0: penalties are not implemented yet")
    presence_penalty: float | None = _unsupported("only 0: penalties are not implemented yet")
    logit_bias: dict[str, float] | None = _unsupported("only {}: not implemented yet")

    _off_sampling = field_validator("frequency_penalty", "presence_penalty", "logit_bias")(_reject_unless_off)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            raise ValueError("must be a string or a list of strings")
        return value

    @field_validator("stop", mode="after")
    @classmethod
    def _stop_size(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop string must be at most {MAX_STOP_CHARS} characters")
        # errors="replace": a lone surrogate is reported by the scalar check, not here.
        if sum(len(s.encode("utf-8", errors="replace")) for s in stops) > MAX_STOP_BYTES:
            raise ValueError(f"the stop strings must be at most {MAX_STOP_BYTES} bytes together")
        return value

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed_offset: int = 0) -> SamplingParams:
        """The engine's parameters for one choice; `seed_offset` gives each of the n choices its own seed."""
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,
            seed=self.seed + seed_offset if self.seed is not None else None,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
        )


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; checked by hand for a readable error.
    prompt: Any
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, description="only equal to n: best-of selection is not implemented")
    suffix: str | None = _unsupported("only empty: insertion is not implemented")

    _off_completion = field_validator("suffix")(_reject_unless_off)

    @field_validator("best_of", mode="after")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if value is not None and value != n:
            raise ValueError(f"not supported by this server; only best_of = n ({n}) is accepted (no best-of selection)")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and all(type(t) is int for t in v)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value) or is_ids(value):
                return value
            if all(is_ids(p) for p in value):
                return value
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str = Field(max_length=256)
    arguments: str = Field(description="the call's arguments: a JSON object, as a string")


class ToolCallIn(_Request):
    """A call an earlier assistant message made (history)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn

    def template_form(self) -> dict[str, Any]:
        """As chat templates expect it (HF convention): arguments as an object where they parse as one."""
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        if not isinstance(args, dict):
            args = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, description="assistant messages: the calls it made")
    tool_call_id: str | None = Field(None, max_length=256, description="tool messages: the call answered")
    reasoning_content: str | None = Field(
        None, max_length=MAX_MESSAGE_CHARS, description="assistant messages: their thinking (as this server returns it)"
    )

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.role != "assistant" and (self.tool_calls is not None or self.reasoning_content is not None):
            raise ValueError("tool_calls and reasoning_content belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.role != "tool" and self.tool_call_id is not None:
            raise ValueError("tool_call_id belongs to tool messages")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, value: Any) -> Any:
        # Checked before the str | parts union, whose error would otherwise only say "not a string".
        where = _first_surrogate(value)
        if where is not None:
            raise ValueError(f"contains a lone surrogate{f' (at {where})' if where else ''}: not valid Unicode text")
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content part type {part.get('type')!r} is not supported (only 'text')")
        return value

    @field_validator("content", mode="after")
    @classmethod
    def _content_size(cls, value: str | list[TextPart] | None) -> str | list[TextPart] | None:
        size = len(value) if isinstance(value, str) else sum(len(p.text) for p in value or [])
        if size > MAX_MESSAGE_CHARS:
            raise ValueError(f"a message may have at most {MAX_MESSAGE_CHARS} characters, got {size}")
        return value

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="true is not supported (needs constrained decoding)")

    @field_validator("strict", mode="after")
    @classmethod
    def _not_strict(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError(
                "not supported yet: strict schema adherence needs constrained decoding, which this server does "
                "not have yet"
            )
        return value


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # Only the switches the served template reads are passed on (Service.check_template_kwargs).
    chat_template_kwargs: dict[str, bool | int | float | str | None] | None = None
    response_format: dict[str, Any] | None = _unsupported("only {'type': 'text'}: no structured output yet")
    functions: list[Any] | None = _unsupported("deprecated by OpenAI and not supported: use tools")
    function_call: str | dict[str, Any] | None = _unsupported("deprecated by OpenAI and not supported: use tool_choice")
    audio: dict[str, Any] | None = _unsupported("not supported")
    modalities: list[str] | None = _unsupported("only ['text']")
    prediction: dict[str, Any] | None = _unsupported("not supported")
    reasoning_effort: str | None = _unsupported("not supported (Qwen3: chat_template_kwargs.enable_thinking)")
    verbosity: str | None = _unsupported("not supported")
    web_search_options: dict[str, Any] | None = _unsupported("not supported")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="'auto' (default with tools) or 'none'; 'required' and named functions are not supported yet"
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call is returned")

    _off_chat = field_validator(
        "response_format",
        "functions",
        "function_call",
        "audio",
        "modalities",
        "prediction",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
    )(_reject_unless_off)

    @field_validator("tool_choice", mode="after")
    @classmethod
    def _tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if value is None or value in ("none", "auto"):
            return value
        if value == "required" or isinstance(value, dict):
            raise ValueError(
                "not supported yet: 'required' and named functions need constrained decoding, which this server "
                "does not have yet (use 'auto' or 'none')"
            )
        raise ValueError("must be 'none', 'auto', 'required' or a named function")

    @property
    def use_tools(self) -> bool:
        """Whether tools are offered to the model (and its output parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @field_validator("chat_template_kwargs", mode="after")
    @classmethod
    def _kwarg_values(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, item in (value or {}).items():
            if isinstance(item, str) and len(item) > MAX_TEMPLATE_KWARG_CHARS:
                raise ValueError(f"{key}: at most {MAX_TEMPLATE_KWARG_CHARS} characters")
        return value


# -- responses ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecDecodeStats(_Response):
    """The request's speculative decoding statistics (summed over its choices)."""

    num_drafts: int  # verify steps
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float | None  # (accepted + verify steps) / verify steps


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str  # a JSON object


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int  # the call's position in the message (OpenAI's stream accumulates by it)


class _OmitsAbsent(_Response):
    """Keys that are only present when they carry something (a plain answer looks as before)."""

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatMessageOut(_OmitsAbsent):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class DeltaMessage(_OmitsAbsent):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    spec_decode: SpecDecodeStats | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "domino-serve"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
