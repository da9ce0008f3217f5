"""Operational behaviour, each on its own server: API keys, queue overflow (429), SIGTERM draining,
and a real Prometheus scraping the service."""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fixtures.prometheus import PrometheusProcess, needs_prometheus, scrape_config
from tests.fixtures.servers import ServerProcess
from tests.fixtures.waiting import wait_for

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def guarded(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """API key required; one running row and one waiting slot (capacity 2); the default draft policy."""
    return server_factory(api_key=KEY, max_batch_size=1, max_waiting=1, draft_policy="adaptive")


def test_api_key(guarded: ServerProcess) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    url = guarded.url + "/v1/completions"
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer"},
    ):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(guarded.url + "/v1/models").status_code == 401
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    # /tokenize and /detokenize do work for a client: keyed like /v1 (they once were open to anyone).
    for path, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        assert httpx.post(guarded.url + path, json=payload).status_code == 401
        keyed = httpx.post(guarded.url + path, json=payload, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200, keyed.text
    # Health, metrics and the version stay open for probes and scrapers.
    assert httpx.get(guarded.url + "/version").status_code == 200
    assert httpx.get(guarded.url + "/health").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200
    ok = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
    bad = openai.OpenAI(base_url=guarded.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)


def test_queue_overflow_answers_429(guarded: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    long = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True, "stream": True}
    pair = {"prompt": "x", "max_tokens": 2, "n": 2}
    with contextlib.ExitStack() as stack:
        # Two streams fill the running row and the waiting slot; the role chunk confirms admission.
        # (Keep the line iterators: dropping a half-read one closes its connection.)
        readers = []
        for _ in range(2):
            c = stack.enter_context(httpx.Client(base_url=guarded.url, headers=auth, timeout=60))
            r = stack.enter_context(c.stream("POST", "/v1/chat/completions", json=long))
            assert r.status_code == 200
            readers.append(r.iter_lines())
            assert next(readers[-1]).startswith("data: ")
        r = httpx.post(guarded.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth)
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        # n = 2 needs two sequences: never more than the capacity in flight.
        r = httpx.post(guarded.url + "/v1/completions", json=pair, headers=auth)
        assert r.status_code == 429
    # Both streams were cancelled by disconnecting: capacity is back (once the server has seen both go).
    r = wait_for(
        lambda: httpx.post(guarded.url + "/v1/completions", json=pair, headers=auth),
        until=lambda resp: resp.status_code == 200,
        timeout=10,
        what="room for n=2 after both streams disconnected",
    )
    assert len(r.json()["choices"]) == 2


def admission(method: str, url: str, **kwargs: Any) -> int | str:
    """How a new connection is answered: the status code; "refused" once the listener is closed; or
    "closed" when the server closed the connection before any response. The last happens while
    uvicorn drains: a connection accepted (or queued in the kernel's backlog) just before the listener
    closed is shut without its request being read, so no work was admitted on it. A request the app
    did read is always answered (503 while draining), so "closed" cannot hide an admitted request."""
    try:
        return httpx.request(method, url, timeout=5, **kwargs).status_code
    except httpx.ConnectError:
        return "refused"
    except (httpx.RemoteProtocolError, httpx.ReadError):  # disconnected with no response / reset
        return "closed"


def read_stream(lines: Iterator[str], out: dict[str, Any]) -> None:
    """Collect the rest of an SSE stream into out: text, finish reason, whether [DONE] came, or the error."""
    out.update(text="", finish=None, done=False, error=None, error_event=None)
    try:
        for line in lines:
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                out["done"] = True
                continue
            data = json.loads(payload)
            if "error" in data:
                out["error_event"] = data["error"]
                continue
            choice = data["choices"][0]
            out["text"] += choice["text"]
            out["finish"] = choice["finish_reason"] or out["finish"]
    except httpx.HTTPError as exc:
        out["error"] = exc


def test_sigterm_drains_then_exits_at_the_deadline(server_factory: Callable[..., ServerProcess]) -> None:
    """SIGTERM: no new work; a short in-flight stream finishes; a long one is ended at the deadline."""
    deadline = 3
    srv = server_factory(drain_timeout=deadline, mode="ar", max_model_len=4096)
    short, long = {}, {}
    with contextlib.ExitStack() as stack:
        streams = []
        for max_tokens in (60, 4000):
            c = stack.enter_context(httpx.Client(base_url=srv.url, timeout=60))
            req = {"prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            r = stack.enter_context(c.stream("POST", "/v1/completions", json=req))
            lines = r.iter_lines()  # keep it: dropping a half-read iterator closes the connection
            assert next(lines).startswith("data: ")
            streams.append(lines)
        srv.terminate()
        t_term = time.monotonic()
        # Not admitting: the listener is closed (refused), a connection caught as it closed is shut
        # unread (closed), or the listener is still open and the app answers 503. Until the signal is
        # handled /health may still say 200: wait for the switch, but for much less than the 3 s drain,
        # so a server that keeps admitting while it drains fails here.
        not_admitting = ("refused", "closed", 503)
        health = wait_for(
            lambda: admission("GET", srv.url + "/health"),
            until=lambda answer: answer in not_admitting,
            timeout=1.0,
            what="the server to stop admitting after SIGTERM",
        )
        work = admission("POST", srv.url + "/v1/completions", json={"prompt": "x"})
        assert work in not_admitting, (health, work)
        readers = [
            threading.Thread(target=read_stream, args=(lines, out)) for lines, out in zip(streams, (short, long))
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(60)
    assert short["error"] is None and short["done"] and short["finish"] == "length", short
    # At the deadline the long one ends with an error event (not a cut connection).
    assert long["error"] is None and long["done"] and long["finish"] is None
    assert long["error_event"]["code"] == "service_unavailable", long
    assert srv.proc.wait(30) == 0  # a graceful shutdown exits normally
    assert deadline - 1 < time.monotonic() - t_term < deadline + 10
    assert "draining" in srv.logs()


# -- Prometheus ------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_prometheus
def test_prometheus_scrapes_mean_acceptance_length(
    server_factory: Callable[..., ServerProcess], prometheus_factory: Callable[[str], PrometheusProcess]
) -> None:
    srv = server_factory(wait=False, max_batch_size=4)  # fresh counters: only this test's requests count
    prom = prometheus_factory(scrape_config(srv.url.removeprefix("http://")))
    try:
        srv.wait_ready()  # both start concurrently
        # Some traffic with partial acceptance, several requests concurrently.
        spec_fields: list[dict[str, Any]] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            body = httpx.post(
                srv.url + "/v1/completions",
                json={"prompt": f"prompt number {i}", "max_tokens": 40, "temperature": 0},
                timeout=60,
            ).json()
            with lock:
                spec_fields.append(body["spec_decode"])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        drafts = sum(s["num_drafts"] for s in spec_fields)
        accepted = sum(s["num_accepted_tokens"] for s in spec_fields)
        assert len(spec_fields) == 8 and drafts > 0
        expected = (accepted + drafts) / drafts

        query = (
            "(sum(domino_spec_decode_num_accepted_tokens_total) + sum(domino_spec_decode_num_drafts_total))"
            " / sum(domino_spec_decode_num_drafts_total)"
        )
        hist_query = "sum(domino_acceptance_length_sum) / sum(domino_acceptance_length_count)"
        prom.wait_until(lambda: float(prom.query("sum(domino_spec_decode_num_drafts_total)")[0]["value"][1]) == drafts)
        value = float(prom.query(query)[0]["value"][1])
        hist_value = float(prom.query(hist_query)[0]["value"][1])
        assert math.isclose(value, expected, rel_tol=1e-9)
        assert math.isclose(hist_value, expected, rel_tol=1e-9)
        assert expected > 1.0  # the tiny drafter gets some drafts accepted
        print(f"mean acceptance length {expected:.4f} (Prometheus: {value:.4f}, {hist_value:.4f})")
        up = prom.query('up{job="domino"}')
        assert up and up[0]["value"][1] == "1"
    finally:
        srv.stop()


def test_static_shapes_setting_serves_identical_tokens(
    server_factory: Callable[..., ServerProcess], tiny_hf: tuple[Any, Any], greedy_reference: Any
) -> None:
    """DOMINO_STATIC_SHAPES=on (the CUDA default) on the CPU: concurrent requests in padded buckets
    answer exactly the target's greedy tokens, and the start-up log reports the warm-up."""
    srv = server_factory(static_shapes="on", max_batch_size=3)
    try:
        prompts = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,", "Hello"]
        results: dict[int, dict[str, Any]] = {}

        def one(i: int) -> None:
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": 16, "temperature": 0}
            results[i] = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for i, prompt in enumerate(prompts):
            _, ref_text, ref_finish = greedy_reference(tiny_hf[1].encode(prompt), 16)
            choice = results[i]["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (ref_text, ref_finish)
        # Batch buckets 1, 2, 4: verify at T = 1, 2, 3, 5, 9 (W = 8 n-gram drafts) and the proposal,
        # greedy and for sampling rows (with and without top-k/top-p).
        assert "static-shape steps ready: 24 buckets" in srv.logs()
    finally:
        srv.stop()
