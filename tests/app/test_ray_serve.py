"""`domino-serve --replicas 2` on a local Ray cluster: the same app behind Ray Serve's proxy.

One Ray cluster for the module (2 CPUs, so the two replicas take one each), started here with the
proxy callback set, as an operator starts one; the server under test is the real CLI joining it
(`--ray-address`), with the tiny target + drafter. Requests go through Ray's HTTP proxy. The cluster
tests are `slow`: on a 2-core machine shared with a training job, the cluster and both replicas were
up in about 30 s and the whole file took about 75 s.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.ray_serve import (
    INGRESS_DEPLOYMENT,
    PROXY_CALLBACK,
    PROXY_CALLBACK_ENV,
    MetricsHub,
    Readiness,
    ReplicaFamilies,
    cluster_exposition,
    cluster_health_response,
    deployment_options,
    loaded_replica_behind,
    local_url,
)
from app.settings import Settings
from tests.fixtures.servers import ServerProcess, free_port, metric, scrape_metrics
from tests.fixtures.waiting import wait_for

API_KEY = "ray-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
REPLICA_HEADER = "x-domino-replica"
# Per replica: 4 running rows and 12 waiting, so 16 concurrent requests always fit on two replicas
# and 48 do not (429 from the app, through the proxy).
MAX_BATCH, MAX_WAITING = 4, 12


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    import ray
    from ray import serve

    previous = os.environ.get(PROXY_CALLBACK_ENV)
    os.environ[PROXY_CALLBACK_ENV] = PROXY_CALLBACK  # inherited by the cluster's processes (the proxy)
    # A busy 2-core machine imports Ray's proxy slower than its 5 s readiness default.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    context = ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        yield context.address_info["gcs_address"]
    finally:
        serve.shutdown()
        ray.shutdown()
        if previous is None:
            os.environ.pop(PROXY_CALLBACK_ENV, None)
        else:
            os.environ[PROXY_CALLBACK_ENV] = previous


@pytest.fixture(scope="module")
def replicas(
    ray_address: str, tiny_target_dir: Path, tiny_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("ray-serve") / "domino-serve.log",
        replicas=2,
        ray_address=ray_address,
        target=tiny_target_dir,
        drafter=tiny_drafter_dir,
        served_model_name="tiny",
        dtype="float32",
        device="cpu",
        max_model_len=512,
        max_batch_size=MAX_BATCH,
        max_waiting=MAX_WAITING,
        draft_policy="fixed",
        api_key=API_KEY,
        drain_timeout=5,
    )
    try:
        # Generous limit, for failures only: a machine overloaded by other jobs once took 450 s. Ready
        # means both replicas serve through the proxy: the tests start sending at once.
        srv.wait_ready(timeout=600)
        yield srv
    finally:
        assert srv.stop(timeout=60) == 0, srv.logs()


def ray_named_actors() -> list[dict[str, str]]:
    import ray

    return list(ray.util.list_named_actors(all_namespaces=True))


def stream_completion(url: str, prompt: str, max_tokens: int, on_start: Callable[[str], None] | None = None) -> dict:
    """One streaming completion through the proxy: its status, replica header, text and SSE events."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    out: dict[str, Any] = {"text": "", "events": [], "done": False}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
        if on_start is not None:
            on_start(out["replica"])
        if r.status_code != 200:
            out["body"] = json.loads(r.read())
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line.removeprefix("data: "))
            out["events"].append(event)
            if "choices" in event and event["choices"]:
                out["text"] += event["choices"][0]["text"]
    return out


def run_concurrently(calls: list[Callable[[], dict]], timeout: float = 180) -> list[dict]:
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # reported below, not lost in a thread
            results[i] = {"exception": repr(exc)}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return results


def prompts(n: int) -> list[str]:
    words = ["Hello world", "The quick brown fox", "Speculative decoding", "def add(a, b):", "café résumé"]
    return [f"{words[i % len(words)]} {i}" for i in range(n)]


