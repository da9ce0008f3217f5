"""Reasoning and tool calls end to end (issue #16): a live server over a tiny Qwen3 target built to
answer a fixed script, through httpx and the official `openai` SDK.

The target is a real Qwen3 (4 layers, random embeddings) whose layers add nothing (output
projections zeroed), so the next token depends only on the last one; its LM head maps each script
token to the next. Greedy decoding therefore writes, after the generation prompt's last token:

    <think> REASONING </think> \\n\\n Let me check. <tool_call> CALL1 </tool_call> CALL2 <|im_end|>

where CALL2 is a whole second call inside one token. With `enable_thinking: false` the prompt
ends in the template's empty think block and `\\n\\n`, so the script starts after the reasoning.
The tokenizer has Qwen3's tags as single (non-special) tokens, and the chat template, written for
this test, renders tools, tool calls and tool results the way Qwen3's does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.models import build_tiny_drafter, build_tiny_tokenizer
from tests.fixtures.servers import ServerProcess

CHAT = "/v1/chat/completions"
MODEL = "scripted"
REASONING = "\nI should look up the weather.\n"
ANSWER = "Let me check."
CALL1 = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
CALL2 = '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
SCRIPT = ["<think>", REASONING, "</think>", "\n\n", ANSWER, "<tool_call>", CALL1, "</tool_call>", CALL2]
TEXT = "".join(SCRIPT)
RAW_ANSWER = "".join(SCRIPT[4:])  # the answer when tool calls are not parsed

TEMPLATE = """\
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call these functions; their signatures, one a line:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

To call one, answer with <tool_call>
{"name": <function name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for message in messages -%}
{%- if message.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' -%}
<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content or '' }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role != 'system' -%}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    },
]
ASK = [{"role": "user", "content": "Weather in Paris, and the time?"}]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def build_scripted_target(root: Path) -> tuple[Path, Path]:
    """Save the scripted Qwen3 target (with its tokenizer) and a tiny Domino drafter for it."""
    import torch
    from tokenizers import AddedToken
    from transformers import GenerationConfig

    from model.load.checkpoint import save_drafter
    from tests.helpers import tiny_target

    tok = build_tiny_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in dict.fromkeys(["\n\n", *SCRIPT])])
    tok.chat_template = TEMPLATE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.convert_tokens_to_ids(SCRIPT)
    newline = tok.convert_tokens_to_ids("Ċ")  # the generation prompt's last token (byte-level "\n")
    # Each step's successor; "\n\n" ends the thinking-off prompt and follows </think> alike.
    chain = [newline, *ids, eos]
    model = tiny_target(
        vocab=len(tok), layers=4, seed=3, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=eos, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        for layer in model.model.layers:  # the residual stream stays the last token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        for prev, nxt in zip(chain, chain[1:], strict=False):
            # Random 64-d embeddings are nearly orthogonal: this row wins by a wide margin after `prev`.
            head[nxt] = 4.0 * emb[prev] / emb[prev].norm()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id)
    target_dir, drafter_dir = root / "scripted-qwen3", root / "scripted-domino"
    model.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    save_drafter(build_tiny_drafter(model.config, tok.convert_tokens_to_ids("<|mask|>")), drafter_dir, dtype=None)
    return target_dir, drafter_dir


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build_scripted_target(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProcess], scripted: tuple[Path, Path]) -> ServerProcess:
    target, drafter = scripted
    return server_factory(target=target, drafter=drafter, served_model_name=MODEL, max_batch_size=4, max_model_len=2048)


