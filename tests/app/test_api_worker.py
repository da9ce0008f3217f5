"""The engine worker in-process: failure isolation, failed admission, aborts.

Failures are real, not mocked: one request's KV cache overflows inside a batched engine step (its
token budget is raised after admission, slipping past the context-length check), and one
request's post-processing raises. Either way that request alone fails and the others finish with
their exact greedy outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.detokenize import OutputProcessor, TokenTexts
from app.metrics import Metrics
from app.worker import EngineWorker, SeqEvent, SequenceSpec
from model.engine.engine import RequestOutput, SamplingParams
from tests.fixtures.waiting import wait_for

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine_and_tokenizer(tiny_target_dir: Path, tiny_drafter_dir: Path) -> tuple[Any, Any]:
    from model.load.loading import build_engine

    return build_engine(
        str(tiny_target_dir),
        str(tiny_drafter_dir),
        mode="domino",
        dtype="float32",
        device="cpu",
        max_batch_size=4,
        max_model_len=MAX_MODEL_LEN,
    )


async def finish(handle: Any) -> list[SeqEvent]:
    events = []
    done = 0
    while done < len(handle.specs):
        event = await asyncio.wait_for(handle.events.get(), 60)
        events.append(event)
        done += event.finish_reason is not None
    return events


def run_with_worker(
    engine_and_tokenizer: tuple[Any, Any], body: Callable[[EngineWorker, Any], Any], factory: Any = OutputProcessor
) -> Any:
    engine, tok = engine_and_tokenizer

    async def main() -> Any:
        metrics = Metrics("tiny", engine.num_drafts, engine.max_batch_size)
        worker = EngineWorker(engine, tok, metrics, max_waiting=4, processor_factory=factory)
        worker.start(asyncio.get_running_loop())
        try:
            return await body(worker, tok)
        finally:
            await asyncio.to_thread(worker.stop)
            assert not engine.has_unfinished()

    return asyncio.run(main())


def text_of(events: list[SeqEvent]) -> str:
    return "".join(e.text for e in events)


def test_engine_failure_in_one_request_fails_it_alone(
    engine_and_tokenizer: tuple[Any, Any], greedy_reference: Any
) -> None:
    good_ids = [5, 60, 61, 62]
    bad_ids = list(range(10, 30))
    _, want_text, want_finish = greedy_reference(good_ids, 30)

    class Overrunner(OutputProcessor):
        def __init__(self, spec: SequenceSpec, tok: Any, texts: TokenTexts) -> None:
            super().__init__(spec, tok, texts)
            self.params = spec.params  # the very object the engine holds

        def process(self, out: RequestOutput) -> Any:
            # After admission (the context check passed), let this request run past max_model_len:
            # the engine's batched step then fails writing beyond this row's KV cache.
            self.params.max_new_tokens = 10**6
            return super().process(out)

    def factory(spec: SequenceSpec, tok: Any, texts: TokenTexts) -> OutputProcessor:
        return (Overrunner if spec.prompt_ids == bad_ids else OutputProcessor)(spec, tok, texts)

    async def body(worker: EngineWorker, tok: Any) -> None:
        good = await worker.submit([SequenceSpec(0, good_ids, SamplingParams(max_new_tokens=30))])
        bad = await worker.submit([SequenceSpec(0, bad_ids, SamplingParams(max_new_tokens=40, ignore_eos=True))])
        bad_events, good_events = await asyncio.gather(finish(bad), finish(good))
        assert bad_events[-1].finish_reason == "error"
        # Past the cache's end: with slots the target's attention over more keys than the cache
        # holds fails; paged, the row's block table outgrows its slot's (a shape error, in this row
        # alone either way).
        messages = ("out of bounds", "must match the size", "exceed its table")
        assert any(m in (bad_events[-1].error or "") for m in messages)
        assert (text_of(good_events), good_events[-1].finish_reason) == (want_text, want_finish)
        assert worker.healthy and worker.in_flight == 0
        # The worker keeps serving.
        again = await worker.submit([SequenceSpec(0, good_ids, SamplingParams(max_new_tokens=30))])
        assert text_of(await finish(again)) == want_text

    run_with_worker(engine_and_tokenizer, body, factory)


def test_post_processing_failure_fails_that_request_alone(
    engine_and_tokenizer: tuple[Any, Any], greedy_reference: Any
) -> None:
    good_ids, bad_ids = [7, 8, 9], [11, 12, 13]
    _, want_text, want_finish = greedy_reference(good_ids, 24)

    class Exploding(OutputProcessor):
        calls = 0

        def process(self, out: RequestOutput) -> Any:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("detokenizer exploded")
            return super().process(out)

    def factory(spec: SequenceSpec, tok: Any, texts: TokenTexts) -> OutputProcessor:
        return (Exploding if spec.prompt_ids == bad_ids else OutputProcessor)(spec, tok, texts)

    async def body(worker: EngineWorker, tok: Any) -> None:
        params = SamplingParams(max_new_tokens=24, ignore_eos=True)
        bad = await worker.submit([SequenceSpec(0, bad_ids, params)])
        good = await worker.submit([SequenceSpec(0, good_ids, SamplingParams(max_new_tokens=24))])
        bad_events, good_events = await asyncio.gather(finish(bad), finish(good))
        assert bad_events[-1].finish_reason == "error"
        assert bad_events[-1].error == "RuntimeError: detokenizer exploded"
        assert (text_of(good_events), good_events[-1].finish_reason) == (want_text, want_finish)
        assert worker.healthy and worker.in_flight == 0
        # The failed request's engine row was aborted, so its slot is free again once the engine's
        # next step drops it (waited for off the loop, which must stay free for the worker's posts).
        await asyncio.to_thread(
            wait_for, lambda: worker.engine.num_running, until=lambda n: n == 0, timeout=10, what="a free engine row"
        )
        assert worker.metrics.registry.get_sample_value("domino_request_errors_total", {"model_name": "tiny"}) == 1

    run_with_worker(engine_and_tokenizer, body, factory)


def test_admission_failure_reported_and_worker_keeps_serving(
    engine_and_tokenizer: tuple[Any, Any], greedy_reference: Any
) -> None:
    async def body(worker: EngineWorker, tok: Any) -> None:
        vocab = worker.engine.target.vocab_size
        # Submitted directly to the worker, past the HTTP layer's checks: the engine refuses it.
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await worker.submit([SequenceSpec(0, [1, vocab + 5], SamplingParams())])
        with pytest.raises(ValueError, match="maximum context length"):
            await worker.submit([SequenceSpec(0, [1, 2], SamplingParams(max_new_tokens=MAX_MODEL_LEN))])
        assert worker.in_flight == 0
        handle = await worker.submit([SequenceSpec(0, [4, 5, 6], SamplingParams(max_new_tokens=10))])
        assert text_of(await finish(handle)) == greedy_reference([4, 5, 6], 10)[1]

    run_with_worker(engine_and_tokenizer, body)


def test_abort_frees_the_slot(engine_and_tokenizer: tuple[Any, Any]) -> None:
    async def body(worker: EngineWorker, tok: Any) -> None:
        params = SamplingParams(max_new_tokens=50, ignore_eos=True)
        handle = await worker.submit([SequenceSpec(0, [4, 5, 6], params)])
        first = await handle.events.get()
        assert first.finish_reason is None
        worker.abort(handle)
        events = await finish(handle)
        assert events[-1].finish_reason == "abort"
        assert sum(e.num_tokens for e in [first, *events]) < 50
        assert worker.in_flight == 0 and worker.engine.num_running == 0

    run_with_worker(engine_and_tokenizer, body)


def test_app_in_process_health_follows_worker_and_drain(engine_and_tokenizer: tuple[Any, Any]) -> None:
    """create_app(settings, engine, tokenizer) without a server: /health and admission while draining."""
    import httpx

    from app.server import create_app
    from app.settings import Settings

    engine, tok = engine_and_tokenizer

    async def main() -> None:
        app = create_app(Settings(served_model_name="tiny", drain_timeout=30), engine, tok)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                assert (await c.get("/health")).status_code == 200
                r = await c.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 3, "temperature": 0})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
                app.state.begin_drain()
                assert (await c.get("/health")).json() == {"status": "draining"}
                r = await c.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 3})
                assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
                assert r.headers["retry-after"]
        # After shutdown the worker is gone: unhealthy.
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            assert (await c.get("/health")).status_code == 503

    asyncio.run(main())
