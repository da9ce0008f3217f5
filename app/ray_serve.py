"""Scaling out on Ray Serve (`domino-serve --replicas N`, docs/design.md §5).

The app is the one `create_app` builds: each Serve replica runs it whole (guard, routes, worker
thread) and owns one engine, and one GPU where the cluster has them. Ray's HTTP proxy routes
requests to the replicas; everything the app answers (SSE streams, 429 with Retry-After, 401, 503)
passes through it unchanged. What this module adds around the app:

- the `x-domino-replica` header, from the replica's Serve id (`Settings.replica_name`);
- metrics: every replica pushes its `domino_*` families each second to `MetricsHub` (a one-replica
  deployment of the same application), and `GET /metrics` on any replica answers with all live
  replicas' series, each labelled `replica`, so Prometheus keeps one scrape target: the proxy;
- `check_health`, so Ray replaces a replica whose engine worker died;
- `proxy_middlewares`, loaded by Ray's proxy (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH), which gives
  the requests of a replica that died under them an OpenAI-shaped end instead of a cut connection.

Ray is imported inside the functions: `app.main` imports this module only when Ray is used, and the
proxy process imports it without loading torch or the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from prometheus_client import Metric
    from ray.serve import Application
    from ray.serve.handle import DeploymentHandle

log = logging.getLogger(__name__)

APP_NAME = "domino"
INGRESS_DEPLOYMENT = "DominoReplica"
METRICS_HUB_DEPLOYMENT = "MetricsHub"
REPLICA_LABEL = "replica"
# How often a replica sends its metrics to the hub, and how long the hub keeps a silent replica's
# series: long enough to ride over a slow push, short enough that a dead replica leaves /metrics.
METRICS_PUSH_INTERVAL_S = 1.0
METRICS_STALE_AFTER_S = 5.0
# Requests a replica takes beyond what its engine admits (running rows + waiting queue): health,
# metrics and model listings, and the one over the limit that must reach the app to get its 429.
# Below this cap, Ray's router would queue requests itself and the app's back-pressure would never
# be seen.
SPARE_REQUEST_SLOTS = 8
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "app.ray_serve.proxy_middlewares"


# -- the deployments ----------------------------------------------------------------------------------


class MetricsHub:
    """The latest `domino_*` families of every live replica (a Serve deployment of one replica)."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, list[Metric]]] = {}

    def record(self, replica: str, families: list[Metric]) -> None:
        self.latest[replica] = (time.monotonic(), families)

    def snapshot(self) -> dict[str, list[Metric]]:
        now = time.monotonic()
        for replica, (seen, _) in list(self.latest.items()):
            if now - seen > METRICS_STALE_AFTER_S:  # replaced or scaled down
                del self.latest[replica]
        return {replica: families for replica, (_, families) in self.latest.items()}


class ReplicaFamilies:
    """The hub's snapshot as one collector: every sample gains a `replica` label, and families of the
    same name from different replicas are merged (one HELP/TYPE each), as Prometheus requires."""

    def __init__(self, by_replica: dict[str, list[Metric]]) -> None:
        self.by_replica = by_replica

    def collect(self) -> Iterator[Metric]:
        from prometheus_client import Metric

        merged: dict[str, Metric] = {}
        for replica in sorted(self.by_replica):
            for family in self.by_replica[replica]:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples.extend(
                    sample._replace(labels={**sample.labels, REPLICA_LABEL: replica}) for sample in family.samples
                )
        yield from merged.values()


def cluster_exposition(by_replica: dict[str, list[Metric]]) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(ReplicaFamilies(by_replica))  # type: ignore[arg-type]  # any .collect() will do


