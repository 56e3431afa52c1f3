"""A real HorizontalPodAutoscaler scaling an InferenceService on kvpilot's metric (issue 36, part 5).

Every part is real but the publisher: kvpilot_desired_replicas{namespace, inferenceservice}, the count kvpilot's
planner recommends, comes from a prometheus_client HTTP server the test sets, as the tuner's metrics endpoint
will serve it. A real Prometheus scrapes it; a real prometheus-adapter (built from sigs.k8s.io/prometheus-adapter
by scripts/build-prometheus-adapter.sh) serves it as external.metrics.k8s.io through kube-apiserver's aggregator,
with the rule of docs/examples/prometheus-adapter-rules.yaml; kube-controller-manager's HPA controller runs the
HPA of docs/examples/hpa-external.yaml, writes spec.replicas through the InferenceService's scale subresource;
the real operator scales the Deployment and says who wrote the count; the Deployment controller and kwok bring
the pods.

The example's HPA keeps the production scale-down window (300 s, an HPA's default); the test's copy sets it to
0, so that scaling down is seen in seconds. Everything else is applied as the file says."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from harness.cluster import ROOT, ControlPlane, Operator, wait_for
from harness.kmock_api import free_port
from harness.metrics_adapter import MetricsAdapter, built_adapter
from harness.prometheus import PrometheusServer, require_prometheus
from tests.cluster.common import SERVING

pytestmark = pytest.mark.cluster

NS = SERVING
NAME = "llama-8b"  # the name docs/examples/hpa-external.yaml targets
METRIC = "kvpilot_desired_replicas"
EXAMPLE_HPA = ROOT / "docs" / "examples" / "hpa-external.yaml"
EXAMPLE_RULES = ROOT / "docs" / "examples" / "prometheus-adapter-rules.yaml"
ADAPTER_NAMESPACE = "monitoring"
ISVCS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
HPAS = f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"
BY_HPA = "(spec.replicas written by kube-controller-manager through the scale subresource)"


@dataclass
class Publisher:
    """kvpilot_desired_replicas as kvpilot's tuner publishes it, on a prometheus_client HTTP server."""

    gauge: Gauge
    address: str


