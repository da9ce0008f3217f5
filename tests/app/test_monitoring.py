"""The monitoring stack of docker/compose.yaml, checked without Docker.

- promtool accepts docker/prometheus.yml, and parses every dashboard expression.
- compose.yaml wires the service, Prometheus and Grafana to files that exist, with pinned images.
- The dashboard has the panels the README describes, and refers only to metrics the service exports.
- Every PromQL expression of the dashboard is evaluated by a real Prometheus, run with
  docker/prometheus.yml (target and interval swapped for a local server), after a few requests;
  each returns data.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fixtures import REPO_ROOT
from tests.fixtures.prometheus import PrometheusProcess, needs_prometheus
from tests.fixtures.servers import ServerProcess, scrape_metrics

DOCKER = REPO_ROOT / "docker"
PROMETHEUS_YML = DOCKER / "prometheus.yml"
COMPOSE = DOCKER / "compose.yaml"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "domino-serve.json"
DATASOURCES = DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDERS = DOCKER / "grafana" / "provisioning" / "dashboards" / "domino-serve.yaml"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")

# The panels README.md describes (docker/grafana/dashboards/domino-serve.json).
REQUIRED_PANELS = {
    "Mean acceptance length",
    "Acceptance rate by draft position",
    "Output tokens/s",
    "Time to first token",
    "Inter-token latency",
    "End-to-end request latency",
    "Running and waiting requests",
    "Batch size",
    "Draft vs verify step time",
}


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every query of every panel."""
    return [(p["title"], t) for p in load_dashboard()["panels"] for t in p.get("targets", [])]


# Grafana's variables, as Grafana would fill them in for a recent time range and "All" models.
def substitute(expr: str, model_regex: str = ".*", rate_interval: str = "1m", time_range: str = "5m") -> str:
    out = (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$__interval", "15s")
        .replace("$__range", time_range)
        .replace("${model_name:regex}", model_regex)
        .replace("${model_name}", model_regex)
        .replace("$model_name", model_regex)
        # "All" replicas: also matches a single process's series, which have no replica label.
        .replace("${replica:regex}", ".*")
        .replace("$replica", ".*")
    )
    assert not re.search(r"\$\{?_*[A-Za-z]", out), f"unknown Grafana variable left in {out}"
    return out


def label_values_query(definition: str) -> tuple[str, str]:
    """`label_values(metric, label)` (a Grafana function) -> (PromQL selecting the metric, label)."""
    match = re.fullmatch(r"label_values\((\w+)\s*,\s*(\w+)\)", definition)
    assert match, definition
    return f"count by ({match.group(2)}) ({match.group(1)})", match.group(2)


# -- configuration ---------------------------------------------------------------------------------


