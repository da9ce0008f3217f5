"""KV memory by budget, served: a budget far smaller than max_batch_size rows, concurrent requests
that outgrow it, rows preempted and recomputed, and every answer the one the request gets alone."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx

from tests.fixtures.servers import ServerProcess, metric, scrape_metrics


def test_concurrent_requests_through_preemption_answer_as_alone(server_factory: Callable[..., ServerProcess]) -> None:
    srv = server_factory(max_model_len=128, max_batch_size=6, kv_cache_memory="300KiB", prefix_cache_tokens=0)
    line = re.search(r"KV cache: (\d+) blocks x 16 tokens = \d+ tokens .*; (\d+) rows? fits?", srv.logs())
    assert line is not None and int(line.group(2)) == 1, srv.logs()  # one row at max_model_len
    prompts = [[4 + i, 5, 6 + 2 * i, 7] for i in range(6)]

    def complete(prompt: list[int] | list[list[int]]) -> list[str]:
        body = {"prompt": prompt, "max_tokens": 70, "ignore_eos": True, "temperature": 0}
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda ch: ch["index"])
        assert r.json()["usage"]["completion_tokens"] == 70 * len(choices)
        return [ch["text"] for ch in choices]

    # One request with six prompts: six rows join the engine at once, and outgrow the blocks.
    together = complete(prompts)
    samples = scrape_metrics(srv.url)
    assert metric(samples, "domino_num_preemptions_total") > 0
    assert metric(samples, "domino_kv_bytes_read_total") > 0
    assert metric(samples, "domino_kv_cache_blocks", state="used") == 0
    assert [complete(p)[0] for p in prompts] == together  # each alone


def test_chunked_prefill_served_answers_as_alone(server_factory: Callable[..., ServerProcess]) -> None:
    """DOMINO_MAX_NUM_BATCHED_TOKENS=16: three short prompts decode (one streamed request) when a
    long prompt arrives; it goes in by chunks beside them, and each answers as the prompt does alone.
    Plain decoding (one token a row a step) and 200 tokens each: the short ones outlast the long
    prompt's chunks (at least 13 tokens a step) whatever the machine's speed."""
    srv = server_factory(max_model_len=256, max_batch_size=4, max_num_batched_tokens=16, mode="ar")
    short = [[4 + i, 5, 6 + 2 * i, 7] for i in range(3)]
    long_prompt = [(3 * k) % 90 + 5 for k in range(120)]
    body = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}

    def complete(prompt: list[int] | list[list[int]]) -> list[str]:
        tokens = {"max_tokens": 24} if prompt is long_prompt else {}  # within max_model_len
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            r = c.post("/v1/completions", json={"prompt": prompt, **body, **tokens})
        assert r.status_code == 200, r.text
        return [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]

    texts = ["", "", ""]
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": short, "stream": True, **body}) as r:
            long_answer: list[str] = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                texts[choice["index"]] += choice["text"]
                if not long_answer:  # the short ones decode now: the long prompt arrives
                    long_answer = complete(long_prompt)
    samples = scrape_metrics(srv.url)
    assert metric(samples, "domino_prefill_chunks_total") >= 120 // 16
    # Every step that prefilled forwarded at most the budget, and all of the prompts went in.
    steps = metric(samples, "domino_prefill_tokens_per_step_count")
    assert steps >= 120 // 16
    assert metric(samples, "domino_prefill_tokens_per_step_bucket", le="16.0") == steps
    assert metric(samples, "domino_prefill_tokens_per_step_sum") == 3 * 4 + 120
    assert [complete(p)[0] for p in short] == texts
    assert complete(long_prompt) == long_answer
