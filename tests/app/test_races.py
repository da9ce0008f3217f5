"""Races: a client leaving while its request waits for a row, an abort racing the request's own finish,
SIGTERM with requests queued in the engine, and `n > 1` with one choice failing.

Real servers on loopback and real clients; the one injected failure (a choice whose post-processing
raises) goes through the worker's processor factory of an in-process uvicorn server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.detokenize import OutputProcessor, TokenTexts
from app.worker import EngineWorker, SequenceSpec
from model.engine.engine import RequestOutput, SamplingParams
from tests.fixtures.servers import ServerProcess, free_port, metric, scrape_metrics
from tests.fixtures.waiting import wait_for

MODEL = "tiny"


def in_flight(url: str) -> float:
    samples = scrape_metrics(url)
    return metric(samples, "domino_num_requests_running") + metric(samples, "domino_num_requests_waiting")


def gauge(url: str, name: str) -> float:
    return metric(scrape_metrics(url), name)


def finished(url: str, reason: str) -> float:
    return metric(scrape_metrics(url), "domino_request_success_total", finished_reason=reason)


def long_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": "Hello world", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra}


def assert_openai_error(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- a client gone while its request waits for a row ---------------------------------------------------


@pytest.fixture(scope="module")
def one_row(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """One running row: a second request waits in the engine's queue for as long as the first runs."""
    return server_factory(max_batch_size=1, max_waiting=8)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_disconnect_while_waiting_for_a_row(one_row: ServerProcess, stream: bool) -> None:
    url = one_row.url
    wait_for(lambda: in_flight(url), until=lambda n: n == 0, what="an idle server")
    aborts_before = finished(url, "abort")
    result: dict[str, Any] = {}

    def occupy() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            result["long"] = c.post("/v1/completions", json=long_body(400))

    holder = threading.Thread(target=occupy)
    holder.start()
    wait_for(lambda: gauge(url, "domino_num_requests_running"), until=lambda n: n == 1, what="the row to be taken")

    # The second request is admitted and waits for the row; its client then goes away.
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60, read=0.3)) as c:
        with pytest.raises(httpx.ReadTimeout):
            if stream:
                with c.stream("POST", "/v1/completions", json=long_body(50, stream=True)) as r:
                    for _ in r.iter_lines():
                        pass
            else:
                c.post("/v1/completions", json=long_body(50))
    # Its queued sequence is dropped while the first still runs: it never takes the row.
    wait_for(lambda: gauge(url, "domino_num_requests_waiting"), until=lambda n: n == 0, what="the queue to empty")
    assert holder.is_alive(), "the first request finished before the check: make it longer"
    holder.join(120)
    long = result["long"]
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 400
    assert finished(url, "abort") == aborts_before + 1
    wait_for(lambda: in_flight(url), until=lambda n: n == 0, what="nothing in flight")
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=long_body(3)).json()["usage"]["completion_tokens"] == 3


# -- an abort racing the request's own finish ----------------------------------------------------------


