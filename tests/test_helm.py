"""The Helm chart (deploy/helm/domino-serve), checked offline.

- `helm lint` and `helm template` run Helm's own Go code, from the pinned `helm-python-sdk` wheel
  (PyPI: Helm's SDK built as a C library, no helm binary or Go toolchain needed).
- Every rendered object is validated against the Kubernetes OpenAPI schemas bundled by the pinned
  `kubernetes-validate` (strict: unknown fields fail). The ServiceMonitor is a prometheus-operator
  CRD with no bundled schema: its fields are checked here instead.
- The rendered Deployment keeps the server's shutdown contract: grace period >= preStop + drain.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.fixtures import REPO_ROOT

CHART = REPO_ROOT / "deploy" / "helm" / "domino-serve"
KUBE_VERSION = "1.33.0"  # schemas of this Kubernetes release validate the objects

FULL_VALUES: dict[str, Any] = {
    "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
    "serviceMonitor": {"enabled": True},
    "apiKey": {"value": "s3cret"},
    "model": {"source": "pvc", "target": "Qwen/Qwen3-8B", "drafter": "Huang2020/Qwen3-8B-Domino-b16"},
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "server": {"drainTimeout": 45},
}
INIT_VALUES: dict[str, Any] = {
    "apiKey": {"existingSecret": "domino-key"},
    "model": {
        "source": "initContainer",
        "target": "Qwen/Qwen3-0.6B",
        "initContainer": {"image": "mirror/hf-cli:1", "command": ["hf", "download", "Qwen/Qwen3-0.6B"]},
    },
    "podDisruptionBudget": {"enabled": False},
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    from helm_python import chart

    manifests = chart.Chart.load(CHART).render(values, name="llm", namespace="serving", is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds = [o["kind"] for o in objects]
    assert len(kinds) == len(set(kinds)), kinds
    return {o["kind"]: o for o in objects}


def test_helm_lint_passes() -> None:
    from helm_python import chart

    for values in (None, FULL_VALUES, INIT_VALUES):
        report = chart.lint(CHART, values, strict=True, kube_version="v" + KUBE_VERSION)
        problems = [m for m in report["messages"] if m["severity"] > 1]  # 1 = info, 2 = warning, 3 = error
        assert report["total_charts_linted"] == 1 and not problems and not report["errors"], report


@pytest.mark.parametrize("values", [None, FULL_VALUES, INIT_VALUES], ids=["defaults", "autoscaled-pvc", "init"])
def test_rendered_objects_match_the_kubernetes_schemas(values: dict[str, Any] | None) -> None:
    import kubernetes_validate

    objects = render(values)
    assert objects
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            check_service_monitor(obj)
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def check_service_monitor(obj: dict[str, Any]) -> None:
    assert obj["kind"] == "ServiceMonitor" and obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(obj["spec"]) == {"selector", "endpoints"}
    (endpoint,) = obj["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["relabelings"] == [{"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "replica"}]


def test_defaults_serve_the_embedded_model_on_one_gpu() -> None:
    objects = by_kind(render())
    assert set(objects) == {"Deployment", "Service", "PodDisruptionBudget"}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DOMINO_TARGET"]["value"] == "default" and "DOMINO_API_KEY" not in env
    assert env["DOMINO_REPLICA_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    selector = objects["Deployment"]["spec"]["selector"]["matchLabels"]
    assert objects["Service"]["spec"]["selector"] == selector
    assert objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector


def test_shutdown_leaves_room_for_the_drain() -> None:
    """SIGTERM (after preStop) starts the server's drain of drainTimeout seconds; the kubelet must
    not kill the pod before it ends, and liveness must not fail a draining pod before then either."""
    deployment = by_kind(render(FULL_VALUES))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    env = {e["name"]: e.get("value") for e in container["env"]}
    drain = float(env["DOMINO_DRAIN_TIMEOUT"])
    assert drain == 45
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop + drain
    assert container["readinessProbe"]["failureThreshold"] == 1
    assert "replicas" not in deployment["spec"]  # the HPA owns the count


def test_autoscaling_api_key_and_model_volume() -> None:
    objects = by_kind(render(FULL_VALUES))
    hpa = objects["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    (pods_metric,) = hpa["spec"]["metrics"]
    assert pods_metric["pods"]["metric"]["name"] == "domino_num_requests_waiting"
    secret = objects["Secret"]
    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    ref = env["DOMINO_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]
    claim = objects["PersistentVolumeClaim"]["metadata"]["name"]
    (volume,) = objects["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    assert container["volumeMounts"] == [{"name": "hf-cache", "mountPath": "/hf", "readOnly": True}]

    init = by_kind(render(INIT_VALUES))
    pod = init["Deployment"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["volumeMounts"] == [{"name": "hf-cache", "mountPath": "/hf"}]
    assert "emptyDir" in pod["volumes"][0]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["DOMINO_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "domino-key"
    assert "Secret" not in init and "PodDisruptionBudget" not in init


def test_invalid_model_source_is_refused() -> None:
    from helm_python.errors import HelmError

    with pytest.raises(HelmError, match="model.source"):
        render({"model": {"source": "s3"}})
