"""The service end to end: a real uvicorn subprocess on a loopback port, tiny target + Domino drafter.

Greedy outputs are compared with Hugging Face `generate` on the same tiny model, one prompt alone.
Over 500 lines: the endpoints' shared behaviour against one live server, started once per module.
"""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.servers import ServerProcess, metric, scrape_metrics
from tests.fixtures.waiting import wait_for

MODEL = "tiny"
PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "日本語のテキスト",
    "def add(a, b):",
    "Emoji: 🙂 🚀",
    "Speculative decoding drafts",
    "naïve café",
    "print(add(1, 2))",
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> httpx.Client:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def tok(tiny_hf: tuple[Any, Any]) -> Any:
    return tiny_hf[1]


def sse_events(response: httpx.Response) -> list[Any]:
    """Parse an SSE body strictly: every event is exactly `data: <json>\\n\\n`, the last `[DONE]`."""
    raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    return events[:-1]


def stream_post(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def check_spec(spec: dict[str, Any]) -> None:
    assert set(spec) == {
        "num_drafts",
        "num_steps_with_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "mean_acceptance_length",
    }
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert 0 <= spec["num_steps_with_drafts"] <= spec["num_drafts"]
    assert (spec["num_steps_with_drafts"] > 0) == (spec["num_draft_tokens"] > 0)
    if spec["num_drafts"]:
        want = (spec["num_accepted_tokens"] + spec["num_drafts"]) / spec["num_drafts"]
        assert math.isclose(spec["mean_acceptance_length"], want)


# -- basic endpoints ------------------------------------------------------------------------------


def test_health_models_and_metrics(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 512
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    samples = scrape_metrics(str(client.base_url))
    assert ("domino_num_requests_running", frozenset({("model_name", MODEL)})) in samples
    # KV memory by blocks: all free while nothing runs (the worker sets the gauges before a request).
    assert metric(samples, "domino_kv_cache_blocks", state="free") > 0
    assert metric(samples, "domino_kv_cache_blocks", state="used") == 0
    assert ("domino_kv_cache_usage_perc", frozenset({("model_name", MODEL)})) in samples


# -- completions ----------------------------------------------------------------------------------


def test_completion_greedy_matches_reference(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    for prompt in PROMPTS[:4]:
        ids = tok.encode(prompt)
        ref_ids, ref_text, ref_finish = greedy_reference(ids, 24)
        body = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        ).json()
        assert body["object"] == "text_completion" and body["model"] == MODEL
        choice = body["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (ref_text, ref_finish)
        assert body["usage"] == {
            "prompt_tokens": len(ids),
            "completion_tokens": len(ref_ids),
            "total_tokens": len(ids) + len(ref_ids),
            "prompt_tokens_details": {"cached_tokens": 0},  # no earlier prompt began like these
        }
        check_spec(body["spec_decode"])
        # Every verify step commits at least one token; the prefill commits the first.
        assert body["spec_decode"]["num_drafts"] <= len(ref_ids) - 1


def test_token_id_prompts_and_batches(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    batch = [tok.encode(p) for p in PROMPTS[4:7]]
    single = client.post("/v1/completions", json={"prompt": batch[0], "max_tokens": 12, "temperature": 0}).json()
    assert single["choices"][0]["text"] == greedy_reference(batch[0], 12)[1]
    many = client.post("/v1/completions", json={"prompt": batch, "max_tokens": 12, "temperature": 0}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert [c["text"] for c in many["choices"]] == [greedy_reference(ids, 12)[1] for ids in batch]
    assert many["usage"]["prompt_tokens"] == sum(map(len, batch))
    strings = client.post("/v1/completions", json={"prompt": PROMPTS[4:7], "max_tokens": 12, "temperature": 0})
    assert [c["text"] for c in strings.json()["choices"]] == [c["text"] for c in many["choices"]]


def test_completion_stream_matches_non_stream(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    prompt = PROMPTS[2]
    _, ref_text, ref_finish = greedy_reference(tok.encode(prompt), 30)
    events = stream_post(
        client,
        "/v1/completions",
        {
            "prompt": prompt,
            "max_tokens": 30,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    *content, usage_chunk = events
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in content)
    assert "".join(e["choices"][0]["text"] for e in content) == ref_text
    # finish_reason only on the last content chunk.
    assert [e["choices"][0]["finish_reason"] for e in content] == [None] * (len(content) - 1) + [ref_finish]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 30 - (ref_finish == "stop")
    check_spec(usage_chunk["spec_decode"])
    assert all("spec_decode" not in e for e in content)
    # Without include_usage: no usage key, and the statistics ride on the final content chunk.
    events = stream_post(
        client, "/v1/completions", {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True}
    )
    assert all("usage" not in e for e in events)
    assert "spec_decode" in events[-1] and all("spec_decode" not in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events) == ref_text


def test_a_step_whose_tokens_have_no_text_still_sends_a_chunk(client: httpx.Client, tok: Any) -> None:
    # Every token a skipped special token: no text at all, yet each step that generated tokens sends
    # a chunk (before: one chunk, the last), so a stream's cadence is the engine's.
    bias = {str(tok.convert_tokens_to_ids("<|im_start|>")): 100}
    body = {"max_tokens": 8, "temperature": 0, "stream": True, "logit_bias": bias}
    events = stream_post(client, "/v1/completions", {**body, "prompt": "Hello world"})
    assert [e["choices"][0]["text"] for e in events] == [""] * len(events)
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]
    assert len(events) >= 2  # the prompt's step gave the first token, a later one the last
    events = stream_post(client, "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]})
    opening, *steps = events
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in steps] == [{}] * len(steps)  # no content key: no text began
    assert [e["choices"][0]["finish_reason"] for e in steps] == [None] * (len(steps) - 1) + ["length"]
    assert len(steps) >= 2


def test_echo(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    body = client.post(
        "/v1/completions", json={"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "echo": True}
    ).json()
    assert body["choices"][0]["text"] == "Hello world" + greedy_reference(tok.encode("Hello world"), 5)[1]
    events = stream_post(
        client,
        "/v1/completions",
        {"prompt": "Hello world", "max_tokens": 5, "temperature": 0, "echo": True, "stream": True},
    )
    assert "".join(e["choices"][0]["text"] for e in events) == body["choices"][0]["text"]


def _prompt_logprobs_reference(model: Any, ids: list[int]) -> Any:
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_echo_with_logprobs_scores_the_prompt(client: httpx.Client, tiny_hf: tuple[Any, Any]) -> None:
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs, max_tokens 0 or 1. The prompt's
    logprobs are the target's own (HF's forward), the first one null; greedy continues as without echo."""
    model, tok = tiny_hf
    prompts = [tok.encode("The quick brown fox jumps"), tok.encode("Hello world, hello server")]
    refs = [_prompt_logprobs_reference(model, ids) for ids in prompts]
    body = client.post(
        "/v1/completions",
        json={"prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0},
    ).json()
    assert body["usage"]["completion_tokens"] == 0
    for ids, ref, choice in zip(prompts, refs, body["choices"]):
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
        for t in range(1, len(ids)):
            assert abs(lp["token_logprobs"][t] - float(ref[t - 1, ids[t]])) < 1e-4
            top = lp["top_logprobs"][t]
            assert len(top) == 2 and abs(max(top.values()) - float(ref[t - 1].max())) < 1e-4
        assert lp["text_offset"] == sorted(lp["text_offset"])
    # max_tokens 1 (lm-eval's default): the prompt's entries, then the generated token's.
    ids, ref = prompts[0], refs[0]
    one = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    ).json()["choices"][0]
    lp = one["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    assert abs(lp["token_logprobs"][-1] - float(ref[-1].max())) < 1e-4  # greedy: the argmax, scored
    assert one["text"] == tok.decode(ids) + tok.decode([int(ref[-1].argmax())])
    assert lp["text_offset"][-1] == len(tok.decode(ids))
    # Streamed: the first chunk carries the prompt's logprobs; together they are the same.
    events = stream_post(
        client,
        "/v1/completions",
        {"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0, "stream": True},
    )
    streamed = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    whole = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    ).json()["choices"][0]
    assert streamed == whole["logprobs"]["token_logprobs"] and len(streamed) == len(ids) + 3
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]


def test_continuous_usage_stats(client: httpx.Client) -> None:
    """vLLM's extension, always sent by guidellm: the usage so far on every chunk."""
    for path, extra in (
        ("/v1/completions", {"prompt": "Hello world"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        events = stream_post(
            client,
            path,
            {
                **extra,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
        usages = [e["usage"] for e in events]
        assert all(u is not None for u in usages)
        assert len({u["prompt_tokens"] for u in usages}) == 1
        done = [u["completion_tokens"] for u in usages]
        assert done == sorted(done) and done[-1] == 6 and events[-1]["choices"] == []
        assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # Without it, the chunks carry usage: null (include_usage) as before.
    events = stream_post(
        client,
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert all(e["usage"] is None for e in events[:-1])


def test_n_and_seeds(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    req = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 1234}
    a = client.post("/v1/completions", json=req).json()
    b = client.post("/v1/completions", json=req).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # seeded: reproducible
    assert len({c["text"] for c in a["choices"]}) > 1  # seed + i per choice: different samples
    check_spec(a["spec_decode"])
    # n with several prompts: choice index = prompt index * n + sample index; greedy samples agree.
    many = client.post(
        "/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0, "n": 2}
    ).json()
    want = [greedy_reference(tok.encode(p), 8)[1] for p in PROMPTS[:2]]
    assert [c["text"] for c in many["choices"]] == [want[0], want[0], want[1], want[1]]
    # Streaming n > 1: chunks carry their choice index; each choice finishes once.
    events = stream_post(client, "/v1/completions", {**req, "stream": True})
    texts = ["", "", ""]
    finishes = []
    for e in events:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finishes.append(c["index"])
    assert texts == [c["text"] for c in a["choices"]] and sorted(finishes) == [0, 1, 2]
    assert events[-1]["spec_decode"] == a["spec_decode"]


def test_stop_strings_and_stop_token_ids(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    prompt = PROMPTS[3]
    ids = tok.encode(prompt)
    ref_ids, ref_text, _ = greedy_reference(ids, 40)
    # A stop string taken from the middle of the greedy answer, spanning tokens.
    start = next(
        i
        for i in range(4, len(ref_text) - 3)
        if ref_text.find(ref_text[i : i + 3]) == i and "\ufffd" not in ref_text[i : i + 3]
    )
    stop = ref_text[start : start + 3]
    for stream in (False, True):
        req = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": ["zzzz-never", stop], "stream": stream}
        if stream:
            events = stream_post(client, "/v1/completions", req)
            text = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            choice = client.post("/v1/completions", json=req).json()["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        assert (text, finish) == (ref_text[:start], "stop")
    # A single string works too.
    one = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": stop}
    ).json()
    assert one["choices"][0]["text"] == ref_text[:start]
    # stop_token_ids: generation ends at that token, which is not rendered.
    k = next(i for i in range(2, len(ref_ids)) if ref_ids.index(ref_ids[i]) == i)
    body = client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "stop_token_ids": [ref_ids[k]]}
    ).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == tok.decode(ref_ids[:k], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == k + 1


def eos_prompt(model: Any, eos: int) -> list[int]:
    """A two-token prompt whose greedy next token is EOS (searched in batched forwards)."""
    import torch

    vocab = model.config.vocab_size
    with torch.no_grad():
        for second in range(4, vocab):
            batch = torch.stack([torch.arange(vocab), torch.full((vocab,), second)], 1)
            hits = (model(batch).logits[:, -1].argmax(-1) == eos).nonzero().flatten().tolist()
            if hits:
                return [hits[0], second]
    raise AssertionError("no prompt leads to EOS")


def test_eos_and_ignore_eos(client: httpx.Client, tok: Any, tiny_hf: Any, greedy_reference: Any) -> None:
    ids = eos_prompt(tiny_hf[0], tok.eos_token_id)
    assert greedy_reference(ids, 5)[0] == [tok.eos_token_id]
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0}).json()
    # The EOS token counts as generated but is never rendered.
    assert body["choices"][0] | {"index": 0} == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 1
    body = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    ).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5


def test_logprobs(client: httpx.Client, tok: Any, tiny_hf: Any, greedy_reference: Any) -> None:
    import torch

    model = tiny_hf[0]
    ids = tok.encode(PROMPTS[0])
    ref_ids, ref_text, _ = greedy_reference(ids, 6)
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3}).json()
    lp = body["choices"][0]["logprobs"]
    n = len(ref_ids) - (ref_ids[-1] == tok.eos_token_id)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    with torch.no_grad():
        logits = model(torch.tensor([ids + ref_ids])).logits[0, len(ids) - 1 : len(ids) - 1 + n]
    want = torch.log_softmax(logits.float(), -1)
    for i in range(n):
        assert math.isclose(lp["token_logprobs"][i], float(want[i, ref_ids[i]]), abs_tol=1e-4)
        top = lp["top_logprobs"][i]
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(lp["token_logprobs"][i], abs=1e-6)
    # Streamed logprobs add up to the same.
    events = stream_post(
        client, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 3, "stream": True}
    )
    streamed = [t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    # Chat logprobs: OpenAI's content list with bytes.
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content)
    raw = b"".join(bytes(c["bytes"]) for c in content)
    assert raw.decode("utf-8", errors="replace") == chat["choices"][0]["message"]["content"]
    no_lp = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ).json()
    assert no_lp["choices"][0]["logprobs"] is None


# -- chat -----------------------------------------------------------------------------------------


def chat_ids(tok: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def test_chat_non_stream_and_stream(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 🙂"}]
    ids = chat_ids(tok, messages)
    ref_ids, ref_text, ref_finish = greedy_reference(ids, 20)
    body = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_completion_tokens": 20, "temperature": 0},
    ).json()
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": ref_text}
    assert choice["finish_reason"] == ref_finish
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == len(ref_ids)
    check_spec(body["spec_decode"])

    events = stream_post(
        client,
        "/v1/chat/completions",
        {
            "messages": messages,
            "max_tokens": 20,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, usage_chunk = events[1:]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in content) == ref_text
    assert [e["choices"][0]["finish_reason"] for e in content][-1] == ref_finish
    assert all(e["choices"][0]["finish_reason"] is None for e in content[:-1])
    assert usage_chunk["choices"] == []
    # The same prompt again: every full 8-token block of it (one token left to forward) is cached now.
    cached = usage_chunk["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert cached == (len(ids) - 1) // 8 * 8 > 0
    assert usage_chunk["usage"] == {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    assert usage_chunk["spec_decode"] == body["spec_decode"]


def test_chat_template_kwargs_pass_through(client: httpx.Client, tok: Any, greedy_reference: Any) -> None:
    messages = [{"role": "user", "content": "Think?"}]
    on = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
    off = client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    ).json()
    ids_off = chat_ids(tok, messages, enable_thinking=False)
    assert off["usage"]["prompt_tokens"] == len(ids_off) > on["usage"]["prompt_tokens"]
    assert off["choices"][0]["message"]["content"] == greedy_reference(ids_off, 6)[1]


# -- the official OpenAI SDK ----------------------------------------------------------------------


def test_openai_sdk(server: ServerProcess, tok: Any, greedy_reference: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = PROMPTS[1]
    _, ref_text, ref_finish = greedy_reference(tok.encode(prompt), 16)
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert c.choices[0].text == ref_text and c.choices[0].finish_reason == ref_finish
    # Draft tokens verified, not verify steps: `ar` mode counts steps too (num_drafts > 0 without a drafter).
    assert c.model_extra["spec_decode"]["num_draft_tokens"] >= 1
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref_text
    assert chunks[-1].usage.completion_tokens == c.usage.completion_tokens

    messages = [{"role": "user", "content": "Hello there"}]
    ids = chat_ids(tok, messages)
    _, chat_text, chat_finish = greedy_reference(ids, 16)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=16, temperature=0, extra_body={"top_k": 0}
    )
    assert r.choices[0].message.content == chat_text and r.choices[0].finish_reason == chat_finish
    assert r.model_extra["spec_decode"]["mean_acceptance_length"] >= 1
    parts, finish, usage, spec = [], None, None, None
    for ch in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for choice in ch.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        usage = ch.usage or usage
        spec = (ch.model_extra or {}).get("spec_decode") or spec
    assert ("".join(parts), finish) == (chat_text, chat_finish)
    assert usage.prompt_tokens == len(ids) and spec == r.model_extra["spec_decode"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert "maximum context length is 512" in str(err.value)


# -- concurrency, cancellation --------------------------------------------------------------------


def test_16_concurrent_streams_match_greedy_alone(server: ServerProcess, tok: Any, greedy_reference: Any) -> None:
    prompts = [f"{p} #{i}" for i, p in enumerate(PROMPTS * 2)]
    want = [greedy_reference(tok.encode(p), 24)[1] for p in prompts]
    got: list[str | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        try:
            with httpx.Client(base_url=server.url, timeout=120) as c:
                barrier.wait()
                with c.stream(
                    "POST",
                    "/v1/completions",
                    json={"prompt": prompts[i], "max_tokens": 24, "temperature": 0, "stream": True},
                ) as r:
                    assert r.status_code == 200
                    got[i] = "".join(e["choices"][0]["text"] for e in sse_events(r))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert got == want


def wait_idle(url: str, timeout: float = 10.0) -> dict[Any, float]:
    """/metrics once nothing runs or waits (an assertion error if that never happens)."""

    def busy(samples: dict[Any, float]) -> float:
        return metric(samples, "domino_num_requests_running") + metric(samples, "domino_num_requests_waiting")

    return wait_for(lambda: scrape_metrics(url), timeout, until=lambda s: busy(s) == 0, what="an idle server")


def test_client_disconnect_cancels_the_request(server: ServerProcess) -> None:
    before = wait_idle(server.url)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            running = scrape_metrics(server.url)  # a running request holds KV blocks
            assert metric(running, "domino_kv_cache_blocks", state="used") > 0
            assert metric(running, "domino_kv_cache_usage_perc") > 0
        # Leaving the block closes the connection mid-stream.
    started = time.monotonic()
    after = wait_idle(server.url)
    assert time.monotonic() - started < 5
    assert metric(after, "domino_num_requests_running") == 0
    aborted = metric(after, "domino_request_success_total", finished_reason="abort")
    assert aborted == metric(before, "domino_request_success_total", finished_reason="abort") + 1
    generated = metric(after, "domino_generation_tokens_total") - metric(before, "domino_generation_tokens_total")
    assert generated < 400
    # The same for a non-streaming request whose client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 400, "ignore_eos": True},
            timeout=httpx.Timeout(30, read=0.5),
        )
    final = wait_idle(server.url)
    assert metric(final, "domino_num_requests_running") == 0
    assert metric(final, "domino_request_success_total", finished_reason="abort") == aborted + 1
    assert metric(final, "domino_kv_cache_blocks", state="used") == 0  # the aborted rows gave theirs back
    # The start-up line accounts for the KV memory.
    kv_line = r"KV cache: \d+ blocks x 16 tokens = \d+ tokens \(.*\); \d+ rows? fits?"
    assert re.search(kv_line, server.log_path.read_text())
    assert metric(final, "domino_generation_tokens_total") - metric(after, "domino_generation_tokens_total") < 400
    # The server is still fine.
    assert httpx.get(server.url + "/health").status_code == 200


# -- metrics --------------------------------------------------------------------------------------


def test_metrics_counters_move_by_the_expected_amounts(server: ServerProcess, client: httpx.Client) -> None:
    before = wait_idle(server.url)
    bodies = [
        client.post("/v1/completions", json={"prompt": p, "max_tokens": 20, "temperature": 0}).json()
        for p in PROMPTS[:3]
    ]
    bodies.append(
        client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hey"}], "max_tokens": 10, "temperature": 0},
        ).json()
    )
    after = scrape_metrics(server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    usage = [b["usage"] for b in bodies]
    spec = [b["spec_decode"] for b in bodies]
    assert delta("domino_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("domino_generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    drafts = sum(s["num_drafts"] for s in spec)
    accepted = sum(s["num_accepted_tokens"] for s in spec)
    assert delta("domino_spec_decode_num_drafts_total") == drafts
    assert delta("domino_spec_decode_num_draft_tokens_total") == sum(s["num_draft_tokens"] for s in spec)
    assert delta("domino_spec_decode_num_accepted_tokens_total") == accepted
    assert delta("domino_spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert delta("domino_acceptance_length_count") == drafts
    assert delta("domino_acceptance_length_sum") == accepted + drafts
    reasons = [b["choices"][0]["finish_reason"] for b in bodies]
    for reason in ("stop", "length"):
        assert delta("domino_request_success_total", finished_reason=reason) == reasons.count(reason)
    for hist in (
        "domino_time_to_first_token_seconds",
        "domino_e2e_request_latency_seconds",
        "domino_request_queue_time_seconds",
    ):
        assert delta(hist + "_count") == len(bodies)
    tokens_after_first = sum(u["completion_tokens"] - 1 for u in usage)
    assert delta("domino_inter_token_latency_seconds_count") == tokens_after_first
    assert delta("domino_batch_size_count") >= 1 and delta("domino_verify_step_seconds_count") >= 1
    assert delta("domino_draft_step_seconds_count") >= 1
    # One request at a time: each decode step's verify width - 1 is that request's drafts.
    assert delta("domino_spec_decode_drafts_per_step_count") == drafts
    assert delta("domino_spec_decode_drafts_per_step_sum") == sum(s["num_draft_tokens"] for s in spec)
    # The policy started from this machine's step costs, measured before serving (DOMINO_PROBE_COSTS).
    log_text = server.log_path.read_text()
    assert re.search(r"step costs measured in [\d.]+ s \(ms; verify batch x T: 1x1 ", log_text)
    # Chunked prefill is on by default, its budget timed at start-up (DOMINO_MAX_NUM_BATCHED_TOKENS unset).
    assert re.search(r"chunked prefill: \d+ tokens a step \(prompt chunks timed in [\d.]+ s, ms: 64 ", log_text)
    # Every family carries model_name and the documented names exist.
    names = {n for n, _ in after}
    for required in (
        "domino_num_requests_running",
        "domino_num_requests_waiting",
        "domino_batch_size_bucket",
        "domino_spec_decode_num_accepted_tokens_per_pos_total",
    ):
        assert required in names
    assert all(dict(labels).get("model_name") == MODEL for _, labels in after)


def test_oversized_bodies_get_413(server: ServerProcess) -> None:
    big = {"prompt": "x" * (1 << 20), "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=big, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:  # no Content-Length: the limit still holds on the streamed body
        for _ in range(20):
            yield b"x" * 65536

    r = httpx.post(
        server.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server.url + "/health").status_code == 200


def test_prompts_beginning_alike_share_kv_blocks(server: ServerProcess, greedy_reference: Any) -> None:
    """A second prompt with the first's 20-token beginning shares 16 of them (one 16-token KV block,
    the default); usage and /metrics say so, and the output is still the target's alone."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    g = random.Random(5)
    system = [g.randrange(100, 500) for _ in range(20)]
    first, second = system + [11, 12, 13], system + [21, 22]
    before = metric(scrape_metrics(server.url), "domino_prompt_tokens_cached_total")
    one = client.completions.create(model=MODEL, prompt=first, max_tokens=8, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    two = client.completions.create(model=MODEL, prompt=second, max_tokens=8, temperature=0)
    assert two.usage.prompt_tokens_details.cached_tokens == 16
    assert two.choices[0].text == greedy_reference(second, 8)[1]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=second, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16
    assert metric(scrape_metrics(server.url), "domino_prompt_tokens_cached_total") - before == 32