def test_abort_racing_finish_in_the_worker(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    """abort() at every moment around a request's last step: exactly one final event, nothing leaks."""
    from app.metrics import Metrics
    from model.load.loading import build_engine

    engine, tok = build_engine(
        str(tiny_target_dir), str(tiny_drafter_dir), mode="domino", dtype="float32", device="cpu",
        max_batch_size=2, max_model_len=64,
    )  # fmt: skip

    async def main() -> None:
        worker = EngineWorker(engine, tok, Metrics(MODEL, engine.num_drafts, 2), max_waiting=4)
        worker.start(asyncio.get_running_loop())
        reasons: dict[str, int] = {}
        handles = []
        try:
            for i in range(60):
                params = SamplingParams(max_new_tokens=1 + i % 4, ignore_eos=True)
                handle = await worker.submit([SequenceSpec(0, [5, 6, 7], params)])
                handles.append(handle)
                # 0..~2 steps of delay: before the prefill, between steps, right at the finish. Not
                # synchronisation: the spread of delays is what makes the abort race the finish.
                delay = (i % 6) * 0.002
                if delay:
                    await asyncio.sleep(delay)
                worker.abort(handle)
                worker.abort(handle)  # twice: the second must be harmless too
                events = []
                while not events or events[-1].finish_reason is None:
                    events.append(await asyncio.wait_for(handle.events.get(), 30))
                assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
                reason = events[-1].finish_reason
                assert reason in ("length", "abort"), events[-1]
                reasons[reason] = reasons.get(reason, 0) + 1
                worker.abort(handle)  # after the finish: a no-op
            # A barrier instead of a sleep: the worker applies its commands in order and posts events to
            # the loop in order, so once a later request has finished, any event it was going to send
            # for the earlier ones (after their final event) has been delivered.
            barrier = await worker.submit([SequenceSpec(0, [5, 6, 7], SamplingParams(max_new_tokens=2))])
            while (await asyncio.wait_for(barrier.events.get(), 30)).finish_reason is None:
                pass
            late = [i for i, h in enumerate(handles) if not h.events.empty()]
            assert not late, f"an event after the final one for requests {late}"
            assert worker.in_flight == 0 and worker.healthy
            # An aborted row leaves the engine's batch at the start of its next step (wait off the loop).
            await asyncio.to_thread(
                wait_for, engine.has_unfinished, until=lambda busy: not busy, timeout=10, what="the engine to be idle"
            )
            assert set(reasons) == {"length", "abort"}, reasons  # both sides of the race were hit
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())


def test_abort_racing_finish_over_http(one_row: ServerProcess) -> None:
    """Clients that give up around the time their answer completes: the server ends consistent."""
    url = one_row.url
    wait_for(lambda: in_flight(url), until=lambda n: n == 0, what="an idle server")
    errors_before = metric(scrape_metrics(url), "domino_request_errors_total")
    with httpx.Client(base_url=url, timeout=60) as c:
        t0 = time.monotonic()
        assert c.post("/v1/completions", json=long_body(8)).status_code == 200
        typical = time.monotonic() - t0

    async def one(i: int) -> str:
        timeout = typical * (0.3 + 0.3 * (i % 5))  # from well before to well after the finish
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(60, read=timeout)) as c:
            try:
                r = await c.post("/v1/completions", json=long_body(8, stream=i % 2 == 1))
            except httpx.ReadTimeout:
                return "gone"
            assert r.status_code == 200
            return "ok"

    async def run() -> list[str]:
        out = []
        for batch in range(8):  # 5 at a time: within the 9 sequences the server admits
            # Requests whose clients gave up leave when the server sees the disconnect; on a loaded
            # machine that can lag the next batch, which would then be refused (429) for capacity.
            await asyncio.to_thread(
                wait_for, lambda: in_flight(url), until=lambda n: n == 0, what="the previous batch to leave"
            )
            out += await asyncio.gather(*(one(batch * 5 + i) for i in range(5)))
        return out

    outcomes = asyncio.run(run())
    assert "gone" in outcomes  # some did give up
    wait_for(lambda: in_flight(url), until=lambda n: n == 0, what="nothing in flight")
    assert metric(scrape_metrics(url), "domino_request_errors_total") == errors_before
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/v1/completions", json=long_body(4)).json()["usage"]["completion_tokens"] == 4


# -- SIGTERM with requests queued in the engine --------------------------------------------------------