class DominoReplica:
    """The ingress deployment's own part (Ray wraps it with the app built by `replica_app_builder`)."""

    app: FastAPI  # set by Ray's ingress wrapper

    def __init__(self, metrics_hub: DeploymentHandle) -> None:
        # Bound so that the hub is deployed with this application; the app reaches it by name.
        self.metrics_hub = metrics_hub

    def check_health(self) -> None:
        """Ray's periodic health check: a replica whose engine worker died (or keeps failing) is
        replaced. A draining replica is not unhealthy: it is finishing its requests."""
        service = self.app.state.service
        if service is None:
            raise RuntimeError("the engine is not loaded")
        if not service.worker.healthy and not service.worker.draining:
            raise RuntimeError("the engine worker died or keeps failing")


def replica_app_builder(settings: Settings) -> Any:
    """The function Ray runs in each replica to build its app (a closure over the settings, pickled)."""

    def build_replica_app() -> FastAPI:
        from ray import serve

        from app.server import create_app

        context = serve.get_replica_context()
        replica = context.replica_id.unique_id
        app = create_app(settings.model_copy(update={"replica_name": replica}))
        hub = serve.get_deployment_handle(METRICS_HUB_DEPLOYMENT, app_name=context.app_name)
        install_cluster_metrics(app, hub, replica)
        return app

    return build_replica_app


