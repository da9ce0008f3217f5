"""FastAPI app: OpenAI-compatible routes over the engine worker.

Routes stay thin: validate (pydantic + deployment limits), tokenize off the event loop, submit to
the worker, then render its events as one JSON body or as SSE chunks. `Service` is the one place
that owns the engine, the tokenizer and the worker.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import protocol as p
from app.metrics import Metrics
from app.settings import Settings
from app.worker import (
    EngineWorker,
    LogprobEntry,
    Overloaded,
    RequestHandle,
    SeqEvent,
    SequenceSpec,
    SpecStats,
    Unavailable,
)
from model.engine import Engine, SamplingParams

log = logging.getLogger(__name__)

# Keys of chat_template_kwargs that would clash with our own call to apply_chat_template.
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tokenize",
    "return_dict",
    "add_generation_prompt",
    "continue_final_message",
    "return_tensors",
    "return_assistant_tokens_mask",
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# -- errors -----------------------------------------------------------------------------------------


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and not any(c in part for c in "[]-") and part not in ("str", "int", "float"):
            out += f".{part}" if out else part
    return out or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(
            f"request body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')})", code="invalid_json"
        )
    param = _param_from_loc(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "field required"
    if param is None:
        msg = "request body must be a JSON object"
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers invalid fields with 400, never FastAPI's 422.
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 400 and code is None:  # FastAPI could not decode the body at all
            detail, code = "request body could not be parsed as JSON (it must be UTF-8 encoded JSON)", "invalid_json"
        return APIError(exc.status_code, detail, code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, f"internal server error ({type(exc).__name__})", "server_error").response()


# -- ASGI guard: auth and body size, before anything reads the body ----------------------------------


class GuardMiddleware:
    """401 for /v1 routes without the right bearer token; 413 for bodies over the limit.

    The body is read here (bounded) and replayed to the app, so the limit holds whether or not the
    client sent Content-Length, and FastAPI never sees an oversized body."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path", "").startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            # compare_digest: the time taken does not reveal how much of the key matched.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                err = APIError(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await err.response()(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await bad_request("invalid Content-Length header").response()(scope, receive, send)
                return
            if declared > self.max_body:
                await self._too_large(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        if scope.get("method") == "POST" and b"json" not in headers.get(b"content-type", b""):
            # Every body here is JSON: parse it as such even when a client (curl -d) labels it a form.
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope["headers"].append((b"content-type", b"application/json"))
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(
            413,
            f"request body is larger than {self.max_body} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await err.response()(scope, receive, send)


# -- the service -----------------------------------------------------------------------------------


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the prompt as text, when the client sent text (echo)


class Service:
    """Owns the engine (through its worker), the tokenizer and the metrics."""

    def __init__(self, settings: Settings, engine: Engine, tokenizer: Any) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = settings.model_name
        self.created = int(time.time())
        self.vocab_size = engine.target.vocab_size
        self.max_model_len = engine.max_model_len
        self.metrics = Metrics(self.model_name, engine.num_drafts, engine.max_batch_size)
        self.worker = EngineWorker(engine, tokenizer, self.metrics, settings.max_waiting)

    @property
    def capacity(self) -> int:
        return self.worker.capacity

    # -- validation helpers ------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist (this server serves '{self.model_name}').",
                param="model",
                code="model_not_found",
            )

    def check_counts(self, body: p.SamplingFields, num_prompts: int) -> int:
        n = body.n if body.n is not None else 1
        if n > self.settings.max_n:
            raise bad_request(f"n: must be at most {self.settings.max_n}, got {n}", param="n")
        if len(body.stop_list) > self.settings.max_stop:
            raise bad_request(
                f"stop: at most {self.settings.max_stop} stop strings, got {len(body.stop_list)}", param="stop"
            )
        stop_ids = body.stop_token_ids or []
        if len(stop_ids) > self.settings.max_stop:
            raise bad_request(
                f"stop_token_ids: at most {self.settings.max_stop} ids, got {len(stop_ids)}", param="stop_token_ids"
            )
        bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"stop_token_ids: {bad[:5]} outside the vocabulary (size {self.vocab_size})", param="stop_token_ids"
            )
        if n * num_prompts > self.capacity:
            raise bad_request(
                f"the request needs {n * num_prompts} sequences (n x prompts) but the server admits at most "
                f"{self.capacity} at a time",
                param="n",
            )
        return n

    def check_prompt(self, prompt: Prompt, max_tokens: int, param: str, tokens_param: str) -> None:
        if not prompt.ids:
            raise bad_request(f"{param}: the prompt is empty (it encodes to no tokens)", param=param)
        bad = [t for t in prompt.ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"{param}: token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})", param=param
            )
        total = len(prompt.ids) + max_tokens
        if total > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt.ids)} in the {param}, {max_tokens} for the completion). "
                f"Please reduce the length of the {param} or {tokens_param}.",
                param=param if len(prompt.ids) >= self.max_model_len else tokens_param,
                code="context_length_exceeded",
            )

    def sampling_params(
        self, body: p.SamplingFields, max_tokens: int, logprobs: int | None, seed_offset: int
    ) -> SamplingParams:
        seed = body.seed + seed_offset if body.seed is not None else None
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k,
            seed=seed,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
        )

    def specs(
        self, body: p.SamplingFields, prompts: list[tuple[Prompt, int]], n: int, logprobs: int | None
    ) -> list[SequenceSpec]:
        """Choice index = prompt index * n + sample index (OpenAI's order); seeds advance per sample."""
        out = []
        for pi, (prompt, max_tokens) in enumerate(prompts):
            for j in range(n):
                params = self.sampling_params(body, max_tokens, logprobs, j)
                out.append(SequenceSpec(pi * n + j, prompt.ids, params, tuple(body.stop_list)))
        return out

    async def submit(self, specs: list[SequenceSpec]) -> RequestHandle:
        try:
            return await self.worker.submit(specs)
        except Overloaded as exc:
            raise APIError(
                429, str(exc), "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}
            ) from None
        except Unavailable as exc:
            raise APIError(
                503, str(exc), "server_error", code="service_unavailable", headers={"Retry-After": "5"}
            ) from None
        except ValueError as exc:  # the engine's own checks (bad params, context length)
            raise bad_request(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - e.g. an engine bug while adding
            log.exception("admission failed")
            raise APIError(500, f"could not admit the request ({type(exc).__name__}: {exc})", "server_error") from None

    # -- tokenization (off the event loop) -------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def render_chat(self, body: p.ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("messages: this model has no chat template; use /v1/completions", param="messages")
        messages = []
        for m in body.messages:
            msg: dict[str, Any] = {"role": m.role, "content": m.text}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt, **kwargs
            )
        except Exception as exc:  # noqa: BLE001 - template errors are the client's messages' fault
            raise bad_request(f"messages: the chat template failed: {exc}", param="messages") from None
        if not isinstance(text, str):
            raise bad_request("messages: the chat template did not render text", param="messages")
        # The template already wrote any BOS/special tokens it wants.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def get_service(request: Request) -> Service:
    service: Service | None = getattr(request.app.state, "service", None)
    if service is None:
        raise APIError(503, "the model is not loaded", "server_error", code="service_unavailable")
    return service


