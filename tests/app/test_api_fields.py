"""No silent drops (issue #16): a field this server does not honour gets a 400 naming it, never a 200
that ignores it; unknown fields too. Billing/tracing fields are accepted and ignored, and every
unsupported field is accepted with the value that means "off".

Before the fix every request in REJECTED but the two logprobs bounds was answered 200 with free text
(unknown and unsupported fields were dropped); tools were ignored as well."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.servers import ServerProcess, metric, scrape_metrics

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
BASE = {COMPLETIONS: {"prompt": "Hello", "max_tokens": 2}, CHAT: {"messages": HI, "max_tokens": 2}}

# (endpoint, extra body, the `param` the 400 must name)
REJECTED: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"top_logprobs": 6, "logprobs": True}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": 20}, "logprobs"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"suffix": "!"}, "suffix"),
    # Not part of the API at all (or vLLM extensions this server does not implement).
    (COMPLETIONS, {"frobnicate": {"x": 1}}, "frobnicate"),
    (CHAT, {"min_p": 0.1}, "min_p"),
    (CHAT, {"guided_json": {"type": "object"}}, "guided_json"),
    (CHAT, {"echo": True}, "echo"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "usage_every": 2}}, None),
    (CHAT, {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]},
        "messages[0].content[0].cache",
    ),
]


def prompt_tokens(server: ServerProcess) -> float:
    return metric(scrape_metrics(server.url), "domino_prompt_tokens_total")


@pytest.mark.parametrize(("path", "extra", "param"), REJECTED, ids=[f"{p[4:]}-{next(iter(e))}" for p, e, _ in REJECTED])
def test_fields_not_honoured_get_400_naming_them(
    server: ServerProcess, path: str, extra: dict[str, Any], param: str | None
) -> None:
    before = prompt_tokens(server)
    r = httpx.post(server.url + path, json={**BASE[path], **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is None:  # nested: the param names the path into the body
        assert err["param"] == "stream_options.usage_every", err
    else:
        assert err["param"] == param, err
        assert err["message"].startswith(param + ":"), err
    assert "not supported" in err["message"] or "unrecognized" in err["message"] or "less than" in err["message"]
    assert prompt_tokens(server) == before  # refused before any generation


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_billing_and_tracing_fields_are_accepted_and_ignored(server: ServerProcess, path: str) -> None:
    extra = {
        "user": "u-1",
        "metadata": {"team": "a"},
        "store": False,
        "service_tier": "auto",
        "safety_identifier": "s-1",
        "prompt_cache_key": "k",
    }
    plain = httpx.post(server.url + path, json={**BASE[path], "temperature": 0}, timeout=30).json()
    r = httpx.post(server.url + path, json={**BASE[path], **extra, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"]


def test_off_values_of_unsupported_fields_are_accepted(server: ServerProcess) -> None:
    chat = {
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logit_bias": {},
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "functions": [],
        "function_call": "none",
        "audio": None,
        "reasoning_effort": None,
    }
    r = httpx.post(server.url + CHAT, json={**BASE[CHAT], **chat}, timeout=30)
    assert r.status_code == 200, r.text
    comp = {"presence_penalty": 0, "logit_bias": {}, "best_of": 2, "n": 2, "suffix": ""}
    r = httpx.post(server.url + COMPLETIONS, json={**BASE[COMPLETIONS], **comp}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text


def test_openai_sdk_sees_the_400(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, reasoning_effort="low")
    assert err.value.param == "reasoning_effort" and "not supported" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=3)
    assert err.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, extra_body={"min_p": 0.1})
    assert err.value.param == "min_p"


def test_tools_on_a_template_that_cannot_render_them(server: ServerProcess) -> None:
    # The shared tiny target's template has no tools: the tool prompt describes them instead
    # (tests/app/test_api_tool_prompt.py; with DOMINO_TOOL_PROMPT=off they are refused).
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = httpx.post(server.url + CHAT, json={**BASE[CHAT], "tools": tools}, timeout=30)
    assert r.status_code == 200, r.text
    # tool_choice "none" does not offer them: accepted.
    r = httpx.post(server.url + CHAT, json={**BASE[CHAT], "tools": tools, "tool_choice": "none"}, timeout=30)
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + CHAT, json={**BASE[CHAT], "tool_choice": "auto"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
