"""Tools on a chat template that cannot render them (the embedded default's, and the tiny ChatML one
here): DOMINO_TOOL_PROMPT=auto describes them in a system-prompt block (app/tool_prompt.py), and
`required` / named choices are enforced by the grammar, so a random tiny model still answers with a
valid call. DOMINO_TOOL_PROMPT=off keeps the 400."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from app.tool_prompt import TOOL_BLOCK_INTRO, TOOL_BLOCK_OUTRO
from tests.fixtures.servers import ServerProcess

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 3}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """The tiny ChatML template (no tools in it); the tiny vocabulary spells the block in ~650 tokens."""
    return server_factory(max_model_len=2048, max_batch_size=2)


def detokenized_prompt(server: ServerProcess, **body: Any) -> str:
    ids = httpx.post(server.url + "/tokenize", json=body, timeout=30).json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]


def test_the_tools_are_described_in_the_system_prompt(server: ServerProcess) -> None:
    text = detokenized_prompt(server, messages=ASK, tools=TOOLS)
    assert text.startswith("<|im_start|>system\n" + TOOL_BLOCK_INTRO)
    for tool in TOOLS:
        assert json.dumps(tool) in text
    assert TOOL_BLOCK_OUTRO + "<|im_end|>\n<|im_start|>user\nWeather in Paris?" in text
    # A system message keeps its text, the block after it; past calls and results become text.
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = detokenized_prompt(server, messages=history, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + TOOL_BLOCK_INTRO)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    # Without tools nothing is added.
    assert TOOL_BLOCK_INTRO not in detokenized_prompt(server, messages=ASK)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_choices_give_valid_calls(server: ServerProcess, choice: Any) -> None:
    for seed in range(3):
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 120, "seed": seed}
        r = httpx.post(server.url + CHAT, json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        if out["finish_reason"] == "length":
            continue  # a random model may write a long string argument; the grammar still held
        calls = out["message"]["tool_calls"]
        assert out["finish_reason"] == "tool_calls" and calls, out
        if isinstance(choice, dict):
            assert len(calls) == 1
        for call in calls:
            if call["function"]["name"] == "get_weather":
                jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
            else:
                assert call["function"]["name"] == "get_time"


def test_auto_is_accepted_and_answers(server: ServerProcess) -> None:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_tool_prompt_off_refuses_tools(server_factory: Callable[..., ServerProcess]) -> None:
    off = server_factory(tool_prompt="off", max_batch_size=1)
    r = httpx.post(off.url + CHAT, json={"messages": ASK, "tools": TOOLS, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "DOMINO_TOOL_PROMPT" in r.json()["error"]["message"]
    off.stop()