def test_sigterm_with_requests_queued_in_the_engine(server_factory: Callable[..., ServerProcess]) -> None:
    """Queued requests are answered (finished, or a 503 / error event in OpenAI's shape) before the
    process exits 0 within the drain timeout; none is left hanging or cut off."""
    srv = server_factory(max_batch_size=1, max_waiting=8, drain_timeout=3)
    # 8 x 480 tokens one row at a time: far more than a 3 s drain can finish, even on a fast machine.
    results: list[Any] = [None] * 8

    def post(i: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            if i == 7:
                with c.stream("POST", "/v1/completions", json=long_body(480, stream=True)) as r:
                    results[i] = ("stream", r.status_code, [line for line in r.iter_lines() if line])
            else:
                r = c.post("/v1/completions", json=long_body(480))
                results[i] = ("json", r.status_code, r.json())

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(results))]
    # The streamed request first, in the engine before the others: a request that arrives after the
    # drain began gets a 503, which only the JSON ones may.
    threads[7].start()
    wait_for(lambda: gauge(srv.url, "domino_num_requests_running"), until=lambda n: n >= 1, what="the stream running")
    for t in threads[:7]:
        t.start()
    wait_for(lambda: gauge(srv.url, "domino_num_requests_waiting"), until=lambda n: n >= 5, what="a queue of 5")
    t0 = time.monotonic()
    srv.terminate()  # once, as docker stop does (a second SIGTERM during teardown would kill it)
    for t in threads:
        t.join(60)
    answered = time.monotonic() - t0
    code = srv.proc.wait(60)
    srv.stop()
    assert code == 0, srv.log_path.read_text()[-4000:]
    # Every client had its answer by the drain deadline (plus scheduling slack on a busy machine).
    assert answered < 3 + 5, answered
    failed = 0
    for kind, status, body in results:
        if kind == "json":
            if status == 200:
                assert body["usage"]["completion_tokens"] == 480
            else:
                assert status == 503 and assert_openai_error(body)["code"] == "service_unavailable", body
                failed += 1
        else:
            assert status == 200 and body[-1] == "data: [DONE]", body[-3:]
            last = json.loads(body[-2].removeprefix("data: "))
            if "error" in last:
                assert_openai_error(last)
                failed += 1
            else:
                assert last["choices"][0]["finish_reason"] == "length"
    assert failed >= 1, "every queued request finished within the drain: make them longer"


# -- n > 1 with one choice failing ---------------------------------------------------------------------


class _Exploding(OutputProcessor):
    """Choice 1's post-processing fails on its second output."""

    calls = 0

    def process(self, out: RequestOutput) -> Any:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("choice 1 exploded")
        return super().process(out)


def _failing_choice(spec: SequenceSpec, tok: Any, texts: TokenTexts) -> OutputProcessor:
    return (_Exploding if spec.index == 1 else OutputProcessor)(spec, tok, texts)


@contextlib.contextmanager
def in_process_server(tiny_target_dir: Path, tiny_drafter_dir: Path) -> Iterator[tuple[str, Any]]:
    """uvicorn on a loopback port in this process (so the worker can take a test's processor factory)."""
    from app.server import create_app
    from app.settings import Settings
    from model.load.loading import build_engine

    engine, tok = build_engine(
        str(tiny_target_dir), str(tiny_drafter_dir), mode="domino", dtype="float32", device="cpu",
        max_batch_size=4, max_model_len=512, draft_policy="fixed",
    )  # fmt: skip
    app = create_app(Settings(served_model_name=MODEL, drain_timeout=5), engine, tok)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, what="the in-process server")
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_n_choices_one_failing(tiny_target_dir: Path, tiny_drafter_dir: Path, stream: bool) -> None:
    """The response fails with the choice (500 with a request id, or an error event) and the other
    choices are aborted at once instead of running to max_tokens."""
    with in_process_server(tiny_target_dir, tiny_drafter_dir) as (url, app):
        worker: EngineWorker = app.state.service.worker
        worker.processor_factory = _failing_choice
        body = long_body(300, n=3, temperature=1.0, seed=1, stream=stream)
        with httpx.Client(base_url=url, timeout=60) as c:
            if stream:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line for line in r.iter_lines() if line]
                assert r.status_code == 200 and lines[-1] == "data: [DONE]"
                error = assert_openai_error(json.loads(lines[-2].removeprefix("data: ")))
            else:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 500, r.text
                error = assert_openai_error(r.json())
                assert r.headers["x-request-id"] in error["message"]
            assert error["code"] == "generation_failed"
            wait_for(lambda: worker.in_flight == 0 and not worker.engine.has_unfinished(), what="nothing in flight")
            samples = scrape_metrics(url)
            # The two siblings were aborted, not run to their 300 tokens.
            assert metric(samples, "domino_request_success_total", finished_reason="abort") == 2
            assert metric(samples, "domino_request_success_total", finished_reason="length") == 0
            assert metric(samples, "domino_request_errors_total") == 1
            assert metric(samples, "domino_generation_tokens_total") < 300
            assert c.get("/health").status_code == 200
            worker.processor_factory = OutputProcessor
            ok = c.post("/v1/completions", json=long_body(5, n=2)).json()
            assert [ch["index"] for ch in ok["choices"]] == [0, 1]
