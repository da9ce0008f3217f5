"""The app factory: `create_app` builds the FastAPI app (middleware, error handlers, routers) and its
lifespan, which loads the engine and starts the worker thread that owns it.

Layout: `errors` / `middleware` (OpenAI-shaped errors, auth and body limits), `service` (the engine
client: worker, tokenizer, metrics and the checks every endpoint shares), `serving/` (one module per
endpoint owning its flow, and `responses`: JSON bodies and the one SSE loop), `deps` (both as
FastAPI dependencies), `routes/` (thin routers), `events` (the torch-free types the worker and the
wire side share).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.errors import install_error_handlers
from app.middleware import GuardMiddleware
from app.routes import chat, completions, models, ops
from app.service import Service
from app.serving import Serving
from app.settings import Settings
from model.engine.config import EngineConfig
from model.kv.sizes import parse_memory

if TYPE_CHECKING:
    from model.engine.engine import Engine

log = logging.getLogger(__name__)


def chunk_budget(setting: int | None) -> int | str | None:
    """DOMINO_MAX_NUM_BATCHED_TOKENS as the engine takes it: unset "auto", 0 off (None)."""
    if setting is None:
        return "auto"
    return setting or None


def engine_config(settings: Settings) -> EngineConfig:
    """The engine's configuration from the server's settings (the EOS ids come from the model)."""
    return EngineConfig(
        mode=settings.mode,
        max_batch_size=settings.max_batch_size,
        max_model_len=settings.max_model_len,
        draft_policy=settings.draft_policy,
        max_drafts=settings.max_drafts,
        ngram=settings.ngram,
        static_shapes=None if settings.static_shapes == "auto" else settings.static_shapes == "on",
        cuda_graphs=settings.cuda_graphs,
        prefix_cache_tokens=settings.prefix_cache_tokens,
        max_num_batched_tokens=chunk_budget(settings.max_num_batched_tokens),
        probe_costs=settings.probe_costs,
        kv_cache_memory=parse_memory(settings.kv_cache_memory) if settings.kv_cache_memory is not None else None,
        kv_block_size=settings.kv_block_size,
    )


def load_engine(settings: Settings) -> tuple[Engine, Any]:
    """Build the engine from settings, logging what was loaded and where."""
    from model.load.loading import build_engine, resolve_device

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
    engine, tokenizer = build_engine(
        target=settings.target,
        drafter=settings.drafter,
        dtype=settings.dtype,
        device=device,
        config=engine_config(settings),
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
    log.info("%s", engine.target.summary())
    log.info("%s", engine.runner.kv_summary())
    if engine.cost_probe is not None:
        log.info("%s", engine.cost_probe.summary())
    log.info("%s", engine.chunking_summary())
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
        app.state.serving = Serving.build(service)
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
            app.state.service = app.state.serving = None

    app = FastAPI(
        title="domino-serve",
        lifespan=lifespan,
        strict_content_type=False,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",  # the schema clients and fuzzers read, as vLLM serves it
    )
    app.state.service = app.state.serving = None
    app.add_middleware(
        GuardMiddleware,
        api_key=settings.api_key,
        max_body=settings.max_request_bytes,
        body_timeout=settings.body_read_timeout,
        replica=settings.replica_name,
    )
    install_error_handlers(app)

    def begin_drain() -> None:
        """SIGTERM: refuse new work and fail /health; in-flight requests run on until shortly before
        uvicorn's own deadline (drain_timeout), then end with an error event rather than a cut."""
        service: Service | None = app.state.service
        if service is not None:
            service.worker.begin_drain(max(0.0, settings.drain_timeout - 0.5))

    app.state.begin_drain = begin_drain
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    for router in (ops.router, models.router, completions.router, chat.router):
        app.include_router(router)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema without its 422 responses: invalid input is answered with 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


__all__ = ["Service", "create_app", "load_engine"]
