"""The one thread that owns the engine.

The event loop never touches the model: it puts add/abort commands into a thread-safe inbox and
reads results from per-request asyncio queues. The worker thread loops: drain the inbox, run one
engine step (continuous batching: requests join and leave between steps), turn each output into
text (detokenizing, string stops) and hand the results to the loop with `call_soon_threadsafe`.
Metrics are recorded here, before results are handed over, so a client that has its answer sees
it counted in /metrics. (Slightly over 400 lines: the thread's lifecycle, admission, steps and
failure handling are one state machine and stay in one file.)
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.detokenize import OutputProcessor, TokenTexts
from app.events import SeqEvent, SequenceSpec
from app.metrics import Metrics
from model.engine.engine import Engine
from model.engine.requests import RequestOutput, RequestStats

log = logging.getLogger(__name__)

# Consecutive failures of engine.step() as a whole (not of one request) before the worker gives up
# and reports itself unhealthy. Steps in which every request failed the same way in prefill or verify
# (a sticky CUDA error, OOM) count alike: the engine isolates them per request, but then no request
# can succeed and only a restart helps.
MAX_STEP_FAILURES = 3


class Overloaded(Exception):
    """The waiting queue is full (429)."""


class Unavailable(Exception):
    """The worker is draining, stopped or dead (503)."""


class EngineUnhealthy(Exception):
    """Engine steps keep failing every request the same way: the worker ends."""


ProcessorFactory = Callable[[SequenceSpec, Any, TokenTexts], OutputProcessor]


class RequestHandle:
    """One HTTP request's sequences; events arrive on `events` (on the event loop)."""

    def __init__(
        self,
        request_id: str,
        specs: list[SequenceSpec],
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[RequestHandle], None],
    ) -> None:
        self.request_id = request_id
        self._abort = abort
        self.specs = specs
        self.events: asyncio.Queue[SeqEvent] = asyncio.Queue()
        self.admitted: asyncio.Future[None] = loop.create_future()
        self.remaining = len(specs)  # choices not yet finished (event-loop side)
        self.arrival = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.remaining == 0

    def abort(self) -> None:
        """Cancel whatever is left of the request (the client went away); a no-op once finished."""
        self._abort(self)


