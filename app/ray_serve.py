"""Scaling out on Ray Serve (`domino-serve --replicas N`, docs/design.md §5).

The app is the one `create_app` builds: each Serve replica runs it whole (guard, routes, worker
thread) and owns one engine, and one GPU where the cluster has them. Ray's HTTP proxy routes
requests to the replicas; everything the app answers (SSE streams, 429 with Retry-After, 401, 503)
passes through it unchanged. What this module adds around the app:

- the `x-domino-replica` header, from the replica's Serve id (`Settings.replica_name`);
- metrics: every replica pushes its `domino_*` families each second to `MetricsHub` (a one-replica
  deployment of the same application), and `GET /metrics` on any replica answers with all live
  replicas' series, each labelled `replica`, so Prometheus keeps one scrape target: the proxy;
- readiness: `/health` answers 200 only once every replica asked for can serve (each has answered
  through the proxy with its engine loaded), or once DOMINO_REPLICA_READY_TIMEOUT has passed; its body
  and the `domino_replicas_ready` / `domino_replicas_desired` gauges say how many can;
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
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
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
REPLICA_HEADER = "x-domino-replica"  # sent by app.middleware
# Cluster-wide gauges (app.metrics has each replica's own, 1 of 1): the hub's counts replace them.
REPLICA_GAUGES = {
    "domino_replicas_ready": "Replicas whose engine is loaded and healthy.",
    "domino_replicas_desired": "Replicas asked for (DOMINO_REPLICAS; with autoscaling, its minimum).",
}
# While starting, the driver asks the proxy for /health this often to see which replicas it reaches; once
# started, it re-marks the hub this often (a replaced hub would otherwise answer "starting" again).
READY_PROBE_INTERVAL_S = 0.2
MARK_STARTED_INTERVAL_S = 5.0


# -- the deployments ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readiness:
    """Which replicas can serve, out of how many were asked for, and whether start-up is over: every
    replica reached through the proxy (the driver says so), or the start-up timeout passed."""

    ready: tuple[str, ...]
    desired: int
    started: bool


class MetricsHub:
    """The latest `domino_*` families of every live replica, and the replicas' readiness (a Serve
    deployment of one replica). A replica pushes only once its engine is loaded."""

    def __init__(self, desired: int = 1, ready_timeout: float = float("inf")) -> None:
        self.latest: dict[str, tuple[float, list[Metric], bool]] = {}
        self.desired = desired
        self.started = False
        self.start_deadline = time.monotonic() + ready_timeout

    def record(self, replica: str, families: list[Metric], healthy: bool = True) -> None:
        self.latest[replica] = (time.monotonic(), families, healthy)

    def _live(self) -> dict[str, tuple[float, list[Metric], bool]]:
        now = time.monotonic()
        for replica, (seen, _, _) in list(self.latest.items()):
            if now - seen > METRICS_STALE_AFTER_S:  # replaced or scaled down
                del self.latest[replica]
        return self.latest

    def snapshot(self) -> dict[str, list[Metric]]:
        return {replica: families for replica, (_, families, _) in self._live().items()}

    def readiness(self) -> Readiness:
        if time.monotonic() > self.start_deadline:
            self.started = True
        ready = tuple(sorted(replica for replica, (_, _, healthy) in self._live().items() if healthy))
        return Readiness(ready, self.desired, self.started)

    def mark_started(self) -> None:
        self.started = True


class ReplicaFamilies:
    """The hub's snapshot as one collector: every sample gains a `replica` label, and families of the
    same name from different replicas are merged (one HELP/TYPE each), as Prometheus requires. The
    replica-count gauges come from the hub's readiness instead, once, without a `replica` label."""

    def __init__(
        self, by_replica: dict[str, list[Metric]], readiness: Readiness | None = None, model_name: str = ""
    ) -> None:
        self.by_replica = by_replica
        self.readiness = readiness
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        from prometheus_client import Metric
        from prometheus_client.core import GaugeMetricFamily

        merged: dict[str, Metric] = {}
        for replica in sorted(self.by_replica):
            for family in self.by_replica[replica]:
                if family.name in REPLICA_GAUGES:  # each replica's own says 1 of 1
                    continue
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                out.samples.extend(
                    sample._replace(labels={**sample.labels, REPLICA_LABEL: replica}) for sample in family.samples
                )
        yield from merged.values()
        if self.readiness is None:
            return
        counts = {"domino_replicas_ready": len(self.readiness.ready), "domino_replicas_desired": self.readiness.desired}
        for name, doc in REPLICA_GAUGES.items():
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], counts[name])
            yield gauge


