"""`Service`: the one place that owns the engine (through its worker), the tokenizer and the
metrics, with the deployment-dependent checks every route applies."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from app.chat_output import ChatOutputParser
from app.errors import APIError, bad_request, server_error
from app.metrics import Metrics
from app.protocol import ChatCompletionRequest, SamplingFields, TokenizeRequest
from app.reasoning import THINK_END, ReasoningParser, prompt_opens_reasoning, reasoning_mode
from app.settings import Settings
from app.tool_parser import CALL_START, ToolCallParser
from app.tool_prompt import with_tool_prompt
from app.worker import EngineWorker, Overloaded, RequestHandle, SequenceSpec, Unavailable
from model.engine import Engine
from model.grammar import Grammar, GrammarCompiler

log = logging.getLogger(__name__)
T = TypeVar("T")

# chat_template_kwargs every template may get (Qwen3's thinking switch); beyond these, only the
# variables the served template itself reads. Never `chat_template`: a client-supplied template is
# code run unbounded in time and memory.
ALLOWED_TEMPLATE_KWARGS = {"enable_thinking"}
# Variables a template reads that are ours to set, not the client's.
TEMPLATE_GLOBALS = {
    *("messages", "tools", "documents", "bos_token", "eos_token", "pad_token", "unk_token"),
    *("raise_exception", "strftime_now", "range", "dict", "namespace", "lipsum", "cycler", "joiner"),
}
# Prompt preparations running at once in threads: one that overruns its time budget keeps its thread
# (a thread cannot be cancelled), so bound how many can.
PREPARE_SLOTS = 4

# Keys of chat_template_kwargs that would clash with our own call to apply_chat_template.
RESERVED_TEMPLATE_KWARGS = {
    "chat_template",
    "conversation",
    "messages",
    "tokenize",
    "return_dict",
    "add_generation_prompt",
    "continue_final_message",
    "return_tensors",
    "return_assistant_tokens_mask",
}


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
        self.template_kwargs = ALLOWED_TEMPLATE_KWARGS | _template_variables(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        self.reasoning = reasoning_mode(settings.reasoning_parser, template)
        # Tools where the template shows them to the model and asks for calls in the format parsed, or,
        # for a template that cannot, where the tool prompt describes them (app/tool_prompt.py).
        self.template_renders_tools = "tools" in _template_names(template) and CALL_START in str(template)
        self.tool_prompt = settings.tool_prompt == "auto" and not self.template_renders_tools
        self.supports_tools = self.template_renders_tools or self.tool_prompt
        # The rendered prompt may exceed the body only by the template's own text.
        self.max_rendered_chars = 4 * settings.max_request_bytes
        self._prepare_slots = asyncio.Semaphore(PREPARE_SLOTS)
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request (~1 s)
        self._grammars_lock = threading.Lock()

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
        """429 before any work on the prompt: an overloaded server should not tokenize or render first."""
        if self.worker.healthy and self.worker.in_flight + num_sequences > self.capacity:
            raise _overloaded(
                f"the server is at capacity ({self.worker.in_flight} sequences in flight, at most {self.capacity}); "
                "retry later"
            )

    def check_template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """The client's chat_template_kwargs, if the served template reads them all (400 otherwise)."""
        for key in kwargs or {}:
            if key not in self.template_kwargs:
                allowed = ", ".join(sorted(self.template_kwargs)) or "none"
                raise bad_request(
                    f"chat_template_kwargs: {key!r} is not accepted (accepted: {allowed})",
                    param=f"chat_template_kwargs.{key}",
                )
        return dict(kwargs or {})

    def check_tools(self, body: ChatCompletionRequest) -> None:
        if body.tool_choice not in (None, "none") and not body.tools:
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        names = [t.function.name for t in body.tools or []]
        if body.forced_tool is not None and body.forced_tool not in names:
            raise bad_request(f"tool_choice: no tool is named {body.forced_tool!r}", param="tool_choice")
        constrained = self.constrained(body)
        if constrained and body.ignore_eos:
            raise bad_request("ignore_eos: cannot be combined with constrained output (it ends at EOS)", "ignore_eos")
        if constrained == "tools" and body.response_format is not None and body.response_format.type != "text":
            raise bad_request(
                "response_format: cannot be combined with tool_choice 'required' or a named function",
                param="response_format",
            )
        if body.use_tools and not self.supports_tools:
            raise bad_request(
                f"tools: not supported for this model: its chat template does not render tools with the "
                f"Hermes/Qwen3 {CALL_START} format this server parses (DOMINO_TOOL_PROMPT=auto would describe "
                "them in the system prompt)",
                param="tools",
            )
        if constrained == "tools_auto" and body.response_format is not None and body.response_format.type != "text":
            raise bad_request(
                "response_format: cannot be combined with strict tools (their calls are constrained already)",
                param="response_format",
            )

    def chat_parser(self, body: ChatCompletionRequest, prompt_text: str) -> ChatOutputParser:
        """How one choice's text is split into reasoning, answer and tool calls."""
        reasoning = None
        if self.reasoning is not None:
            in_reasoning = self.reasoning == "deepseek_r1" or prompt_opens_reasoning(prompt_text)
            reasoning = ReasoningParser(in_reasoning)
        tools = None
        if body.use_tools:
            names = {t.function.name for t in body.tools or []}
            tools = ToolCallParser(names, max_calls=1 if self.one_call(body) else None)
        return ChatOutputParser(reasoning, tools)

    @staticmethod
    def one_call(body: ChatCompletionRequest) -> bool:
        """At most one call: parallel_tool_calls false, or a named tool_choice (as OpenAI and vLLM
        answer a forced function: one call of it)."""
        return body.parallel_tool_calls is False or body.forced_tool is not None

    @staticmethod
    def constrained(body: ChatCompletionRequest) -> str | None:
        """What constrained decoding enforces for a chat request: "tools" (only calls), "tools_auto"
        (free text, but a call of a strict tool follows its parameters), "json" or None."""
        if body.tools and (body.tool_choice == "required" or body.forced_tool is not None):
            return "tools"
        if body.response_format is not None and body.response_format.type != "text":
            return "json"
        if body.use_tools and any(t.function.strict for t in body.tools or []):
            return "tools_auto"
        return None

    def grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:
            if self._grammars is None:
                eos = sorted(self.engine.eos_token_ids) or [self.tokenizer.eos_token_id]
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos)
            return self._grammars

    def grammar(self, body: ChatCompletionRequest, prompt_text: str) -> Grammar | None:
        """The grammar a chat request's output must follow (call off the event loop), or None.
        A reasoning model may think first: the grammar starts after its `</think>`."""
        kind = self.constrained(body)
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
            parallel = not self.one_call(body)
            try:
                if kind == "tools":
                    return compiler.tool_calls(tools, parallel=parallel, think=think)
                return compiler.tool_calls_auto(tools, parallel=parallel, think=think)
            except ValueError as exc:
                raise bad_request(
                    f"tools: a function's parameters are not a usable JSON Schema: {exc}", "tools"
                ) from None
        fmt = body.response_format
        assert fmt is not None
        if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
            return compiler.json_object(think)
        try:
            return compiler.json_schema(fmt.json_schema.schema_, think)
        except ValueError as exc:
            raise bad_request(
                f"response_format.json_schema.schema: {exc}", param="response_format.json_schema.schema"
            ) from None

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

    def render_chat(self, body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[int], str]:
        """The prompt's token ids and text."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("messages: this model has no chat template; use /v1/completions", param="messages")
        messages = []
        for m in body.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text}
            for key in ("name", "tool_call_id", "reasoning_content"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls is not None:
                msg["tool_calls"] = [call.template_form() for call in m.tool_calls]
            messages.append(msg)
        kwargs = self.check_template_kwargs(body.chat_template_kwargs)
        if body.use_tools:  # with tool_choice "none" the model is not shown them
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
            if self.tool_prompt:
                messages = with_tool_prompt(messages, tools)
            else:
                kwargs["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt, **kwargs
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages' fault
            raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None
        if not isinstance(text, str):
            raise bad_request("messages: the chat template did not render text", param="messages")
        if len(text) > self.max_rendered_chars:
            raise bad_request(
                f"messages: the rendered prompt has more than {self.max_rendered_chars} characters", param="messages"
            )
        # The template already wrote any BOS/special tokens it wants.
        return list(self.tokenizer.encode(text, add_special_tokens=False)), text

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


def _template_names(template: Any) -> set[str]:
    """Variables a chat template reads."""
    if not isinstance(template, str):
        return set()
    from jinja2 import Environment, meta

    try:
        return set(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # noqa: BLE001 - an unparsable template fails at render time with a 400
        return set()


def _template_variables(tokenizer: Any) -> set[str]:
    """Variables the tokenizer's chat template reads that a client may set (its documented switches)."""
    names = _template_names(getattr(tokenizer, "chat_template", None))
    return {n for n in names if n not in TEMPLATE_GLOBALS | RESERVED_TEMPLATE_KWARGS}