# -- rendering -------------------------------------------------------------------------------------


def spec_decode_field(stats: SpecStats) -> p.SpecDecodeStats:
    return p.SpecDecodeStats(
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        mean_acceptance_length=stats.mean_acceptance_length,
    )


def completion_logprobs(entries: list[LogprobEntry], offset: int) -> tuple[p.CompletionLogprobs, int]:
    lp = p.CompletionLogprobs()
    for e in entries:
        lp.tokens.append(e.token.text)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append({t.text: v for t, v in e.top})
        lp.text_offset.append(offset)
        offset += len(e.token.text) if not e.token.text.startswith("bytes:") else 0
    return lp, offset


def chat_logprobs(entries: list[LogprobEntry]) -> p.ChatLogprobs:
    return p.ChatLogprobs(
        content=[
            p.ChatTokenLogprob(
                token=e.token.text,
                logprob=e.logprob,
                bytes=e.token.bytes,
                top_logprobs=[p.TopLogprob(token=t.text, logprob=v, bytes=t.bytes) for t, v in e.top],
            )
            for e in entries
        ]
    )


def sse(payload: p.BaseModel | dict[str, Any], omit_none: tuple[str, ...] = ()) -> str:
    data = payload.model_dump(mode="json") if isinstance(payload, p.BaseModel) else payload
    for key in omit_none:
        if data.get(key) is None:
            data.pop(key, None)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def generation_error(event: SeqEvent) -> APIError:
    if event.unavailable:
        return APIError(503, event.error or "the server is shutting down", "server_error", code="service_unavailable")
    return APIError(
        500, f"generation failed: {event.error or 'unknown error'}", "server_error", code="generation_failed"
    )