def cluster_exposition(
    by_replica: dict[str, list[Metric]], readiness: Readiness | None = None, model_name: str = ""
) -> bytes:
    from prometheus_client import generate_latest

    families = ReplicaFamilies(by_replica, readiness, model_name)
    return generate_latest(families)  # type: ignore[arg-type]  # any .collect() will do


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
    """Push this replica's families to the hub while the app runs; /metrics answers for all replicas
    and /health for the deployment's readiness."""
    from fastapi.responses import Response
    from prometheus_client import CONTENT_TYPE_LATEST

    from app.routes.ops import health_response

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
        by_replica, readiness = await hub.snapshot.remote(), await hub.readiness.remote()
        service = app.state.service
        model_name = service.metrics.model_name if service is not None else ""
        return Response(cluster_exposition(by_replica, readiness, model_name), media_type=CONTENT_TYPE_LATEST)

    async def cluster_health() -> JSONResponse:
        own = health_response(app.state.service)
        try:
            readiness = await hub.readiness.remote()
        except Exception as exc:  # the hub is being replaced: this replica's own answer stands
            log.warning("could not read readiness from the hub: %s", exc)
            return own
        return cluster_health_response(own, readiness)

    app.router.lifespan_context = lifespan_pushing_metrics
    # The cluster routes go first, since routes match in list order: the app's own /metrics and
    # /health cannot be taken out (recent FastAPI keeps an included router whole rather than copying
    # its routes into app.router.routes), so they stay, shadowed, and stay the schema's. response_model
    # =None: the annotations are strings here that FastAPI could not resolve for /openapi.json.
    for path, endpoint in (("/metrics", cluster_metrics), ("/health", cluster_health)):
        app.add_api_route(path, endpoint, methods=["GET"], response_model=None, include_in_schema=False)
        app.router.routes.insert(0, app.router.routes.pop())


def cluster_health_response(own: JSONResponse, readiness: Readiness) -> JSONResponse:
    """This replica's /health answer with the deployment's counts; 503 "starting" until start-up is over."""
    from fastapi.responses import JSONResponse

    body = json.loads(bytes(own.body))
    status = own.status_code
    if status == 200 and not readiness.started:
        body["status"], status = "starting", 503
    body["replicas"] = {"ready": len(readiness.ready), "desired": readiness.desired}
    return JSONResponse(body, status_code=status)


async def push_metrics(app: FastAPI, hub: DeploymentHandle, replica: str) -> None:
    warned = False
    while True:
        service = app.state.service
        if service is not None:
            try:
                families = list(service.metrics.registry.collect())
                await hub.record.remote(replica, families, service.worker.healthy)
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
    options = deployment_options(settings, cluster_gpus)
    return ingress.options(**options).bind(hub.bind(settings.replicas or 1, settings.replica_ready_timeout))


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
        application = build_application(settings, gpus)
        deploying = InBackground(lambda: serve.run(application, name=APP_NAME, route_prefix="/", blocking=False))
        desired = settings.replicas or 1
        reached = wait_for_replicas(
            local_url(settings.host, settings.port), desired, settings.replica_ready_timeout, stop, deploying
        )
        if not stop.is_set():
            hub = serve.get_deployment_handle(METRICS_HUB_DEPLOYMENT, app_name=APP_NAME)
            mark_started(hub)
            scaling = f", autoscaling up to {settings.max_replicas}" if settings.max_replicas else ""
            log.info(
                "serving %r through Ray Serve at http://%s:%d/v1 (%d of %d replica(s) ready%s)",
                settings.model_name,
                settings.host,
                settings.port,
                len(reached),
                desired,
                scaling,
            )
            if len(reached) < desired:
                log.warning(
                    "only %d of %d replica(s) can serve after %.0f s (DOMINO_REPLICA_READY_TIMEOUT): ready with "
                    "them; /health and domino_replicas_ready show the count as more start",
                    len(reached),
                    desired,
                    settings.replica_ready_timeout,
                )
        # Re-marked now and then: a hub that Ray replaced would otherwise answer "starting" again.
        while not stop.wait(MARK_STARTED_INTERVAL_S):
            mark_started(serve.get_deployment_handle(METRICS_HUB_DEPLOYMENT, app_name=APP_NAME))
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


class InBackground:
    """A call run on a thread, its exception kept for the caller (serve.run blocks until every replica
    is RUNNING, with no timeout of its own)."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,), name="serve-run", daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:  # raised again in the driver's thread
            self.error = exc


def wait_for_replicas(
    url: str, desired: int, timeout: float, stop: threading.Event, deploying: InBackground
) -> set[str]:
    """The replicas that answered /health through the proxy with their engine loaded, once `desired`
    have, or when `timeout` passes. Through the proxy, not from Ray's status: a replica Ray reports
    RUNNING is reached by the proxy only once the proxy has learned of it."""
    deadline = time.monotonic() + timeout
    reached: set[str] = set()
    while len(reached) < desired and time.monotonic() < deadline:
        if deploying.error is not None:
            raise deploying.error
        replica = loaded_replica_behind(url)
        if replica is not None:
            reached.add(replica)
        if stop.wait(READY_PROBE_INTERVAL_S):
            break
    return reached


def loaded_replica_behind(url: str) -> str | None:
    """The replica that answered one GET /health through the proxy, if its engine is loaded."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            headers, body = response.headers, response.read()
    except urllib.error.HTTPError as refused:  # 503 "starting" is the answer of a loaded replica
        headers, body = refused.headers, refused.read()
    except (OSError, TimeoutError):  # the proxy is not listening yet
        return None
    try:
        status = json.loads(body).get("status")
    except (ValueError, AttributeError):  # the proxy's own answer while no replica is up
        return None
    replica = headers.get(REPLICA_HEADER)
    return replica if replica and status in ("ok", "starting") else None


def local_url(host: str, port: int) -> str:
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def mark_started(hub: DeploymentHandle) -> None:
    try:
        hub.mark_started.remote().result(timeout_s=10)
    except Exception as exc:  # the hub is being replaced: the next mark gets through
        log.warning("could not mark the deployment started: %s", exc)


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