@pytest.fixture(scope="module")
def publisher() -> Iterator[Publisher]:
    built_adapter()  # skip (or fail in CI) before starting anything
    require_prometheus()
    registry = CollectorRegistry()
    gauge = Gauge(METRIC, "Replicas kvpilot's planner recommends", ["namespace", "inferenceservice"],
                  registry=registry)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield Publisher(gauge, f"127.0.0.1:{port}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def prometheus(publisher: Publisher) -> Iterator[PrometheusServer]:
    with PrometheusServer(targets=[publisher.address], job="kvpilot-tuner") as prom:
        yield prom


@pytest.fixture(scope="module")
def adapter(control_plane: ControlPlane, prometheus: PrometheusServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsAdapter]:
    if control_plane.get_or_none(f"/api/v1/namespaces/{ADAPTER_NAMESPACE}") is None:
        control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": ADAPTER_NAMESPACE}})
    rules = yaml.safe_load(EXAMPLE_RULES.read_text())["externalRules"]
    with MetricsAdapter(control_plane, tmp_path_factory.mktemp("prometheus-adapter"), prometheus_url=prometheus.url,
                        external_rules=rules, namespace=ADAPTER_NAMESPACE) as running:
        yield running
        running.check_alive()


def test_docs_hpa_scales_the_inferenceservice_on_kvpilots_metric(
        control_plane: ControlPlane, operator: Operator, publisher: Publisher, prometheus: PrometheusServer,
        adapter: MetricsAdapter) -> None:
    gauge = publisher.gauge.labels(namespace=NS, inferenceservice=NAME)
    gauge.set(2)
    control_plane.create(ISVCS, {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                 "metadata": {"name": NAME, "namespace": NS},
                                 "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2,
                                          "autoscaling": {"actor": "external", "minReplicas": 2, "maxReplicas": 6}}})
    try:
        wait_for(lambda: ready_replicas(control_plane) == 2, timeout=90, what=f"{NAME} Ready with 2 replicas")
        control_plane.kubectl("apply", "-n", NS, "-f", "-", input_text=yaml.safe_dump(hpa_for_test()))
        hpa = wait_for(lambda: hpa_condition(control_plane, "ScalingActive", "True"), timeout=60,
                       what="the HPA reading the metric (ScalingActive)")
        assert hpa["status"]["desiredReplicas"] == 2

        gauge.set(4)
        prometheus.wait_for(f'{METRIC}{{namespace="{NS}",inferenceservice="{NAME}"}} == 4')
        # What the HPA controller reads, through the aggregator, as `kubectl get --raw` shows it.
        raw = control_plane.kubectl("get", "--raw", f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{NS}/{METRIC}")
        (item,) = yaml.safe_load(raw.stdout)["items"]
        assert (item["metricName"], item["value"]) == (METRIC, "4")
        scaled_to(control_plane, 4)
        assert scaled_events(control_plane, 1) == [f"Scaled from 2 to 4 replicas {BY_HPA}"]

        gauge.set(2)
        scaled_to(control_plane, 2)
        assert scaled_events(control_plane, 2)[1:] == [f"Scaled from 4 to 2 replicas {BY_HPA}"]

        # Above maxReplicas: held at 6, and the HPA says why.
        gauge.set(10)
        hpa = wait_for(lambda: hpa_condition(control_plane, "ScalingLimited", "True"), timeout=60,
                       what="the HPA's ScalingLimited condition")
        limited = {c["type"]: c for c in hpa["status"]["conditions"]}["ScalingLimited"]
        assert limited["reason"] == "TooManyReplicas", limited
        scaled_to(control_plane, 6)
        hpa = control_plane.get(f"{HPAS}/{NAME}")
        assert (hpa["status"]["desiredReplicas"], hpa["spec"]["maxReplicas"]) == (6, 6)
        assert scaled_events(control_plane, 3)[2:] == [f"Scaled from 2 to 6 replicas {BY_HPA}"]
    finally:
        control_plane.kubectl("delete", "-n", NS, "hpa", NAME, "--ignore-not-found")
        control_plane.kubectl("delete", "-n", NS, "kvis", NAME, "--ignore-not-found")


def hpa_for_test() -> dict[str, Any]:
    """docs/examples/hpa-external.yaml as written, but for its scale-down window (0 s instead of 300 s)."""
    hpa = yaml.safe_load(EXAMPLE_HPA.read_text())
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] = 0
    return dict(hpa)


def ready_replicas(cp: ControlPlane) -> int | None:
    st = cp.get(f"{ISVCS}/{NAME}").get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
    return st.get("readyReplicas") if ready else None


def scaled_to(cp: ControlPlane, replicas: int) -> None:
    """The HPA's count in the scale subresource, the Deployment following it, and its pods Ready."""
    wait_for(lambda: cp.get(f"{ISVCS}/{NAME}/scale")["spec"]["replicas"] == replicas, timeout=60,
             what=f"the HPA writing {replicas} replicas through the scale subresource")
    wait_for(lambda: cp.get(f"{DEPLOYMENTS}/{NAME}")["spec"]["replicas"] == replicas, timeout=60,
             what=f"the Deployment at {replicas} replicas")
    wait_for(lambda: ready_replicas(cp) == replicas, timeout=90, what=f"{NAME} Ready with {replicas} replicas")


def hpa_condition(cp: ControlPlane, kind: str, status: str) -> dict[str, Any] | None:
    hpa = cp.get(f"{HPAS}/{NAME}")
    conds = {c["type"]: c["status"] for c in (hpa.get("status") or {}).get("conditions") or []}
    return dict(hpa) if conds.get(kind) == status else None


def scaled_events(cp: ControlPlane, count: int) -> list[str]:
    """The `Scaled` Events' messages, oldest first, once there are `count` of them (the operator posts each
    after its Deployment write, so it may come after the pods)."""
    def events() -> list[dict[str, Any]] | None:
        found = [e for e in cp.get(f"/api/v1/namespaces/{NS}/events")["items"]
                 if e["involvedObject"].get("kind") == "InferenceService" and e["involvedObject"].get("name") == NAME
                 and e.get("reason") == "Scaled"]
        return found if len(found) >= count else None
    found = wait_for(events, timeout=30, what=f"{count} Scaled Events")
    return [e["message"] for e in sorted(found, key=lambda e: e["metadata"]["creationTimestamp"])]
