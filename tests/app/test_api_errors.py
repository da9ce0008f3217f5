"""A battery of bad requests: each gets a 4xx in OpenAI's error shape, and the server stays healthy
and correct afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.fixtures.servers import ServerProcess

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]
VOCAB_HUGE = 10**30

# (id, method, path, JSON body or raw bytes, expected status, expected `param` or None to skip the check)
CASES: list[tuple[str, str, str, Any, int, str | None]] = [
    ("malformed-json", "POST", COMPLETIONS, b'{"prompt": "x", "max_tokens": ', 400, None),
    ("json-array-body", "POST", COMPLETIONS, b"[1, 2, 3]", 400, None),
    ("json-string-body", "POST", COMPLETIONS, b'"hello"', 400, None),
    ("empty-body", "POST", COMPLETIONS, b"", 400, None),
    ("invalid-utf8", "POST", COMPLETIONS, b'{"prompt": "\xff\xfe\xfa"}', 400, None),
    ("nan-literal", "POST", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("prompt-missing", "POST", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("prompt-number", "POST", COMPLETIONS, {"prompt": 42}, 400, "prompt"),
    ("prompt-null", "POST", COMPLETIONS, {"prompt": None}, 400, "prompt"),
    ("prompt-empty-string", "POST", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("prompt-empty-list", "POST", COMPLETIONS, {"prompt": []}, 400, "prompt"),
    ("prompt-mixed-list", "POST", COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt"),
    ("prompt-empty-token-list", "POST", COMPLETIONS, {"prompt": [[]]}, 400, "prompt"),
    ("prompt-bools", "POST", COMPLETIONS, {"prompt": [True, False]}, 400, "prompt"),
    ("prompt-negative-id", "POST", COMPLETIONS, {"prompt": [5, -1]}, 400, "prompt"),
    ("prompt-id-beyond-vocab", "POST", COMPLETIONS, {"prompt": [5, 100_000]}, 400, "prompt"),
    ("prompt-id-huge", "POST", COMPLETIONS, {"prompt": [VOCAB_HUGE]}, 400, "prompt"),
    ("prompt-float-ids", "POST", COMPLETIONS, {"prompt": [1.5, 2.0]}, 400, "prompt"),
    ("prompt-too-long", "POST", COMPLETIONS, {"prompt": [5] * 600}, 400, "prompt"),
    ("max-tokens-negative", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-zero", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-string", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-float", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("max-tokens-huge", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("temperature-negative", "POST", COMPLETIONS, {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("temperature-too-high", "POST", COMPLETIONS, {"prompt": "x", "temperature": 7}, 400, "temperature"),
    ("temperature-string", "POST", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top-p-zero", "POST", COMPLETIONS, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", "POST", COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top-k-negative", "POST", COMPLETIONS, {"prompt": "x", "top_k": -3}, 400, "top_k"),
    ("n-zero", "POST", COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    ("n-too-many", "POST", COMPLETIONS, {"prompt": "x", "n": 1000}, 400, "n"),
    ("n-times-prompts-too-many", "POST", COMPLETIONS, {"prompt": ["a"] * 20, "n": 4}, 400, "n"),
    ("seed-huge", "POST", COMPLETIONS, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("seed-string", "POST", COMPLETIONS, {"prompt": "x", "seed": "1"}, 400, "seed"),
    ("logprobs-too-many", "POST", COMPLETIONS, {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("logprobs-negative", "POST", COMPLETIONS, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("stop-ints", "POST", COMPLETIONS, {"prompt": "x", "stop": [1, 2]}, 400, "stop"),
    ("stop-dict", "POST", COMPLETIONS, {"prompt": "x", "stop": {"a": 1}}, 400, "stop"),
    ("stop-nested-list", "POST", COMPLETIONS, {"prompt": "x", "stop": [["a"]]}, 400, "stop"),
    ("stop-too-many", "POST", COMPLETIONS, {"prompt": "x", "stop": [f"s{i}" for i in range(40)]}, 400, "stop"),
    (
        "stop-token-ids-beyond-vocab",
        "POST",
        COMPLETIONS,
        {"prompt": "x", "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
    ),
    ("stop-token-ids-strings", "POST", COMPLETIONS, {"prompt": "x", "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ("stream-string", "POST", COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (
        "stream-options-wrong",
        "POST",
        COMPLETIONS,
        {"prompt": "x", "stream": True, "stream_options": 3},
        400,
        "stream_options",
    ),
    # OpenAI's and vLLM's answers to what real clients got wrong (all were accepted once).
    (
        "stream-options-without-stream",
        "POST",
        COMPLETIONS,
        {"prompt": "x", "stream_options": {}},
        400,
        "stream_options",
    ),
    (
        "chat-stream-options-stream-false",
        "POST",
        CHAT,
        {"messages": OK_MESSAGES, "stream": False, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("stop-empty", "POST", COMPLETIONS, {"prompt": "x", "stop": ""}, 400, "stop"),
    ("stop-empty-in-list", "POST", CHAT, {"messages": OK_MESSAGES, "stop": ["a", ""]}, 400, "stop"),
    ("chat-user-without-content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0]"),
    (
        "chat-assistant-without-content-or-calls",
        "POST",
        CHAT,
        {"messages": [*OK_MESSAGES, {"role": "assistant"}, *OK_MESSAGES]},
        400,
        "messages[1]",
    ),
    ("max-tokens-zero-without-echo", "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("logit-bias-superscript-digit", "POST", COMPLETIONS, {"prompt": "x", "logit_bias": {"²": 1}}, 400, "logit_bias"),
    ("logit-bias-circled-digit", "POST", COMPLETIONS, {"prompt": "x", "logit_bias": {"①": 1}}, 400, "logit_bias"),
    ("logit-bias-arabic-digit", "POST", COMPLETIONS, {"prompt": "x", "logit_bias": {"٣": 1}}, 400, "logit_bias"),
    ("logit-bias-signed", "POST", COMPLETIONS, {"prompt": "x", "logit_bias": {"+3": 1}}, 400, "logit_bias"),
    (
        "nested-metadata-990",
        "POST",
        COMPLETIONS,
        b'{"prompt": "x", "metadata": {"a": ' + b"[" * 990 + b"]" * 990 + b"}}",
        400,
        None,
    ),
    (
        "nested-schema-990",
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
        b'"json_schema": {"name": "n", "schema": ' + b'{"a": ' * 990 + b"1" + b"}" * 990 + b"}}}",
        400,
        None,
    ),
    (
        "nested-tool-call-arguments-990",
        "POST",
        CHAT,
        {
            "messages": [
                *OK_MESSAGES,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 990 + "]" * 990}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        },
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("unknown-model", "POST", COMPLETIONS, {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("chat-unknown-model", "POST", CHAT, {"messages": OK_MESSAGES, "model": "nope"}, 404, "model"),
    ("chat-messages-missing", "POST", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("chat-messages-empty", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("chat-messages-not-list", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("chat-bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("chat-content-number", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    (
        "chat-image-part",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        None,
    ),
    ("chat-top-logprobs-alone", "POST", CHAT, {"messages": OK_MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "chat-top-logprobs-too-many",
        "POST",
        CHAT,
        {"messages": OK_MESSAGES, "logprobs": True, "top_logprobs": 10},
        400,
        "top_logprobs",
    ),
    (
        "chat-template-kwargs-list",
        "POST",
        CHAT,
        {"messages": OK_MESSAGES, "chat_template_kwargs": [1]},
        400,
        "chat_template_kwargs",
    ),
    (
        "chat-max-completion-tokens-zero",
        "POST",
        CHAT,
        {"messages": OK_MESSAGES, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("chat-too-long", "POST", CHAT, {"messages": [{"role": "user", "content": "hello world " * 400}]}, 400, None),
    ("get-on-post-route", "GET", COMPLETIONS, None, 405, None),
    ("unknown-route", "POST", "/v1/embeddings", {"input": "x"}, 404, None),
]


def request(server: ServerProcess, method: str, path: str, body: Any) -> httpx.Response:
    kwargs: dict[str, Any] = {"timeout": 30}
    if isinstance(body, bytes):
        kwargs |= {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kwargs["json"] = body
    return httpx.request(method, server.url + path, **kwargs)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_gets_an_openai_error(
    server: ServerProcess, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    r = request(server, method, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        # The field itself, or a path inside it ("stop_token_ids[0]").
        assert err["param"] == param or err["param"].startswith((param + "[", param + ".")), err
    assert r.status_code != 422


def test_context_length_error_names_the_numbers(server: ServerProcess) -> None:
    r = request(server, "POST", COMPLETIONS, {"prompt": [5] * 500, "max_tokens": 20})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    for number in ("512", "520", "500", "20"):
        assert number in err["message"]


def test_server_healthy_and_correct_after_the_battery(
    server: ServerProcess, tiny_hf: tuple[Any, Any], greedy_reference: Any
) -> None:
    assert len(CASES) >= 30
    for _, method, path, body, _, _ in CASES:  # once more, back to back
        assert 400 <= request(server, method, path, body).status_code < 500
    assert httpx.get(server.url + "/health").status_code == 200
    ids = tiny_hf[1].encode("after the storm")
    r = request(server, "POST", COMPLETIONS, {"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert r.json()["choices"][0]["text"] == greedy_reference(ids, 12)[1]
