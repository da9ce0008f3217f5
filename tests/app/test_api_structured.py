"""Structured output (issue #16 item 3) on the shared live server through the official `openai` SDK:
every `json_schema` answer validates against its schema (`jsonschema`), greedy and sampled at
temperature 1 with several seeds, under speculation; invalid schemas get 400. The shared tiny
target's template has Qwen3's thinking switch: `enable_thinking: false` closes the think block in
the prompt, so the whole answer is the JSON. Before the fix every request here got a 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pydantic_core
import pytest

from tests.fixtures.servers import ServerProcess

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "Describe a fox as JSON."}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
# Bounded, so a random target must finish (every string and number has a largest spelling).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "legs": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "brown", "grey"]},
        "wild": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "legs", "color", "wild", "tags"],
    "additionalProperties": False,
}
BAD_PATTERN = {"type": "string", "pattern": "(["}
FORMAT = {"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ask(sdk: openai.OpenAI, **kwargs: Any) -> Any:
    return sdk.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=120, response_format=FORMAT, extra_body=NO_THINK, **kwargs
    )


def test_json_schema_output_validates_greedy_and_sampled(sdk: openai.OpenAI) -> None:
    greedy = _ask(sdk, temperature=0)
    outputs = [greedy.choices[0]]
    sampled = _ask(sdk, temperature=1.0, n=4, seed=11)
    outputs += sampled.choices
    outputs += _ask(sdk, temperature=1.0, n=4, seed=12, stream=False).choices
    for choice in outputs:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({c.message.content for c in outputs}) > 3  # sampling really varied the answers
    assert greedy.model_extra["spec_decode"]["num_draft_tokens"] > 0  # verified under speculation


def test_json_schema_streams_the_same_answer(server: ServerProcess, sdk: openai.OpenAI) -> None:
    whole = _ask(sdk, temperature=1.0, seed=5).choices[0].message.content
    parts = [
        chunk.choices[0].delta.content or ""
        for chunk in _ask(sdk, temperature=1.0, seed=5, stream=True)
        if chunk.choices
    ]
    assert "".join(parts) == whole


def test_json_object_is_an_object(sdk: openai.OpenAI) -> None:
    out = sdk.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body=NO_THINK,
    ).choices[0]
    # A random target need not close its object within max_tokens (this one does not): then what it
    # wrote is a JSON prefix. Both outcomes are checked, neither passes by default.
    content = out.message.content
    assert content.startswith("{") and out.finish_reason in ("stop", "length"), out
    if out.finish_reason == "stop":
        assert isinstance(json.loads(content), dict), content
    else:
        # pydantic_core's partial parser takes a truncated document and refuses a malformed one.
        assert isinstance(pydantic_core.from_json(content, allow_partial=True), dict), content


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_PATTERN}}, "schema"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
        ({"type": "yaml"}, "type"),
    ],
)
def test_invalid_schemas_get_400(server: ServerProcess, fmt: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + CHAT, json={"messages": ASK, "max_tokens": 4, "response_format": fmt}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"].startswith("response_format") and err["param"].endswith(param), err


# An object that must nest for ever, behind a free choice with integers: it compiles, and fails only
# along outputs that open the object. A logit bias on "{" makes the tiny target take that branch.
NESTS_FOREVER = {
    "$defs": {"loop": {"type": "object", "properties": {"b": {"$ref": "#/$defs/loop"}}, "required": ["b"]}},
    "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/loop"}],
}
LEAKS = ("%json", "x-guidance", "lark", "answer", "start:")


def test_a_grammar_failing_mid_generation_is_an_error_never_a_stop(server: ServerProcess, tiny_hf: Any) -> None:
    """Once the output can no longer follow the schema, the choice fails with an OpenAI-style error
    that says so (before: 200 with invalid JSON and finish_reason "stop")."""
    brace = tiny_hf[1].convert_tokens_to_ids("{")
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": NESTS_FOREVER}}
    body = {
        "messages": ASK,
        "max_tokens": 400,
        "response_format": fmt,
        "logit_bias": {str(brace): 100},
        **NO_THINK,
    }
    r = httpx.post(server.url + CHAT, json={**body, "temperature": 0}, timeout=60)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "grammar_error" and "schema" in err["message"], err
    assert not any(leak in err["message"] for leak in LEAKS)
    with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True, "seed": 3}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "grammar_error"
    assert all(c["finish_reason"] in (None,) for e in events[:-1] for c in e.get("choices", []))
    # The server goes on serving constrained requests.
    out = httpx.post(
        server.url + CHAT, json={"messages": ASK, "max_tokens": 120, "response_format": FORMAT, **NO_THINK}, timeout=60
    ).json()["choices"][0]
    jsonschema.validate(json.loads(out["message"]["content"]), SCHEMA)