def error_chunk(event: SeqEvent) -> str:
    return sse(generation_error(event).body())


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, service: Service, handle: RequestHandle) -> list[list[SeqEvent]] | None:
    """All events per choice; None when the client went away first (its request is aborted)."""
    per_choice: list[list[SeqEvent]] = [[] for _ in handle.specs]

    async def gather() -> None:
        finished = 0
        while finished < len(handle.specs):
            event = await handle.events.get()
            per_choice[event.index].append(event)
            if event.finish_reason is not None:
                finished += 1

    gather_task = asyncio.ensure_future(gather())
    watch_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({gather_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not gather_task.done():
            gather_task.cancel()
            service.worker.abort(handle)
    if not gather_task.done() or gather_task.cancelled():
        return None
    gather_task.result()
    return per_choice


def _choice_summary(events: list[SeqEvent]) -> tuple[str, list[LogprobEntry], str | None, SpecStats, int]:
    """(text, logprob entries, finish reason, statistics, tokens generated) of one choice."""
    text = "".join(e.text for e in events)
    entries = [x for e in events if e.logprobs for x in e.logprobs]
    last = events[-1]
    return text, entries, last.finish_reason, last.stats or SpecStats(), sum(e.num_tokens for e in events)


# -- app -------------------------------------------------------------------------------------------


def load_engine(settings: Settings) -> tuple[Engine, Any]:
    """Build the engine from settings, logging what was loaded and where."""
    from model.loading import build_engine, resolve_device

    device = resolve_device(settings.device)
    log.info(
        "loading target %r (drafter %r, mode %s, dtype %s) on %s ...",
        settings.target,
        settings.drafter or "auto",
        settings.mode,
        settings.dtype,
        device,
    )
    started = time.monotonic()
    kwargs: dict[str, Any] = {"draft_policy": settings.draft_policy}
    if settings.block_size is not None:
        kwargs["max_drafts"] = settings.block_size
    engine, tokenizer = build_engine(
        target=settings.target,
        drafter=settings.drafter,
        mode=settings.mode,
        dtype=settings.dtype,
        device=device,
        max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len,
        **kwargs,
    )
    params = sum(t.numel() for t in engine.target.hf_model.parameters())
    log.info(
        "loaded in %.1f s: target %s (%.1fM parameters, %s, %s), mode %s, %s, max batch %d, max model len %d",
        time.monotonic() - started,
        settings.target,
        params / 1e6,
        engine.target.dtype,
        engine.device,
        engine.mode,
        f"{engine.num_drafts} drafts per step" if engine.drafter is not None else "no drafter",
        engine.max_batch_size,
        engine.max_model_len,
    )
    return engine, tokenizer


def create_app(settings: Settings, engine: Engine | None = None, tokenizer: Any = None) -> FastAPI:
    """The service app. Without an engine, lifespan startup loads one from the settings (the server
    listens only once it is ready)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng, tok = engine, tokenizer
        if eng is None:
            eng, tok = await asyncio.to_thread(load_engine, settings)
        service = Service(settings, eng, tok)
        service.worker.start(asyncio.get_running_loop())
        app.state.service = service
        log.info(
            "serving %r at http://%s:%d/v1 (API key %s)",
            service.model_name,
            settings.host,
            settings.port,
            "required" if settings.api_key else "not required",
        )
        try:
            yield
        finally:
            await asyncio.to_thread(service.worker.stop)
            app.state.service = None

    app = FastAPI(
        title="domino-serve",
        lifespan=lifespan,
        strict_content_type=False,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.service = None
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body=settings.max_request_bytes)
    install_error_handlers(app)

    def begin_drain() -> None:
        """SIGTERM: refuse new work and fail /health; in-flight requests run on until shortly before
        uvicorn's own deadline (drain_timeout), then end with an error event rather than a cut."""
        service: Service | None = app.state.service
        if service is not None:
            service.worker.begin_drain(max(0.0, settings.drain_timeout - 0.5))

    app.state.begin_drain = begin_drain
    add_routes(app)
    return app


def add_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        service: Service | None = request.app.state.service
        if service is None or not service.worker.healthy:
            reason = "draining" if service is not None and service.worker.draining else "unavailable"
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        service = get_service(request)
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> p.ModelList:
        service = get_service(request)
        card = p.ModelCard(id=service.model_name, created=service.created, max_model_len=service.max_model_len)
        return p.ModelList(data=[card])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> p.ModelCard:
        service = get_service(request)
        service.check_model(model_id)
        return p.ModelCard(id=service.model_name, created=service.created, max_model_len=service.max_model_len)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await _completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await _chat(body, request)


# -- /v1/completions -------------------------------------------------------------------------------


def _split_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(x, int) for x in prompt):
        return [prompt]
    return list(prompt)


async def _completions(body: p.CompletionRequest, request: Request) -> Response:
    service = get_service(request)
    service.check_model(body.model)
    raw_prompts = _split_prompts(body.prompt)
    n = service.check_counts(body, len(raw_prompts))
    echo = bool(body.echo)
    if echo and body.logprobs is not None:
        raise bad_request(
            "echo: logprobs of the prompt are not available; do not combine echo with logprobs", param="echo"
        )
    max_tokens = body.max_tokens if body.max_tokens is not None else 16

    def tokenize() -> list[Prompt]:
        out = []
        for raw in raw_prompts:
            if isinstance(raw, str):
                out.append(Prompt(service.encode_text(raw), raw))
            else:
                out.append(Prompt(list(raw), None))
        return out

    prompts = await asyncio.to_thread(tokenize)
    for prompt in prompts:
        service.check_prompt(prompt, max_tokens, "prompt", "max_tokens")
    echo_texts: list[str] = []
    if echo:
        echo_texts = [pr.text if pr.text is not None else service.decode(pr.ids) for pr in prompts]
    specs = service.specs(body, [(pr, max_tokens) for pr in prompts], n, body.logprobs)
    handle = await service.submit(specs)
    prompt_tokens = sum(len(pr.ids) for pr in prompts)
    rid, created = p.new_id("cmpl"), p.now()

    def echo_text(index: int) -> str:
        return echo_texts[index // n] if echo else ""

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream_completion(service, handle, rid, created, echo_text, prompt_tokens, include_usage),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    per_choice = await collect(request, service, handle)
    if per_choice is None:
        return Response(status_code=499)
    choices, total = [], SpecStats()
    completion_tokens = 0
    for index, events in enumerate(per_choice):
        text, entries, finish, stats, ntok = _choice_summary(events)
        if finish == "error":
            raise generation_error(events[-1])
        prefix = echo_text(index)
        logprobs = completion_logprobs(entries, len(prefix))[0] if body.logprobs is not None else None
        choices.append(p.CompletionChoice(index=index, text=prefix + text, logprobs=logprobs, finish_reason=finish))
        total += stats
        completion_tokens += ntok
    resp = p.CompletionResponse(
        id=rid,
        created=created,
        model=service.model_name,
        choices=choices,
        usage=p.Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
        spec_decode=spec_decode_field(total),
    )
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream_completion(
    service: Service,
    handle: RequestHandle,
    rid: str,
    created: int,
    echo_text: Callable[[int], str],
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    omit = () if include_usage else ("usage",)
    model = service.model_name
    total, completion_tokens, finished = SpecStats(), 0, 0
    offsets = [0] * len(handle.specs)
    started = [False] * len(handle.specs)
    try:
        while finished < len(handle.specs):
            event = await handle.events.get()
            i = event.index
            completion_tokens += event.num_tokens
            if event.finish_reason == "error":
                service.worker.abort(handle)
                yield error_chunk(event)
                yield "data: [DONE]\n\n"
                return
            text = event.text
            if not started[i]:
                started[i] = True
                text = echo_text(i) + text
                offsets[i] = len(echo_text(i))
            if not text and event.finish_reason is None and not event.logprobs:
                continue
            logprobs = None
            if event.logprobs is not None:
                logprobs, offsets[i] = completion_logprobs(event.logprobs, offsets[i])
            spec = None
            if event.finish_reason is not None:
                finished += 1
                total += event.stats or SpecStats()
                if finished == len(handle.specs) and not include_usage:
                    spec = spec_decode_field(total)
            chunk = p.CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[p.CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=event.finish_reason)],
                spec_decode=spec,
            )
            yield sse(chunk, omit_none=(*omit, "spec_decode"))
        if include_usage:
            usage = p.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            )
            chunk = p.CompletionResponse(
                id=rid, created=created, model=model, choices=[], usage=usage, spec_decode=spec_decode_field(total)
            )
            yield sse(chunk)
        yield "data: [DONE]\n\n"
    finally:
        # Client gone (cancelled here) or done: abort whatever still runs; a no-op when finished.
        service.worker.abort(handle)