@pytest.fixture(scope="module")
def sdk(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def post(srv: ServerProcess, **body: Any) -> dict[str, Any]:
    r = httpx.post(srv.url + CHAT, json={"messages": ASK, "max_tokens": 40, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(srv: ServerProcess, **body: Any) -> list[dict[str, Any]]:
    payload = {"messages": ASK, "max_tokens": 40, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", srv.url + CHAT, json=payload, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_script_is_what_the_target_writes(srv: ServerProcess, scripted: tuple[Path, Path]) -> None:
    # Without the reasoning parser and tools this is the raw text (the parser is on: auto, <think> in the template).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(scripted[0])
    assert tok.convert_ids_to_tokens(tok.encode("x\n\n"))[-1] == "\n\n"
    body = httpx.post(
        srv.url + "/v1/completions", json={"prompt": "<|im_start|>assistant\n", "max_tokens": 40, "temperature": 0}
    ).json()
    assert body["choices"][0]["text"] == TEXT and body["choices"][0]["finish_reason"] == "stop"
    assert body["spec_decode"]["num_draft_tokens"] > 0  # speculation ran (and was verified away)


# -- reasoning ------------------------------------------------------------------------------------


def test_reasoning_is_split_from_the_answer(srv: ServerProcess, sdk: openai.OpenAI) -> None:
    msg = post(srv)["choices"][0]["message"]
    assert msg == {"role": "assistant", "reasoning_content": REASONING.strip(), "content": RAW_ANSWER}
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0)
    assert r.choices[0].message.model_extra["reasoning_content"] == REASONING.strip()
    assert r.choices[0].message.content == RAW_ANSWER and r.choices[0].finish_reason == "stop"


def test_reasoning_streams_before_the_answer(srv: ServerProcess, sdk: openai.OpenAI) -> None:
    events = stream(srv, stream_options={"include_usage": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    kinds = [k for d in deltas[1:] for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning, then all content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == REASONING.strip()
    assert "".join(d.get("content", "") for d in deltas) == RAW_ANSWER
    assert not any("<think>" in d.get("content", "") + d.get("reasoning_content", "") for d in deltas)
    parts = {"reasoning": "", "content": ""}
    for chunk in sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40, temperature=0, stream=True):
        for choice in chunk.choices:
            parts["reasoning"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += choice.delta.content or ""
    assert parts == {"reasoning": REASONING.strip(), "content": RAW_ANSWER}


def test_enable_thinking_false(srv: ServerProcess) -> None:
    body = post(srv, chat_template_kwargs={"enable_thinking": False})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": RAW_ANSWER}
    events = stream(srv, chat_template_kwargs={"enable_thinking": False})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert not any("reasoning_content" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == RAW_ANSWER


def test_truncated_reasoning(srv: ServerProcess) -> None:
    choice = post(srv, max_tokens=2)["choices"][0]
    assert choice["message"] == {"role": "assistant", "reasoning_content": REASONING.strip(), "content": None}
    assert choice["finish_reason"] == "length"


# -- tool calls -----------------------------------------------------------------------------------


def test_tool_calls(srv: ServerProcess, sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ANSWER
    assert choice.message.model_extra["reasoning_content"] == REASONING.strip()
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_tool_calls_stream(srv: ServerProcess, sdk: openai.OpenAI) -> None:
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                # One delta per complete call: id, name and the whole arguments.
                assert tc.index not in calls and tc.id.startswith("call_") and tc.type == "function"
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments}
    assert finish == "tool_calls" and content == ANSWER
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == CALLS


def test_parallel_tool_calls_false(srv: ServerProcess) -> None:
    for body in (post(srv, tools=TOOLS, parallel_tool_calls=False),):
        calls = body["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_weather"]
    events = stream(srv, tools=TOOLS, parallel_tool_calls=False)
    streamed = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in streamed] == ["get_weather"]


def test_tool_choice_none_is_plain_text(srv: ServerProcess) -> None:
    with_tools = post(srv, tools=TOOLS)
    body = post(srv, tools=TOOLS, tool_choice="none")
    assert body["choices"][0]["message"]["content"] == RAW_ANSWER
    assert "tool_calls" not in body["choices"][0]["message"] and body["choices"][0]["finish_reason"] == "stop"
    # The tools are not shown to the model either.
    assert body["usage"]["prompt_tokens"] < with_tools["usage"]["prompt_tokens"]


def test_a_call_to_an_undeclared_function_is_returned_as_text(srv: ServerProcess) -> None:
    body = post(srv, tools=TOOLS[:1])
    msg = body["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert msg["content"] == ANSWER + CALL2  # the get_time call, verbatim
    assert body["choices"][0]["finish_reason"] == "tool_calls"


# Parameters with a bounded spelling: whatever a masked choice among tied logits picks, the call ends.
BOUNDED = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {key: {"enum": values}},
                "required": [key],
                "additionalProperties": False,
            },
        },
    }
    for name, key, values in [("get_weather", "city", ["Paris", "Rome"]), ("get_time", "tz", ["CET", "UTC"])]
]


@pytest.mark.parametrize(
    ("choice", "names"),
    [("required", {"get_weather", "get_time"}), ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})],
    ids=["required", "named"],
)
def test_forced_tool_choice_is_enforced(srv: ServerProcess, sdk: openai.OpenAI, choice: Any, names: set[str]) -> None:
    """The script answers with text before its calls: constrained decoding replaces the text with a
    call (after the thinking, which stays free), whose arguments follow the function's parameters."""
    import jsonschema

    params = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}
    for stream_it in (False, True):
        kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=BOUNDED, tool_choice=choice, max_tokens=200)
        if stream_it:
            chunks = list(sdk.chat.completions.create(**kwargs, temperature=0, parallel_tool_calls=False, stream=True))
            calls = [tc.function for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
            finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason][-1]
        else:
            out = sdk.chat.completions.create(**kwargs, temperature=0, parallel_tool_calls=False).choices[0]
            calls = [tc.function for tc in out.message.tool_calls or []]
            finish = out.finish_reason
            assert out.message.content is None and out.message.model_extra["reasoning_content"] == REASONING.strip()
        assert len(calls) == 1 and finish == "tool_calls", (calls, finish)
        assert calls[0].name in names
        jsonschema.validate(json.loads(calls[0].arguments), params[calls[0].name])
    # Sampled, parallel calls allowed: still only calls, each valid.
    for seed in range(3):
        out = sdk.chat.completions.create(**kwargs, temperature=1.0, seed=seed).choices[0]
        assert out.finish_reason in ("tool_calls", "length") and out.message.tool_calls, out
        if out.finish_reason == "tool_calls":
            assert out.message.content is None, out
        for call in out.message.tool_calls:
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_forced_tool_choice_needs_a_declared_tool(srv: ServerProcess) -> None:
    for choice, param in [({"type": "function", "function": {"name": "nope"}}, "tool_choice"), ("required", None)]:
        body = {"messages": ASK, "max_tokens": 4, "tool_choice": choice}
        if param is not None:
            body["tools"] = TOOLS
        r = httpx.post(srv.url + CHAT, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_named_tool_choice_gives_exactly_one_call(srv: ServerProcess) -> None:
    """A forced function is called once (OpenAI's and vLLM's answer), though the script writes two
    calls and parallel_tool_calls is left at its default."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = post(srv, tools=BOUNDED, tool_choice=choice, max_tokens=200)
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    events = stream(srv, tools=BOUNDED, tool_choice=choice, max_tokens=200)
    streamed = [tc for e in events for c in e["choices"] for tc in c["delta"].get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in streamed] == ["get_weather"]


def test_strict_tools_are_enforced_under_auto(srv: ServerProcess, sdk: openai.OpenAI) -> None:
    """`strict: true` (the SDK's pydantic_function_tool always sets it): under auto the model may answer
    in text, but a call it opens follows the function's parameters. The script calls
    get_weather(city="Paris"), which this strict schema does not allow."""
    import jsonschema

    params = {
        "get_weather": {**BOUNDED[0]["function"]["parameters"], "properties": {"city": {"enum": ["Rome", "Oslo"]}}},
        "get_time": BOUNDED[1]["function"]["parameters"],
    }
    strict = [
        {"type": "function", "function": {"name": name, "parameters": schema, "strict": True}}
        for name, schema in params.items()
    ]
    for stream_it in (False, True):
        kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=strict, max_tokens=120, temperature=0)
        if stream_it:
            chunks = list(sdk.chat.completions.create(**kwargs, stream=True))
            calls = [tc.function for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
        else:
            out = sdk.chat.completions.create(**kwargs).choices[0]
            calls = [tc.function for tc in out.message.tool_calls or []]
            assert (out.message.content or "").startswith(ANSWER)  # the free text before the call stays
        assert calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), params[call.name])
    # Not strict: the script's own call comes back, which breaks that schema (what strict prevents).
    loose = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in params.items()]
    out = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=loose, max_tokens=40, temperature=0)
    first = out.choices[0].message.tool_calls[0].function
    assert (first.name, json.loads(first.arguments)) == CALLS[0]


def test_tool_results_in_the_history(srv: ServerProcess, sdk: openai.OpenAI, scripted: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    first = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    reply = first.choices[0].message
    history: list[Any] = [*ASK, reply]  # the SDK's own message object, sent back as it is
    for call, result in zip(reply.tool_calls, ["18 °C, sunny", "14:05"], strict=True):
        history.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = sdk.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    # The prompt the server rendered is the template's, with the calls and their results in it.
    tok = AutoTokenizer.from_pretrained(scripted[0])
    wire = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
    for m in wire:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tok.apply_chat_template(wire, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n18 °C, sunny\n</tool_response>" in text and '"city": "Paris"' in text
    assert "I should look up the weather." in text  # the reasoning went back to the template
    assert second.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[1]"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[1]"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}, None),
    ],
    ids=["tool-without-id", "user-with-tool-calls", "call-without-arguments"],
)
def test_malformed_history_gets_400(srv: ServerProcess, message: dict[str, Any], param: str | None) -> None:
    r = httpx.post(srv.url + CHAT, json={"messages": [*ASK, message], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
