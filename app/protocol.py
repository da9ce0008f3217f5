"""Wire format: OpenAI-compatible request and response models.

Requests are strict (no string-to-number coercion, no NaN/inf) and closed: a field that is not part
of the API gets a 400 naming it, and so does an OpenAI field this server does not honour, unless it
carries the value that means "off" (a silent drop would answer as if it had been honoured). Fields
that only concern billing or tracing (`IGNORED_FIELDS`) are accepted and ignored. Numbers that depend
on the deployment (n, stop counts, context length) are checked in the routes against the settings.

One file for the whole wire format, as vLLM keeps its protocol.py: it is declarations and field
validation only, and one place to read is worth more than its length (over 700 lines).
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

from app.nesting import MAX_JSON_DEPTH, json_depth
from model.engine.requests import SamplingParams

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
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# /tokenize and /detokenize: more than any served context holds, far less than the body limit allows.
MAX_TOKENIZE_CHARS = 1 << 18
MAX_DETOKENIZE_TOKENS = 1 << 17


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


def _is_empty(value: Any) -> bool:
    return not value


# OpenAI fields this server does not honour: (accepted when, why not / what to use instead). Any
# other value gets a 400 naming the field; null is always accepted (it means the default, "off").
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
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
    # vLLM's extension (guidellm always sends it): usage so far on every chunk.
    continuous_usage_stats: bool = False


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

    @field_validator("stream_options", mode="after")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI answers: options for a stream that is not asked for are a client mistake.
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    # Logits processors (model/engine/logits_processors.py), exact under speculation.
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's, over the generated tokens")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's, over the generated tokens")
    logit_bias: dict[str, float] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias in [-100, 100], added to its logit"
    )
    repetition_penalty: float | None = Field(
        None, gt=0, le=100, description="vLLM/HF: logits of prompt and output tokens divided (or, negative, multiplied)"
    )
    min_tokens: int | None = Field(
        None, ge=0, description="vLLM: EOS and stop_token_ids held back until this many tokens"
    )
    bad_words: list[str] | None = Field(
        None, max_length=MAX_BAD_WORDS, description="vLLM: words never generated (as tokenized, and after a space)"
    )

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _bias_entries(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            # ASCII digits only: str.isdigit() also takes "²" or "٣", which int() rejects or reads.
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"values must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("bad_words", mode="after")
    @classmethod
    def _bad_word_sizes(cls, value: list[str] | None) -> list[str] | None:
        for word in value or []:
            if not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"each bad word must be non-blank and at most {MAX_BAD_WORD_CHARS} characters")
        return value

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
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
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
            seed=self.seed + seed_offset if self.seed is not None else None,  # the engine hashes it
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens or 0,
        )


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; checked by hand for a readable error.
    prompt: Any
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with echo, the prompt's tokens get theirs too (the first: null)"
    )
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

    @field_validator("arguments", mode="after")
    @classmethod
    def _bounded_nesting(cls, value: str) -> str:
        # Parsed for the chat template: bounded like the body itself (app/nesting.py).
        if json_depth(value) > MAX_JSON_DEPTH:
            raise ValueError(f"nests more than {MAX_JSON_DEPTH} levels deep")
        return value


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
        # As OpenAI answers: every message but an assistant's carrying tool calls needs content.
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "content is required"
                + (" (an assistant message without tool_calls needs content)" if self.role == "assistant" else "")
            )
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
    strict: bool | None = Field(
        None, description="true: the call's arguments follow `parameters` (constrained decoding), under auto too"
    )


class JsonSchemaFormat(_Request):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="a JSON Schema; absent: any JSON object")
    strict: bool | None = Field(None, description="always enforced: the output validates against the schema")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is needed with type 'json_schema', and only there")
        return self


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
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema: enforced by constrained decoding (model/engine/grammar.py)"
    )
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
        None,
        description="'auto' (default with tools), 'none', or, enforced by constrained decoding, 'required' "
        "and a named function ({'type': 'function', 'function': {'name': ...}})",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call is returned")

    _off_chat = field_validator(
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
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            function = value.get("function")
            if (
                set(value) == {"type", "function"}
                and value["type"] == "function"
                and isinstance(function, dict)
                and set(function) == {"name"}
                and isinstance(function["name"], str)
            ):
                return value
            raise ValueError("a named choice is {'type': 'function', 'function': {'name': <a tool's name>}}")
        raise ValueError("must be 'none', 'auto', 'required' or a named function")

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice calls."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

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


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a `prompt` as /v1/completions encodes it, or `messages` as the chat
    template renders them for /v1/chat/completions."""

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TOKENIZE_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = Field(True, description="prompt only: as /v1/completions does")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, bool | int | float | str | None] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    return_token_strs: bool = False

    _kwarg_values = field_validator("chat_template_kwargs", mode="after")(
        ChatCompletionRequest._kwarg_values.__func__  # type: ignore[attr-defined]
    )

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages is needed")
        return self

    @property
    def use_tools(self) -> bool:
        return bool(self.tools)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


# -- responses ------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int  # prompt tokens whose keys/values came from the prefix cache


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class SpecDecodeStats(_Response):
    """The request's speculative decoding statistics (summed over its choices)."""

    num_drafts: int  # verify steps
    num_steps_with_drafts: int  # verify steps that verified at least one draft (the rest: plain decoding)
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float | None  # (accepted + verify steps) / verify steps


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extended(self, more: CompletionLogprobs) -> CompletionLogprobs:
        """These entries followed by more's (the prompt's, then the completion's)."""
        return CompletionLogprobs(
            tokens=self.tokens + more.tokens,
            token_logprobs=self.token_logprobs + more.token_logprobs,
            top_logprobs=self.top_logprobs + more.top_logprobs,
            text_offset=self.text_offset + more.text_offset,
        )


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


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfoResponse(_Response):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int  # the served context (max_model_len)
    vocab_size: int


class VersionResponse(_Response):
    version: str