# -- /v1/chat/completions --------------------------------------------------------------------------


async def _chat(body: p.ChatCompletionRequest, request: Request) -> Response:
    service = get_service(request)
    service.check_model(body.model)
    n = service.check_counts(body, 1)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ids = await asyncio.to_thread(service.render_chat, body)
    prompt = Prompt(ids, None)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # Without a limit the answer may use the rest of the context (at least one token).
    max_tokens = requested if requested is not None else max(1, service.max_model_len - len(ids))
    service.check_prompt(prompt, max_tokens, "messages", tokens_param)
    specs = service.specs(body, [(prompt, max_tokens)], n, logprobs)
    handle = await service.submit(specs)
    rid, created = p.new_id("chatcmpl"), p.now()

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream_chat(service, handle, rid, created, len(ids), include_usage),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    per_choice = await collect(request, service, handle)
    if per_choice is None:
        return Response(status_code=499)
    choices, total, completion_tokens = [], SpecStats(), 0
    for index, events in enumerate(per_choice):
        text, entries, finish, stats, ntok = _choice_summary(events)
        if finish == "error":
            raise generation_error(events[-1])
        choices.append(
            p.ChatChoice(
                index=index,
                message=p.ChatMessageOut(content=text),
                logprobs=chat_logprobs(entries) if logprobs is not None else None,
                finish_reason=finish,
            )
        )
        total += stats
        completion_tokens += ntok
    resp = p.ChatCompletionResponse(
        id=rid,
        created=created,
        model=service.model_name,
        choices=choices,
        usage=p.Usage(
            prompt_tokens=len(ids), completion_tokens=completion_tokens, total_tokens=len(ids) + completion_tokens
        ),
        spec_decode=spec_decode_field(total),
    )
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream_chat(
    service: Service, handle: RequestHandle, rid: str, created: int, prompt_tokens: int, include_usage: bool
) -> AsyncIterator[str]:
    omit = () if include_usage else ("usage",)
    model = service.model_name
    total, completion_tokens, finished = SpecStats(), 0, 0

    def chunk(
        choices: list[p.ChatStreamChoice], spec: p.SpecDecodeStats | None = None, usage: p.Usage | None = None
    ) -> str:
        c = p.ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage, spec_decode=spec)
        data = c.model_dump(mode="json")
        for choice in data["choices"]:  # OpenAI deltas carry only the keys that changed
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return sse(data, omit_none=(*omit, "spec_decode"))

    try:
        # OpenAI opens every choice with the assistant role and empty content.
        for i in range(len(handle.specs)):
            yield chunk([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
        while finished < len(handle.specs):
            event = await handle.events.get()
            completion_tokens += event.num_tokens
            if event.finish_reason == "error":
                service.worker.abort(handle)
                yield error_chunk(event)
                yield "data: [DONE]\n\n"
                return
            if not event.text and event.finish_reason is None and not event.logprobs:
                continue
            spec = None
            if event.finish_reason is not None:
                finished += 1
                total += event.stats or SpecStats()
                if finished == len(handle.specs) and not include_usage:
                    spec = spec_decode_field(total)
            delta = p.DeltaMessage(content=event.text) if event.text else p.DeltaMessage()
            logprobs = chat_logprobs(event.logprobs) if event.logprobs is not None else None
            yield chunk(
                [
                    p.ChatStreamChoice(
                        index=event.index, delta=delta, logprobs=logprobs, finish_reason=event.finish_reason
                    )
                ],
                spec,
            )
        if include_usage:
            usage = p.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            )
            yield chunk([], spec_decode_field(total), usage)
        yield "data: [DONE]\n\n"
    finally:
        service.worker.abort(handle)


__all__ = ["APIError", "Service", "create_app", "load_engine"]
