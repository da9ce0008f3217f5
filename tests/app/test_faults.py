"""Faults: a dead worker, an engine failing every request the same way, and the process exit that lets
an orchestrator restart the server.

Failures are injected into real engines (a method replaced on one engine object, or on the engine
class inside a server subprocess); everything else is the real worker, app and server.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.metrics import Metrics
from app.worker import MAX_STEP_FAILURES, EngineWorker, SeqEvent, SequenceSpec, Unavailable
from model.engine.engine import SamplingParams
from tests.fixtures.servers import ServerProcess
from tests.fixtures.waiting import wait_for

STICKY = "RuntimeError: CUDA error: an illegal memory access was encountered"


def build(tiny_target_dir: Path, tiny_drafter_dir: Path) -> tuple[Any, Any]:
    from model.load.loading import build_engine

    return build_engine(
        str(tiny_target_dir), str(tiny_drafter_dir), mode="domino", dtype="float32", device="cpu",
        max_batch_size=2, max_model_len=64,
    )  # fmt: skip


async def final_event(handle: Any) -> SeqEvent:
    while True:
        event = await asyncio.wait_for(handle.events.get(), 30)
        if event.finish_reason is not None:
            return event


class Fatal(BaseException):
    """Not an Exception: nothing in the worker's step handling catches it, so the thread dies."""


def test_dead_worker_fails_requests_waiting_for_admission(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    engine, tok = build(tiny_target_dir, tiny_drafter_dir)
    gate, entered = threading.Event(), threading.Event()

    def dying_step() -> list[Any]:
        entered.set()
        gate.wait(30)  # hold the worker inside a step while another request queues for admission
        raise Fatal("the worker thread dies")

    engine.step = dying_step

    async def main() -> None:
        worker = EngineWorker(engine, tok, Metrics("tiny", engine.num_drafts, 2), max_waiting=4)
        worker.start(asyncio.get_running_loop())
        try:
            running = await worker.submit([SequenceSpec(0, [4, 5, 6], SamplingParams(max_new_tokens=4))])
            assert await asyncio.to_thread(entered.wait, 10)  # the worker is inside the step
            waiting = asyncio.ensure_future(worker.submit([SequenceSpec(0, [7, 8], SamplingParams())]))
            # Its add command sits in the inbox behind the step (awaited off the loop, so submit runs).
            await asyncio.to_thread(
                wait_for, worker.inbox.qsize, until=lambda n: n == 1, timeout=10, what="the add command in the inbox"
            )
            assert not waiting.done()
            gate.set()
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                await asyncio.wait_for(waiting, 5)  # before the fix: never answered
            assert time.monotonic() - t0 < 5
            assert (await final_event(running)).finish_reason == "error"
            assert worker.failed and not worker.healthy and worker.in_flight == 0
            with pytest.raises(Unavailable):
                await worker.submit([SequenceSpec(0, [7, 8], SamplingParams())])
        finally:
            gate.set()
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())


def test_repeated_engine_failures_of_one_kind_make_the_worker_unhealthy(
    tiny_target_dir: Path, tiny_drafter_dir: Path
) -> None:
    """The engine isolates a failing prefill per request, so the step itself never fails; when every
    request fails the same way (a sticky device error), the worker must still give up."""
    engine, tok = build(tiny_target_dir, tiny_drafter_dir)
    sticky = {"on": False}
    real_prefill = engine._prefill

    def prefill(rows: list[Any]) -> list[Any]:
        if sticky["on"]:
            raise RuntimeError(STICKY.split(": ", 1)[1])
        return real_prefill(rows)

    engine._prefill = prefill

    async def main() -> None:
        worker = EngineWorker(engine, tok, Metrics("tiny", engine.num_drafts, 2), max_waiting=4)
        worker.start(asyncio.get_running_loop())
        try:
            ok = await worker.submit([SequenceSpec(0, [4, 5], SamplingParams(max_new_tokens=3))])
            assert (await final_event(ok)).finish_reason == "length"
            sticky["on"] = True
            for i in range(MAX_STEP_FAILURES):
                assert worker.healthy, f"unhealthy after {i} failed requests"
                handle = await worker.submit([SequenceSpec(0, [4, 5 + i], SamplingParams(max_new_tokens=3))])
                event = await final_event(handle)
                assert (event.finish_reason, event.error) == ("error", STICKY)
            # The thread ends after posting the last failure (off the loop: the worker posts to it).
            await asyncio.to_thread(
                wait_for, lambda: worker.healthy, until=lambda ok: not ok, timeout=10, what="the worker to give up"
            )
            assert worker.failed and not worker.healthy  # before the fix: healthy, failing every request
            with pytest.raises(Unavailable):
                await worker.submit([SequenceSpec(0, [4, 5], SamplingParams())])
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())