@dataclass
class _SeqState:
    """Worker-side bookkeeping for one engine request."""

    handle: RequestHandle
    spec: SequenceSpec
    processor: OutputProcessor
    arrival: float
    last_token_time: float | None = None
    done: bool = False


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "fail_all" | "stop"
    handle: RequestHandle | None = None


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        metrics: Metrics,
        max_waiting: int,
        processor_factory: ProcessorFactory = OutputProcessor,
    ) -> None:
        self.engine = engine
        # A private copy for this thread: the Rust tokenizer can refuse concurrent use ("Already
        # borrowed") while request handlers encode prompts with the shared one.
        try:
            self.tokenizer = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - uncopyable tokenizers are shared
            self.tokenizer = tokenizer
        self.metrics = metrics
        self._preemptions = 0  # the engine's count already added to the metrics
        self._kv_bytes_read = 0  # likewise
        self._prefill_chunks = 0  # likewise
        self.capacity = engine.max_batch_size + max_waiting
        self.processor_factory = processor_factory
        self.token_texts = TokenTexts(self.tokenizer)
        self.inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self.states: dict[str, _SeqState] = {}
        self.in_flight = 0  # sequences admitted and not finished (event-loop side)
        self.draining = False
        self.alive = False
        self.failed = False  # the thread ended without stop(): the process should be restarted
        self._stopping = False
        self._pending: set[RequestHandle] = set()  # submitted, admission not yet answered (loop side)
        self._error_streak = 0  # consecutive steps in which every output failed, with the same error
        self._error_kind = ""
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- event-loop side ---------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.alive = True
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.alive and not self.draining and self._thread is not None and self._thread.is_alive()

    def check_capacity(self, num_sequences: int) -> None:
        """The admission rule: sequences in flight (running + waiting) never exceed max_batch_size +
        max_waiting (Overloaded otherwise)."""
        if self.in_flight + num_sequences > self.capacity:
            raise Overloaded(
                f"the server is at capacity ({self.in_flight} sequences in flight, at most {self.capacity}); "
                "retry later"
            )

    async def submit(self, specs: list[SequenceSpec]) -> RequestHandle:
        """Admit a request's sequences, or raise Overloaded / Unavailable / the engine's ValueError."""
        if not self.healthy:
            raise Unavailable("the server is shutting down" if self.draining else "the model worker is not running")
        self.check_capacity(len(specs))
        assert self._loop is not None
        handle = RequestHandle(f"req{next(self._ids)}", specs, self._loop, self.abort)
        self.in_flight += len(specs)
        self._pending.add(handle)
        self.inbox.put(_Command("add", handle))
        try:
            await asyncio.shield(handle.admitted)
        except asyncio.CancelledError:
            self.abort(handle)
            raise
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel whatever is left of a request (client gone); slots free at the next step."""
        if not handle.finished:
            self.inbox.put(_Command("abort", handle))

    def _deliver(self, batch: list[tuple[RequestHandle, SeqEvent]]) -> None:
        for handle, event in batch:
            handle.events.put_nowait(event)
            if event.finish_reason is not None:
                handle.remaining -= 1
                self.in_flight -= 1

    def _admitted(self, handle: RequestHandle, error: BaseException | None) -> None:
        self._pending.discard(handle)
        if error is not None:
            # Nothing of this request runs: release its reservation.
            self.in_flight -= handle.remaining
            handle.remaining = 0
            if not handle.admitted.done():
                handle.admitted.set_exception(error)
        elif not handle.admitted.done():
            handle.admitted.set_result(None)

    def begin_drain(self, deadline: float) -> None:
        """Admit nothing new; after `deadline` seconds fail what still runs, so clients get a proper
        error event instead of a cut connection. Safe to call from a signal handler."""
        self.draining = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, deadline, self.inbox.put, _Command("fail_all"))

    def _fail_pending(self) -> None:
        """The thread has ended: whatever still waits for admission will never get it (503 at once)."""
        for handle in list(self._pending):
            self._admitted(handle, Unavailable("the model worker stopped"))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still running and end the thread."""
        self.draining = True
        self._stopping = True
        self.inbox.put(_Command("stop"))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- worker-thread side ------------------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop closed during shutdown: nobody is listening any more
            pass

    def _run(self) -> None:
        failures = 0
        self._update_gauges()  # the KV blocks are all free before the first request
        try:
            while True:
                if not self._drain_inbox(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    try:
                        self._step()
                        failures = 0
                    except EngineUnhealthy:
                        raise
                    except Exception:  # noqa: BLE001 - the engine isolates per-request failures itself
                        failures += 1
                        log.exception("engine step failed (%d in a row); failing the requests in it", failures)
                        self._fail_all("internal error in the engine step", unavailable=False)
                        if failures >= MAX_STEP_FAILURES:
                            raise
                self._update_gauges()
        except BaseException:
            log.exception("model worker stopped")
        finally:
            self.alive = False
            self.failed = not self._stopping
            self._fail_all(
                "the server shut down before the request finished" if self.draining else "the model worker stopped"
            )
            self._update_gauges()
            self._post(self._fail_pending)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        try:
            cmd = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd.kind == "stop":
                return False
            if cmd.kind == "add":
                assert cmd.handle is not None
                self._add(cmd.handle)
            elif cmd.kind == "abort":
                assert cmd.handle is not None
                self._abort(cmd.handle)
            elif cmd.kind == "fail_all":
                self._fail_all("the server shut down before the request finished")
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, handle: RequestHandle) -> None:
        added: list[str] = []
        try:
            for i, spec in enumerate(handle.specs):
                rid = f"{handle.request_id}-{i}"
                processor = self.processor_factory(spec, self.tokenizer, self.token_texts)
                self.engine.add_request(rid, spec.prompt_ids, spec.params)
                added.append(rid)
                self.states[rid] = _SeqState(handle, spec, processor, handle.arrival)
        except Exception as exc:  # noqa: BLE001 - reported to the request, never kills the worker
            for rid in added:
                self.engine.abort(rid)
                self.states.pop(rid, None)
            self._post(self._admitted, handle, exc)
            return
        self._post(self._admitted, handle, None)

    def _abort(self, handle: RequestHandle) -> None:
        for i in range(len(handle.specs)):
            rid = f"{handle.request_id}-{i}"
            state = self.states.get(rid)
            if state is not None and not state.done:
                self.engine.abort(rid)

    def _step(self) -> None:
        m = self.metrics
        previous = self.engine.last_timing
        t0 = time.monotonic()
        outputs = self.engine.step()
        t1 = time.monotonic()
        timing = self.engine.last_timing
        # A step that only dropped aborted rows leaves the previous timing in place: skip it.
        if timing is not None and timing is not previous and timing.kind == "decode":
            m.batch_size.observe(timing.batch_size)
            m.drafts_per_step.observe(timing.num_drafts)
            if timing.draft_seconds > 0:  # steps that ran the drafter (the adaptive policy may pause it)
                m.draft_seconds.observe(timing.draft_seconds)
            m.verify_seconds.observe(timing.verify_seconds)
        if self.engine.last_prefill_tokens > 0:
            m.prefill_tokens_per_step.observe(self.engine.last_prefill_tokens)
        batch: list[tuple[RequestHandle, SeqEvent]] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None or state.done:
                continue  # a sequence already answered (stop string, failed admission)
            try:
                event = self._process(state, out, t0, t1)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not affect the others
                log.exception("post-processing failed for %s", out.request_id)
                if not out.finished:
                    self.engine.abort(out.request_id)
                event = SeqEvent(
                    state.spec.index, finish_reason="error", error=f"{type(exc).__name__}: {exc}", stats=_stats(out)
                )
                m.request_errors.inc()
            if event.finish_reason is not None:
                state.done = True
                del self.states[out.request_id]
            batch.append((state.handle, event))
        if batch:
            self._post(self._deliver, batch)
        self._check_errors(outputs)

    def _check_errors(self, outputs: list[RequestOutput]) -> None:
        """Raise EngineUnhealthy after MAX_STEP_FAILURES steps in a row in which requests failed in the
        engine with the same kind of error and none made progress."""
        errors = [o.error or "" for o in outputs if o.finish_reason == "error" and not o.client_error]
        if any(o.new_token_ids for o in outputs) or not errors:
            if any(o.new_token_ids for o in outputs):
                self._error_streak = 0
            return
        kind = errors[0].split(":", 1)[0]
        same = kind == self._error_kind and all(e.split(":", 1)[0] == kind for e in errors)
        self._error_streak = self._error_streak + 1 if same else 1
        self._error_kind = kind
        if self._error_streak >= MAX_STEP_FAILURES:
            raise EngineUnhealthy(
                f"{self._error_streak} engine steps in a row failed every request ({errors[0]}); giving up"
            )

    def _process(self, state: _SeqState, out: RequestOutput, t0: float, t1: float) -> SeqEvent:
        m = self.metrics
        n_new = len(out.new_token_ids)
        if state.last_token_time is None and out.finish_reason not in ("abort", "error"):
            # First output of a sequence comes from its prefill step.
            m.queue_time.observe(max(0.0, t0 - state.arrival))
            m.time_to_first_token.observe(t1 - state.arrival)
            m.prompt_tokens.inc(len(state.spec.prompt_ids))
            m.prompt_tokens_cached.inc(out.stats.cached_prompt_tokens)
        elif n_new and state.last_token_time is not None:
            gap = (t1 - state.last_token_time) / n_new
            for _ in range(n_new):
                m.inter_token_latency.observe(gap)
        if n_new:
            state.last_token_time = t1
            m.generation_tokens.inc(n_new)
        if out.is_verify_step:
            accepted = len(out.step_accepted)
            m.num_drafts.inc()
            if out.step_proposer is not None:
                m.num_draft_tokens[out.step_proposer].inc(out.step_draft_tokens)
                m.num_accepted_tokens[out.step_proposer].inc(accepted)
            for pos in out.step_accepted:
                m.accepted_position(pos).inc()
            m.acceptance_length.observe(accepted + 1)

        text, logprobs, stop_hit = state.processor.process(out)
        finish = out.finish_reason
        if stop_hit and not out.finished:
            self.engine.abort(out.request_id)  # the engine would go on; the slot frees next step
            finish = "stop"
        elif stop_hit:
            finish = "stop"
        event = SeqEvent(
            state.spec.index, text, n_new, logprobs, finish, error=out.error, client_error=out.client_error
        )
        event.prompt_logprobs = state.processor.prompt_entries(state.spec.prompt_ids, out)
        if finish is not None:
            event.stats = _stats(out)
            m.e2e_latency.observe(t1 - state.arrival)
            if finish == "error":
                m.request_errors.inc()
            else:
                m.request_success[finish].inc()
        return event

    def _fail_all(self, message: str, unavailable: bool = True) -> None:
        """Fail every sequence the worker knows (engine step crashed, or the worker is ending)."""
        batch = []
        for rid, state in list(self.states.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - best effort on a broken engine
                pass
            event = SeqEvent(state.spec.index, finish_reason="error", error=message, unavailable=unavailable)
            batch.append((state.handle, event))
            self.metrics.request_errors.inc()
            del self.states[rid]
        if batch:
            self._post(self._deliver, batch)

    def _update_gauges(self) -> None:
        self.metrics.running.set(self.engine.num_running)
        self.metrics.waiting.set(self.engine.num_waiting)
        blocks = self.engine.kv_blocks
        self.metrics.kv_blocks_used.set(blocks.num_used)
        self.metrics.kv_blocks_free.set(blocks.num_free)
        self.metrics.kv_usage.set(blocks.usage)
        if self.engine.num_preemptions > self._preemptions:
            self.metrics.preemptions.inc(self.engine.num_preemptions - self._preemptions)
            self._preemptions = self.engine.num_preemptions
        if self.engine.kv_bytes_read > self._kv_bytes_read:
            self.metrics.kv_bytes_read.inc(self.engine.kv_bytes_read - self._kv_bytes_read)
            self._kv_bytes_read = self.engine.kv_bytes_read
        if self.engine.num_prefill_chunks > self._prefill_chunks:
            self.metrics.prefill_chunks.inc(self.engine.num_prefill_chunks - self._prefill_chunks)
            self._prefill_chunks = self.engine.num_prefill_chunks


def _stats(out: RequestOutput) -> RequestStats:
    return copy.deepcopy(out.stats)