def install_cluster_metrics(app: FastAPI, hub: DeploymentHandle, replica: str) -> None:
    """Push this replica's families to the hub while the app runs; /metrics answers for all replicas."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST

    app_lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan_pushing_metrics(app_: FastAPI) -> AsyncIterator[None]:
        async with app_lifespan(app_):
            pusher = asyncio.create_task(push_metrics(app_, hub, replica))
            try:
                yield
            finally:
                pusher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pusher

    async def cluster_metrics() -> Response:
        by_replica = await hub.snapshot.remote()
        return Response(cluster_exposition(by_replica), media_type=CONTENT_TYPE_LATEST)

    app.router.lifespan_context = lifespan_pushing_metrics
    # The cluster route goes first, since routes match in list order: the app's own /metrics cannot be
    # taken out (recent FastAPI keeps an included router whole rather than copying its routes into
    # app.router.routes), so it stays, shadowed, and stays the schema's /metrics. response_model=None:
    # the `Response` annotation is a string here that FastAPI could not resolve for /openapi.json.
    app.add_api_route("/metrics", cluster_metrics, methods=["GET"], response_model=None, include_in_schema=False)
    app.router.routes.insert(0, app.router.routes.pop())


async def push_metrics(app: FastAPI, hub: DeploymentHandle, replica: str) -> None:
    warned = False
    while True:
        service = app.state.service
        if service is not None:
            try:
                await hub.record.remote(replica, list(service.metrics.registry.collect()))
                warned = False
            except Exception as exc:  # the hub is being replaced: the next push gets through
                if not warned:
                    log.warning("could not push metrics to the hub: %s", exc)
                    warned = True
        await asyncio.sleep(METRICS_PUSH_INTERVAL_S)


def deployment_options(settings: Settings, cluster_gpus: float) -> dict[str, Any]:
    """Ray Serve options of the ingress deployment from the settings (docs/design.md §5)."""
    use_gpu = cluster_gpus > 0 and settings.device in ("auto", "cuda") or settings.device.startswith("cuda")
    options: dict[str, Any] = {
        "name": INGRESS_DEPLOYMENT,
        "max_ongoing_requests": settings.max_batch_size + settings.max_waiting + SPARE_REQUEST_SLOTS,
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 1 if use_gpu else 0},
        # Ray stops routing to a replica being stopped, then waits this long for its requests.
        "graceful_shutdown_timeout_s": settings.drain_timeout,
        "graceful_shutdown_wait_loop_s": 1.0,
        "health_check_period_s": 5.0,
    }
    first = settings.replicas or 1
    if settings.max_replicas is not None and settings.max_replicas > first:
        options["autoscaling_config"] = {
            "min_replicas": first,
            "initial_replicas": first,
            "max_replicas": settings.max_replicas,
            # Past a full running batch, a request waits: that is when another replica pays.
            "target_ongoing_requests": settings.target_ongoing_requests or float(settings.max_batch_size),
        }
    else:
        options["num_replicas"] = first
    return options


def build_application(settings: Settings, cluster_gpus: float = 0.0) -> Application:
    from ray import serve

    hub = serve.deployment(MetricsHub, name=METRICS_HUB_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0})
    ingress = serve.deployment(serve.ingress(replica_app_builder(settings))(DominoReplica))
    return ingress.options(**deployment_options(settings, cluster_gpus)).bind(hub.bind())


# -- the driver: `domino-serve --replicas N` ----------------------------------------------------------


def serve_with_ray(settings: Settings) -> int:
    """Start (or join) Ray, run the application behind Ray's HTTP proxy on settings.host:port, and on
    SIGTERM/SIGINT delete it, which drains each replica for up to drain_timeout seconds."""
    import ray
    from ray import serve

    # The proxy loads proxy_middlewares from this variable when it starts; a local cluster started
    # here inherits it. An existing cluster must have been started with it (README "Scaling out").
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    # Ray's 5 s default for a new proxy to answer is short for a busy machine starting its first workers.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    ray.init(address=settings.ray_address, logging_level=logging.WARNING)
    started_cluster = settings.ray_address is None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(
            http_options={
                "host": settings.host,
                "port": settings.port,
                "keep_alive_timeout_s": max(1, round(settings.keep_alive_timeout)),
            }
        )
        gpus = float(ray.cluster_resources().get("GPU", 0))
        serve.run(build_application(settings, gpus), name=APP_NAME, route_prefix="/", blocking=False)
        log.info(
            "serving %r through Ray Serve at http://%s:%d/v1 (%s)",
            settings.model_name,
            settings.host,
            settings.port,
            f"{settings.replicas or 1} to {settings.max_replicas} replicas"
            if settings.max_replicas
            else f"{settings.replicas or 1} replica(s)",
        )
        stop.wait()
        log.info("draining: deleting the application (up to %.0f s per replica)", settings.drain_timeout)
        serve.delete(APP_NAME)
    except Exception:
        log.exception("Ray Serve failed")
        return 1
    finally:
        if started_cluster:
            with contextlib.suppress(Exception):
                serve.shutdown()
        ray.shutdown()
    return 0


# -- Ray's proxy: an OpenAI-shaped end for requests whose replica died ------------------------------------


def replica_failed_body(request_id: str | None) -> dict[str, Any]:
    suffix = f" (request {request_id})" if request_id else ""
    return {
        "error": {
            "message": f"the replica serving this request stopped; retry the request{suffix}",
            "type": "server_error",
            "param": None,
            "code": "replica_unavailable",
        }
    }


class ReplicaFailureAtProxy:
    """Around Ray's proxy app: when a response ends without being completed (its replica died, or
    Ray gave up on it without an answer), finish it in OpenAI's shape: a 503 error body if nothing was
    sent yet, or an error event and [DONE] on an SSE stream, like the app's own failed streams."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = completed = streaming = False
        request_id: str | None = None

        async def tracking_send(message: Message) -> None:
            nonlocal started, completed, streaming, request_id
            if message["type"] == "http.response.start":
                started = True
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                request_id = (headers.get(b"x-request-id") or b"").decode("latin-1") or None
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("the proxy failed a request")
        if completed:
            return
        body = replica_failed_body(request_id)
        with contextlib.suppress(Exception):  # the client may be gone too
            if not started:
                payload = json.dumps(body).encode()
                headers = [(b"content-type", b"application/json"), (b"retry-after", b"1")]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": payload})
            elif streaming:
                event = f"data: {json.dumps(body, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": event})
            else:
                await send({"type": "http.response.body", "body": b""})


def proxy_middlewares() -> list[Any]:
    """Named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: the middlewares Ray's proxy installs."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaFailureAtProxy)]