def test_mixed_failures_and_successes_keep_the_worker(tiny_target_dir: Path, tiny_drafter_dir: Path) -> None:
    """One kind of bad request failing now and then, between good ones, is not a reason to restart."""
    engine, tok = build(tiny_target_dir, tiny_drafter_dir)
    real_prefill = engine._prefill

    def prefill(rows: list[Any]) -> list[Any]:
        if any(r.prompt_ids[0] == 9 for r in rows):
            raise RuntimeError("bad request")
        return real_prefill(rows)

    engine._prefill = prefill

    async def main() -> None:
        worker = EngineWorker(engine, tok, Metrics("tiny", engine.num_drafts, 2), max_waiting=4)
        worker.start(asyncio.get_running_loop())
        try:
            for _ in range(2 * MAX_STEP_FAILURES):
                bad = await worker.submit([SequenceSpec(0, [9, 5], SamplingParams(max_new_tokens=3))])
                assert (await final_event(bad)).finish_reason == "error"
                good = await worker.submit([SequenceSpec(0, [4, 5], SamplingParams(max_new_tokens=3))])
                assert (await final_event(good)).finish_reason == "length"
            assert worker.healthy and not worker.failed
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())


# The server with a sticky device fault: once a request with the prompt [7, 7, 7] has run, every
# prefill and verify fails.
STICKY_SERVER = """
import sys
import model.engine.engine as me
import model.engine.prefill as mp

state = {"broken": False}
real_prefill, real_decode = mp.Prefiller.run, me.Engine._decode

def prefill(self, rows, *args, **kwargs):
    if any(r.prompt_ids == [7, 7, 7] for r in rows):
        state["broken"] = True
    if state["broken"]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return real_prefill(self, rows, *args, **kwargs)

def decode(self, *args, **kwargs):
    if state["broken"]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return real_decode(self, *args, **kwargs)

mp.Prefiller.run, me.Engine._decode = prefill, decode
from app.main import main
main(sys.argv[1:])
"""


def test_server_exits_nonzero_when_the_engine_is_stuck(
    server_factory: Callable[..., ServerProcess], tiny_target_dir: Path, tiny_drafter_dir: Path, tmp_path: Path
) -> None:
    from app.main import EXIT_WORKER_DIED

    srv = ServerProcess(
        tmp_path / "server.log",
        command=[sys.executable, "-c", STICKY_SERVER],
        target=tiny_target_dir, drafter=tiny_drafter_dir, served_model_name="tiny", dtype="float32", device="cpu",
        max_model_len=128, drain_timeout=5,
    )  # fmt: skip
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 3}).status_code == 200
            statuses = []
            for i in range(MAX_STEP_FAILURES):
                prompt = [7, 7, 7] if i == 0 else [4, 5 + i]
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
                statuses.append(r.status_code)
                assert r.json()["error"]["code"] in ("generation_failed", "service_unavailable"), r.text
            assert statuses[0] == 500
        # The worker gave up: the process drains and exits with its own status, to be restarted.
        code = srv.proc.wait(30)
        assert code == EXIT_WORKER_DIED, srv.logs()
        assert "model worker died" in srv.logs()
    finally:
        srv.stop()