@pytest.mark.slow
def test_streams_through_the_proxy_are_greedy_exact_and_spread(
    replicas: ServerProcess, greedy_reference: Any, tiny_hf: tuple[Any, Any]
) -> None:
    """Sent the moment /health first answers 200: ready means both replicas serve (it once meant one
    could, and all requests went to it while the other loaded)."""
    tok = tiny_hf[1]
    texts = prompts(16)
    results = run_concurrently([lambda p=p: stream_completion(replicas.url, p, 24) for p in texts])
    for prompt, result in zip(texts, results):
        assert result.get("status") == 200, result
        assert result["done"] and result["text"] == greedy_reference(tok.encode(prompt), 24)[1], result
    served_by = {r["replica"] for r in results}
    assert len(served_by) == 2 and None not in served_by, served_by


@pytest.mark.slow
def test_health_metrics_and_start_up_line_count_the_ready_replicas(replicas: ServerProcess) -> None:
    health = httpx.get(replicas.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok", "replicas": {"ready": 2, "desired": 2}}
    samples = scrape_metrics(replicas.url)
    assert metric(samples, "domino_replicas_ready", model_name="tiny") == 2
    assert metric(samples, "domino_replicas_desired", model_name="tiny") == 2
    # Each replica's own 1-of-1 gauges are replaced by the deployment's, not labelled per replica.
    assert not [labels for (name, labels) in samples if name == "domino_replicas_ready" and dict(labels).get("replica")]
    # The whole log: logs() keeps its tail, where Ray's access lines for /health can bury the start-up line.
    assert "(2 of 2 replica(s) ready)" in replicas.log_path.read_text(errors="replace")


@pytest.mark.slow
def test_auth_and_back_pressure_pass_through_the_proxy(replicas: ServerProcess) -> None:
    r = httpx.post(replicas.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers[REPLICA_HEADER]  # the guard's own refusals name the replica too

    def post() -> dict:
        body = {"prompt": "Hello", "max_tokens": 200, "temperature": 0}
        resp = httpx.post(replicas.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
        return {"status": resp.status_code, "body": resp.json(), "retry_after": resp.headers.get("retry-after")}

    results = run_concurrently([post] * 48)
    failed = [r for r in results if "status" not in r]
    assert not failed, failed  # a request that raised (its exception) rather than an answer
    statuses = sorted(r["status"] for r in results)
    assert set(statuses) == {200, 429}, statuses
    refused = [r for r in results if r["status"] == 429]
    # At most 2 x (4 + 12) admitted: the rest got the app's own 429, not a queue in Ray's router.
    assert len(refused) >= 48 - 2 * (MAX_BATCH + MAX_WAITING)
    for r in refused:
        assert r["retry_after"] and set(r["body"]["error"]) == {"message", "type", "param", "code"}


@pytest.mark.slow
def test_metrics_show_every_replica(replicas: ServerProcess) -> None:
    def per_replica() -> tuple[set[str | None], dict[str, float]]:
        samples = scrape_metrics(replicas.url)
        names = {dict(labels).get("replica") for (name, labels) in samples if name == "domino_num_requests_running"}
        return names, {r: metric(samples, "domino_generation_tokens_total", replica=r) for r in names if r}

    # Replicas push their metrics every second.
    names, generated = wait_for(
        per_replica,
        15,
        until=lambda seen: len(seen[1]) == 2 and all(seen[1].values()),
        interval=0.5,
        what="tokens from both replicas in /metrics",
    )
    assert None not in names and len(names) == 2, names
    assert all(v > 0 for v in generated.values()), generated


def replica_actor_name(replica_id: str) -> tuple[str, str]:
    (actor,) = [a for a in ray_named_actors() if INGRESS_DEPLOYMENT in a["name"] and a["name"].endswith(replica_id)]
    return actor["name"], actor["namespace"]


@pytest.mark.slow
def test_killing_a_replica_fails_only_its_requests_and_it_is_replaced(
    replicas: ServerProcess, greedy_reference: Any, tiny_hf: tuple[Any, Any]
) -> None:
    import ray

    tok = tiny_hf[1]
    texts = prompts(8)
    started: list[str] = []
    all_started = threading.Event()

    def on_start(replica: str) -> None:
        started.append(replica)
        if len(started) == len(texts):
            all_started.set()

    calls = [lambda p=p: stream_completion(replicas.url, p, 440, on_start) for p in texts]
    results: list[dict] = []
    runner = threading.Thread(target=lambda: results.extend(run_concurrently(calls)))
    runner.start()
    assert all_started.wait(60), started
    victim = started[0]
    name, namespace = replica_actor_name(victim)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    runner.join(180)
    assert not runner.is_alive() and len(results) == len(texts)

    on_victim = [r for r in results if r.get("replica") == victim]
    others = [(p, r) for p, r in zip(texts, results) if r.get("replica") != victim]
    assert on_victim and others, started
    for r in on_victim:
        # Cut mid-stream: the proxy ends it like the app ends a failed stream (an error event, [DONE]).
        assert r.get("status") == 200 and r["done"], r
        error = r["events"][-1]["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "replica_unavailable"
    for prompt, r in others:
        assert r.get("status") == 200 and r["done"], r
        assert r["text"] == greedy_reference(tok.encode(prompt), 440)[1]

    # Ray starts a replacement; two replicas serve again, one of them new.
    seen: set[str] = set()

    def serving() -> set[str]:
        r = httpx.post(
            replicas.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, headers=AUTH, timeout=60
        )
        if r.status_code == 200:
            seen.add(r.headers[REPLICA_HEADER])
        return seen - {victim}

    wait_for(serving, 120, until=lambda live: len(live) == 2, interval=0.2, what="two live replicas, one of them new")


# -- without a cluster -----------------------------------------------------------------------------------


def test_deployment_options_follow_the_settings() -> None:
    fixed = deployment_options(Settings(replicas=3, max_batch_size=8, max_waiting=64, drain_timeout=12), 0)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] > 8 + 64  # the app's 429 comes before Ray's own queue
    assert fixed["ray_actor_options"]["num_gpus"] == 0 and fixed["graceful_shutdown_timeout_s"] == 12
    scaled = deployment_options(Settings(replicas=2, max_replicas=6, max_batch_size=8), 4)
    assert "num_replicas" not in scaled and scaled["ray_actor_options"]["num_gpus"] == 1
    assert scaled["autoscaling_config"] == {
        "min_replicas": 2,
        "initial_replicas": 2,
        "max_replicas": 6,
        "target_ongoing_requests": 8.0,
    }
    assert deployment_options(Settings(replicas=2, device="cpu"), 4)["ray_actor_options"]["num_gpus"] == 0
    assert not Settings().uses_ray and Settings(replicas=1).uses_ray
    with pytest.raises(ValueError):
        Settings(replicas=4, max_replicas=2)


def test_readiness_waits_for_every_replica_asked_for() -> None:
    """The hub counts replicas that pushed (engine loaded) and are healthy; /health stays 503
    "starting" until the driver saw every replica through the proxy, or the start-up timeout passed."""
    from fastapi.responses import JSONResponse

    ok = JSONResponse({"status": "ok"})
    hub = MetricsHub(desired=2, ready_timeout=600)
    hub.record("a", [])
    starting = cluster_health_response(ok, hub.readiness())
    assert starting.status_code == 503
    assert json.loads(bytes(starting.body)) == {"status": "starting", "replicas": {"ready": 1, "desired": 2}}
    hub.record("b", [], healthy=False)  # its worker died: it cannot serve
    assert hub.readiness().ready == ("a",)
    hub.record("b", [])
    assert hub.readiness().ready == ("a", "b") and not hub.readiness().started
    hub.mark_started()
    ready = cluster_health_response(ok, hub.readiness())
    assert ready.status_code == 200
    assert json.loads(bytes(ready.body)) == {"status": "ok", "replicas": {"ready": 2, "desired": 2}}
    # A replica's own 503 (unloaded, draining) is kept, with the counts.
    draining = cluster_health_response(JSONResponse({"status": "draining"}, status_code=503), hub.readiness())
    assert draining.status_code == 503 and json.loads(bytes(draining.body))["status"] == "draining"
    # Past the start-up timeout the deployment is ready with what it has.
    late = MetricsHub(desired=2, ready_timeout=1e-9)
    late.record("a", [])
    assert late.readiness() == Readiness(("a",), 2, True)


def test_driver_sees_a_loaded_replica_through_its_health(server_factory: Callable[..., ServerProcess]) -> None:
    """The driver's probe against a real server: a loaded replica is named by its header; nothing
    listening is no replica."""
    srv = server_factory(replica_name="pod-a")
    assert loaded_replica_behind(srv.url) == "pod-a"
    assert loaded_replica_behind(local_url("127.0.0.1", free_port())) is None
    assert local_url("0.0.0.0", 8000) == "http://127.0.0.1:8000" and local_url("::", 80) == "http://[::1]:80"


def test_merged_exposition_labels_each_replica() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from app.metrics import Metrics

    first, second = Metrics("m", 2, 4), Metrics("m", 2, 4)
    first.generation_tokens.inc(5)
    second.generation_tokens.inc(7)
    text = cluster_exposition({"a": list(first.registry.collect()), "b": list(second.registry.collect())}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    tokens = {
        s.labels["replica"]: s.value for s in families["domino_generation_tokens"].samples if s.name.endswith("_total")
    }
    assert tokens == {"a": 5.0, "b": 7.0}
    assert text.count("# TYPE domino_generation_tokens_total counter") == 1
    assert len(list(ReplicaFamilies({}).collect())) == 0
    # The replica counts are the hub's, once, not each replica's own 1 of 1.
    hub = MetricsHub(desired=3)
    hub.record("a", [])
    with_counts = cluster_exposition({"a": list(first.registry.collect())}, hub.readiness(), "m").decode()
    gauges = {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for f in text_string_to_metric_families(with_counts)
        for s in f.samples
        if s.name.startswith("domino_replicas_")
    }
    assert gauges == {
        ("domino_replicas_ready", (("model_name", "m"),), 1.0),
        ("domino_replicas_desired", (("model_name", "m"),), 3.0),
    }


def test_cluster_metrics_route_answers_instead_of_the_apps_own() -> None:
    """The replica's /metrics is the hub's merged exposition; the app's own route, kept by FastAPI in
    its included router, is shadowed (it once answered, so /metrics lost its replica labels)."""
    import asyncio

    from app.metrics import Metrics
    from app.ray_serve import install_cluster_metrics
    from app.server import create_app

    hub = MetricsHub(desired=2)
    hub.record("a", list(Metrics("m", 2, 4).registry.collect()))

    class Remote:
        def __init__(self, method: Callable[[], Any]) -> None:
            self.method = method

        async def remote(self) -> Any:
            return self.method()

    class Hub:  # the hub itself behind a DeploymentHandle's call shape
        snapshot, readiness = Remote(hub.snapshot), Remote(hub.readiness)

    app = create_app(Settings())
    install_cluster_metrics(app, Hub(), "a")  # type: ignore[arg-type]  # only .snapshot.remote() is used

    async def get(path: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get(path)

    metrics, schema = asyncio.run(get("/metrics")), asyncio.run(get("/openapi.json"))
    assert metrics.status_code == 200 and 'domino_num_requests_running{model_name="m",replica="a"}' in metrics.text
    assert schema.status_code == 200 and {"/metrics", "/health"} <= set(schema.json()["paths"])
    # /health too is the cluster's: this app has no engine loaded, so 503, with the deployment's counts.
    health = asyncio.run(get("/health"))
    assert health.status_code == 503
    assert health.json() == {"status": "unavailable", "replicas": {"ready": 1, "desired": 2}}


def test_guard_names_the_replica_on_every_response() -> None:
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from app.middleware import GuardMiddleware

    async def ok(_: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/x", ok), Route("/health", ok)])

    async def get(guard: GuardMiddleware, path: str, **headers: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as client:
            return await client.get(path, headers=headers)

    named = GuardMiddleware(app, api_key="k", max_body=100, replica="pod-a")
    refused, served = asyncio.run(get(named, "/v1/x")), asyncio.run(get(named, "/v1/x", authorization="Bearer k"))
    assert (refused.status_code, served.status_code) == (401, 200)
    assert refused.headers[REPLICA_HEADER] == served.headers[REPLICA_HEADER] == "pod-a"
    unnamed = asyncio.run(get(GuardMiddleware(app, api_key=None, max_body=100), "/health"))
    assert REPLICA_HEADER not in unnamed.headers