@needs_promtool
def test_promtool_accepts_the_prometheus_config() -> None:
    proc = subprocess.run(
        ["promtool", "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_expression(tmp_path: Path) -> None:
    # As recording rules, promtool parses each expression offline (no server needed).
    exprs = [substitute(target["expr"]) for _, target in dashboard_targets()]
    rules = [{"record": f"dashboard:q{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_wires_service_prometheus_and_grafana() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"domino", "prometheus", "grafana"}
    assert (DOCKER / services["domino"]["build"]["context"] / "Dockerfile").is_file()
    for name in ("prometheus", "grafana"):  # pinned versions, not `latest`
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", services[name]["image"]), services[name]["image"]

    mounts: dict[str, dict[str, str]] = {}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            mounts.setdefault(name, {})[target] = source
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts missing {source}"
    assert (DOCKER / mounts["prometheus"]["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS_YML
    assert (DOCKER / mounts["grafana"]["/etc/grafana/provisioning"]).resolve() == DATASOURCES.parent.parent
    # Grafana loads the dashboards from where compose mounts them, and opens ours first.
    provider_path = yaml.safe_load(PROVIDERS.read_text())["providers"][0]["options"]["path"]
    assert (DOCKER / mounts["grafana"][provider_path]).resolve() == DASHBOARD.parent
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider_path}/{DASHBOARD.name}"

    # Prometheus scrapes the compose service on the port the image listens on.
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["domino:8000"]
    assert services["domino"]["ports"] == ["127.0.0.1:8000:8000"]  # no key by default: this host only
    datasource = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    assert datasource["jsonData"]["timeInterval"] == config["global"]["scrape_interval"]

    # The GPU override: Qwen3-8B with its published Domino drafter, on an NVIDIA device.
    gpu = yaml.safe_load((DOCKER / "compose.gpu.yaml").read_text())["services"]["domino"]
    assert "Qwen/Qwen3-8B" in gpu["environment"]["DOMINO_TARGET"]
    assert "Huang2020/Qwen3-8B-Domino-b16" in gpu["environment"]["DOMINO_DRAFTER"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


def test_compose_exposes_the_api_beyond_loopback_only_with_a_key() -> None:
    """Every port compose.yaml publishes is bound to 127.0.0.1 (the API has no key by default); the
    public override publishes the API on every interface and makes compose refuse to start without
    DOMINO_API_KEY (`${VAR:?message}`)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"

    class ComposeLoader(yaml.SafeLoader):
        pass

    # Compose's merge tags: `!override` replaces the base file's list instead of appending to it.
    ComposeLoader.add_constructor("!override", lambda loader, node: loader.construct_sequence(node))
    public = yaml.load((DOCKER / "compose.public.yaml").read_text(), Loader=ComposeLoader)["services"]["domino"]
    assert "!override" in (DOCKER / "compose.public.yaml").read_text()
    assert public["ports"] == ["8000:8000"]
    assert re.fullmatch(r"\$\{DOMINO_API_KEY:\?[^}]+\}", public["environment"]["DOMINO_API_KEY"])


def test_dashboard_panels_use_the_provisioned_datasource_and_exported_metrics() -> None:
    from app.metrics import Metrics

    dashboard = load_dashboard()
    assert REQUIRED_PANELS <= {p["title"] for p in dashboard["panels"]}
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    exported = {s.name for family in Metrics("m", 4, 8).registry.collect() for s in family.samples}
    for title, target in dashboard_targets():
        assert target["datasource"]["uid"] == uid, title
        expr = target["expr"]
        for metric in re.findall(r"\bdomino_\w+", expr):
            assert metric in exported, f"{title}: {metric} is not exported by app/metrics.py"
        # Windows follow the dashboard (Grafana's rate interval or time range), never a fixed duration.
        for window in re.findall(r"(?<=[\w}])\[([^\]]+)\]", expr):  # range selectors, not regex classes
            assert window in ("$__rate_interval", "$__range"), f"{title}: fixed window [{window}]"
        assert 'model_name=~"$model_name"' in expr, f"{title}: ignores the model selector"
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["datasource"]["uid"] == uid


# -- every query against a real Prometheus ---------------------------------------------------------


@pytest.fixture
def live_prometheus(
    server_factory: Callable[..., ServerProcess], prometheus_factory: Callable[[str], PrometheusProcess]
) -> Iterator[tuple[ServerProcess, PrometheusProcess]]:
    """A fresh server and a Prometheus that scrapes it with docker/prometheus.yml every second."""
    srv = server_factory(wait=False, max_batch_size=2, max_waiting=16)
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [srv.url.removeprefix("http://")]}]
    prom = prometheus_factory(yaml.safe_dump(config))
    try:
        srv.wait_ready()  # both start concurrently
        yield srv, prom
    finally:
        srv.stop()


def send_traffic(srv: ServerProcess) -> None:
    """Three waves of concurrent requests a second apart: more requests than rows (so some wait),
    and several scrapes while tokens flow, so rate() windows hold changing samples."""

    def one(i: int) -> None:
        body = {"prompt": f"request {i}", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()

    threads: list[threading.Thread] = []
    for wave in range(3):
        for i in range(3):
            threads.append(threading.Thread(target=one, args=(wave * 3 + i,)))
            threads[-1].start()
        time.sleep(1.0)  # not synchronisation: traffic spread over a few 1 s scrapes, as a real load is
    for t in threads:
        t.join(120)


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    values = [s["value"] for s in result if "value" in s] + [v for s in result for v in s.get("values", [])]
    return [float(v[1]) for v in values if math.isfinite(float(v[1]))]


@pytest.mark.slow
@needs_prometheus
def test_every_dashboard_query_returns_data(live_prometheus: tuple[ServerProcess, PrometheusProcess]) -> None:
    srv, prom = live_prometheus
    # Rates need a sample from before the traffic: on a loaded machine the first scrape could
    # otherwise land after every request had finished (a histogram's rate is then 0/0 = NaN).
    prom.wait_until(lambda: len(prom.query("domino_time_to_first_token_seconds_count")) > 0)
    started = time.time()
    send_traffic(srv)
    # Wait until Prometheus has scraped the final counts (and once more, so the last rate is complete).
    tokens = sum(v for (name, _), v in scrape_metrics(srv.url).items() if name == "domino_generation_tokens_total")
    assert tokens > 0
    prom.wait_until(lambda: float(prom.query("sum(domino_generation_tokens_total)")[0]["value"][1]) == tokens)

    def last_scrape() -> float:
        return float(prom.query("max(timestamp(domino_generation_tokens_total))")[0]["value"][1])

    with_final_counts = last_scrape()
    prom.wait_until(lambda: last_scrape() > with_final_counts, what="a scrape after the one with the final counts")
    end = time.time()

    dashboard = load_dashboard()
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    query, label = label_values_query(variable["definition"])
    models = [s["metric"][label] for s in prom.query(query)]
    assert models == ["tiny"]
    model_regex = "|".join(models)  # what Grafana sends for a multi-value selection

    empty = []
    for title, target in dashboard_targets():
        expr = substitute(target["expr"], model_regex)
        if target.get("instant"):
            result = prom.query(expr, time=end)
        else:  # a time series panel: Grafana asks for a range
            result = prom.query_range(expr, start=started, end=end, step=1)
        values = finite_values(result)
        if not values:
            empty.append(f"{title} [{target['refId']}]: {expr} -> {result}")
        else:
            print(f"{title} [{target['refId']}]: {len(result)} series, last {values[-1]:.4g}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
