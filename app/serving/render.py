"""Chat prompts: the served template, the `chat_template_kwargs` a client may set, and the tools
(shown by the template, or by app/tool_prompt.py where the template cannot). Shared by
/v1/chat/completions and /tokenize, which must render alike."""

from __future__ import annotations

from typing import Any

from app.errors import bad_request
from app.protocol import ChatCompletionRequest, TokenizeRequest
from app.tool_parser import CALL_START
from app.tool_prompt import with_tool_prompt

# chat_template_kwargs every template may get (Qwen3's thinking switch); beyond these, only the
# variables the served template itself reads. Never `chat_template`: a client-supplied template is
# code run unbounded in time and memory.
ALLOWED_TEMPLATE_KWARGS = {"enable_thinking"}
# Variables a template reads that are ours to set, not the client's.
TEMPLATE_GLOBALS = {
    *("messages", "tools", "documents", "bos_token", "eos_token", "pad_token", "unk_token"),
    *("raise_exception", "strftime_now", "range", "dict", "namespace", "lipsum", "cycler", "joiner"),
}
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


class ChatRenderer:
    """Renders a request's messages (and tools) with the served chat template."""

    def __init__(self, tokenizer: Any, tool_prompt: str, max_rendered_chars: int) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template = template if isinstance(template, str) else None
        names = template_names(self.template)
        self.template_kwargs = ALLOWED_TEMPLATE_KWARGS | {
            n for n in names if n not in TEMPLATE_GLOBALS | RESERVED_TEMPLATE_KWARGS
        }
        # Tools where the template shows them to the model and asks for calls in the format parsed, or,
        # for a template that cannot, where the tool prompt describes them (app/tool_prompt.py).
        self.template_renders_tools = "tools" in names and CALL_START in (self.template or "")
        self.tool_prompt = tool_prompt == "auto" and not self.template_renders_tools
        self.supports_tools = self.template_renders_tools or self.tool_prompt
        # The rendered prompt may exceed the body only by the template's own text.
        self.max_rendered_chars = max_rendered_chars

    def check(self, body: ChatCompletionRequest | TokenizeRequest) -> None:
        """What can be refused before rendering: chat_template_kwargs the template does not read,
        and tools it cannot show (400)."""
        for key in body.chat_template_kwargs or {}:
            if key not in self.template_kwargs:
                allowed = ", ".join(sorted(self.template_kwargs)) or "none"
                raise bad_request(
                    f"chat_template_kwargs: {key!r} is not accepted (accepted: {allowed})",
                    param=f"chat_template_kwargs.{key}",
                )
        if body.use_tools and not self.supports_tools:
            raise bad_request(
                f"tools: not supported for this model: its chat template does not render tools with the "
                f"Hermes/Qwen3 {CALL_START} format this server parses (DOMINO_TOOL_PROMPT=auto would describe "
                "them in the system prompt)",
                param="tools",
            )

    def render(self, body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[int], str]:
        """The prompt's token ids and text (call off the event loop, after `check`)."""
        if self.template is None:
            raise bad_request("messages: this model has no chat template; use /v1/completions", param="messages")
        messages = []
        for m in body.messages or []:
            msg: dict[str, Any] = {"role": m.role, "content": m.text}
            for key in ("name", "tool_call_id", "reasoning_content"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls is not None:
                msg["tool_calls"] = [call.template_form() for call in m.tool_calls]
            messages.append(msg)
        kwargs = dict(body.chat_template_kwargs or {})
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


def template_names(template: str | None) -> set[str]:
    """Variables a chat template reads."""
    if template is None:
        return set()
    from jinja2 import Environment, meta

    try:
        return set(meta.find_undeclared_variables(Environment().parse(template)))
    except Exception:  # noqa: BLE001 - an unparsable template fails at render time with a 400
        return set()
