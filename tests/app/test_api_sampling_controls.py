"""Sampling controls (issue #16 item 4) and the tokenizer endpoints (item 5) on the shared live server,
through the official `openai` SDK and httpx. Exactness under speculation is checked against HF
`generate` in tests/model/test_logits_processors.py; here: the fields reach the engine and bad values
get OpenAI-shaped 400s. Before the fix every request here got a 400 (fields refused) or a 404."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.servers import ServerProcess

COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _ids(server: ServerProcess, text: str) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _complete(sdk: openai.OpenAI, max_tokens: int = 12, **kwargs: Any) -> Any:
    return sdk.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, **kwargs)


def test_logit_bias_and_bad_words_change_the_greedy_output(server: ServerProcess, sdk: openai.OpenAI) -> None:
    plain = _complete(sdk).choices[0].text
    forced = _ids(server, " fox")[0]
    out = _complete(sdk, logit_bias={str(forced): 100}).choices[0]
    assert _ids(server, out.text) == [forced] * 12 and out.finish_reason == "length"
    # Banning a word the plain answer contains removes it (as written and after a space).
    word = plain.split()[0]
    banned = _complete(sdk, extra_body={"bad_words": [word]}).choices[0].text
    assert banned != plain


def test_min_tokens_holds_back_eos(server: ServerProcess, sdk: openai.OpenAI) -> None:
    eos = _ids(server, "<|im_end|>")
    assert len(eos) == 1
    bias = {str(eos[0]): 100}  # EOS would come first at every position
    short = _complete(sdk, logit_bias=bias)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens == 1
    held = _complete(sdk, logit_bias=bias, extra_body={"min_tokens": 5})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 6


def test_penalties_are_honoured(sdk: openai.OpenAI) -> None:
    plain = _complete(sdk, max_tokens=24).choices[0].text
    for kwargs in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 3.0}},
    ):
        assert _complete(sdk, max_tokens=24, **kwargs).choices[0].text != plain, kwargs
    # Chat takes them too (sampled, seeded: the same twice).
    chat = [
        sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            seed=3,
            presence_penalty=1.0,
            logit_bias={"40": 5},
            extra_body={"min_tokens": 2, "repetition_penalty": 1.2},
        )
        for _ in range(2)
    ]
    assert chat[0].choices[0].message.content == chat[1].choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 9}, "min_tokens"),  # more than max_tokens
        ({"bad_words": ["x" * 300]}, "bad_words"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_bad_values_get_400(server: ServerProcess, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 4, **extra}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"].startswith(param), err


def test_tokenize_detokenize_version(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0, body
    assert body["max_model_len"] == 512
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()
    assert back == {"prompt": PROMPT}
    # Messages are rendered by the chat template, as /v1/chat/completions does.
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": msgs}, timeout=30).json()
    text = httpx.post(server.url + "/detokenize", json={"tokens": chat["tokens"]}, timeout=30).json()["prompt"]
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The usage of a completion counts what /tokenize counts.
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
    assert r.json()["usage"]["prompt_tokens"] == body["count"]
    for path, payload, param in [
        ("/tokenize", {"prompt": "x", "messages": msgs}, None),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/tokenize", {"prompt": "x" * ((1 << 18) + 1)}, "prompt"),  # bounded: far past any context
        ("/detokenize", {"tokens": [1] * ((1 << 17) + 1)}, "tokens"),
    ]:
        r = httpx.post(server.url + path, json=payload, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    # lm-eval's remote tokenizer reads the special tokens and the chat template here.
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == 512 and info["vocab_size"] > 0
    v = httpx.get(server.url + "/version", timeout=30)
    assert v.status_code == 200 and v.json()["version"]
