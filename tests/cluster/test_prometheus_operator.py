"""kvpilot's monitors and rules through the real Prometheus Operator, on a real Prometheus.

On a control plane of its own (Prometheus Operator's CRDs would make the package's operator write
monitors for every other test's InferenceServices): Prometheus Operator's CRDs and its operator
binary (scripts/build-prometheus-operator.sh), a `Prometheus` selecting monitors and rules as
docs/quickstart-kind.md has kube-prometheus-stack do (every ServiceMonitor, PodMonitor and
PrometheusRule, in every namespace), the chart's PrometheusRule, and the real `kvpilot operator`
writing a ServiceMonitor for one InferenceService and a PodMonitor for another, each with its SLO
PrometheusRule; and the chart's own ServiceMonitor, operator Service and Deployment. Prometheus
Operator generates the Prometheus configuration; a real Prometheus (3.13.1, built with it: Debian's
has no Kubernetes service discovery) runs it here changed only where a pod would differ
(harness.prometheus_operator.out_of_cluster: `$(SHARD)` and `$(POD_NAME)` expanded as the
config-reloader does, a kubeconfig for Kubernetes service discovery, the rule files where this
machine has them).

The PodMonitor's InferenceService runs on a kwok node whose pod CIDR is on the loopback (pod IPs
may be loopback; Endpoints and EndpointSlices refuse them), so its target is a synthetic vLLM
/metrics bound on the pod's IP and port, serving the escaped `vllm_` names: a real scrape. The
ServiceMonitor's pods get kwok's routable-looking fake IPs through the real endpoints controllers:
discovered and labelled, never reachable.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import chart
from harness.cluster import CONTROLLERS, ControlPlane, Operator, built_binaries, wait_for
from harness.prometheus import PrometheusServer
from harness.prometheus_operator import (
    PrometheusOperator,
    built_operator,
    generated_config,
    install_crds,
    out_of_cluster,
    prometheus_version,
    reloader_env,
    rule_files,
)
from harness.synthetic_vllm import SyntheticVllm
from kvpilot.api import gpus
from kvpilot.api.vocabulary import LABEL_GPU_PRODUCT
from tests.cluster.common import CRD_FILE, KWOK_STAGES, RBAC_KINDS
from tests.support import prometheus_operator as emulation

pytestmark = pytest.mark.cluster

NS = "serving"
MONITORING = "monitoring"
PROMETHEUS = "kvpilot"
KPS = "kps"  # a second Prometheus, selecting by kube-prometheus-stack's release label
ISVCS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices"
# Two GPU products, so each InferenceService (spec.resources.gpuType) lands on its own node.
ROUTED = gpus.product_label("A100-80GB")
LOOPBACK = gpus.product_label("H100-80GB")
LOOPBACK_CIDR = "127.77.0.0/24"
ENGINE_PORT = 8000
SM, PM = "sm", "pm"
# What Prometheus Operator names a monitor's scrape pool (job_name): <kind>/<namespace>/<name>/<endpoint>.
SM_POOL, PM_POOL = f"serviceMonitor/{NS}/{SM}/0", f"podMonitor/{NS}/{PM}/0"
# The chart with its ServiceMonitor and PrometheusRule (harness.chart's "monitoring" values), the operator's
# pods on the node with routable-looking IPs (the endpoints controllers refuse loopback ones), no tuner (its
# PVC would never bind here).
CHART_VALUES: dict[str, Any] = {**chart.VALUE_SETS["monitoring"], "tuner": {"enabled": False},
                                "operator": {"nodeSelector": {LABEL_GPU_PRODUCT: ROUTED}}}
CHART_KINDS = ("ServiceMonitor", "PrometheusRule", "Service", "Deployment")
CHART_POOL = f"serviceMonitor/{chart.NAMESPACE}/{chart.RELEASE}-kvpilot/0"


def inference_service(name: str, gpu: str, monitor: str) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "resources": {"gpuType": gpu},
                     "observability": {"monitor": monitor}}}


def prometheus_object(version: str, name: str = PROMETHEUS, selector: dict[str, Any] | None = None) -> dict[str, Any]:
    # By default kube-prometheus-stack with serviceMonitorSelectorNilUsesHelmValues,
    # podMonitorSelectorNilUsesHelmValues and ruleSelectorNilUsesHelmValues false (docs/quickstart-kind.md):
    # empty selectors, all namespaces. With `selector`, the stack's defaults: its release label.
    everything: dict[str, Any] = {}
    chosen = selector if selector is not None else everything
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "Prometheus",
            "metadata": {"name": name, "namespace": MONITORING},
            "spec": {"version": version,  # the Prometheus that runs the configuration here
                     "serviceMonitorSelector": chosen, "serviceMonitorNamespaceSelector": everything,
                     "podMonitorSelector": chosen, "podMonitorNamespaceSelector": everything,
                     "ruleSelector": chosen, "ruleNamespaceSelector": everything}}


def namespace(cp: ControlPlane, name: str) -> None:
    cp.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(lambda: cp.get_or_none(f"/api/v1/namespaces/{name}/serviceaccounts/default"), timeout=30,
             what=f"the default ServiceAccount in {name}")


@dataclass
class World:
    operator_dir: Path
    cp: ControlPlane
    workdir: Path
    # What Prometheus Operator generated: prometheus.yaml, and rule ConfigMap -> {file: text}.
    config: dict[str, Any]
    rules: dict[str, dict[str, str]]
    pm_pod: dict[str, Any]


def start_cluster(cp: ControlPlane, operator_dir: Path) -> None:
    cp.add_node("kwok-routed", labels={LABEL_GPU_PRODUCT: ROUTED})
    cp.add_node("kwok-loopback", labels={LABEL_GPU_PRODUCT: LOOPBACK}, pod_cidr=LOOPBACK_CIDR)
    install_crds(cp, operator_dir)
    cp.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(CRD_FILE.read_text()))
    wait_for(lambda: cp.get("/apis/kvpilot.dev/v1alpha1/inferenceservices"), timeout=60,
             what="InferenceServices served")
    for name in (chart.NAMESPACE, NS, MONITORING):
        namespace(cp, name)
    cp.apply_manifests([r.obj for r in chart.render("default") if r.kind in RBAC_KINDS])


def kvpilot_operator_kubeconfig(cp: ControlPlane, path: Path) -> Path:
    """As the chart's operator ServiceAccount: its RBAC must let it write the monitors and rules."""
    (account,) = [r.obj["metadata"]["name"] for r in chart.render("default") if r.kind == "ServiceAccount"
                  and r.obj["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    return cp.service_account_kubeconfig(path, chart.NAMESPACE, account)


def wait_generated(cp: ControlPlane, promop: PrometheusOperator,
                   wanted_rules: set[str]) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    def generated() -> tuple[dict[str, Any], dict[str, dict[str, str]]] | None:
        promop.check_alive()
        config = generated_config(cp, MONITORING, PROMETHEUS)
        rules = rule_files(cp, MONITORING, PROMETHEUS)
        jobs = {j["job_name"] for j in (config or {}).get("scrape_configs") or []}
        files = {f for files in rules.values() for f in files}
        have = {w for w in wanted_rules if any(f.startswith(f"{w}-") for f in files)}
        return (config, rules) if config and {SM_POOL, PM_POOL, CHART_POOL} <= jobs and have == wanted_rules else None
    result: tuple[dict[str, Any], dict[str, dict[str, str]]] = wait_for(
        generated, timeout=180, interval=0.5, what="Prometheus Operator's configuration with kvpilot's monitors and rules")
    return result


def pod_with_ip(cp: ControlPlane, name: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        pods = cp.get(f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": f"app.kubernetes.io/instance={name}"})
        return next((p for p in pods["items"] if p["status"].get("podIP")), None)
    pod: dict[str, Any] = wait_for(found, timeout=120, what=f"{name}'s pod with an IP")
    return pod


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The control plane with Prometheus Operator, its Prometheus and kvpilot's objects, once the
    generated configuration holds both monitors' jobs and all three PrometheusRules."""
    operator_dir = built_operator()
    workdir = tmp_path_factory.mktemp("prometheus-operator")
    controllers = (*CONTROLLERS, "endpoints-controller", "endpointslice-controller")
    with ControlPlane(built_binaries(), workdir / "control-plane", kwok_config=KWOK_STAGES,
                      controllers=controllers) as cp:
        start_cluster(cp, operator_dir)
        kubeconfig = kvpilot_operator_kubeconfig(cp, workdir / "operator.kubeconfig")
        promop = PrometheusOperator(operator_dir, cp.admin_kubeconfig, workdir)
        kvpilot: Operator | None = None
        try:
            (workdir / "kvpilot-operator").mkdir()
            # The chart's operator.monitorLabels, as kube-prometheus-stack's default selectors need them.
            kvpilot = Operator(kubeconfig, workdir / "kvpilot-operator", "--monitor-label", f"release={KPS}")
            api = "/apis/monitoring.coreos.com/v1/namespaces"
            cp.create(f"{api}/{MONITORING}/prometheuses", prometheus_object(prometheus_version(operator_dir)))
            cp.create(f"{api}/{MONITORING}/prometheuses", prometheus_object(
                prometheus_version(operator_dir), KPS, {"matchLabels": {"release": KPS}}))
            rendered = chart.render(CHART_VALUES)
            cp.apply_manifests([r.obj for r in rendered if r.kind in CHART_KINDS])
            chart_rule = chart.one(rendered, "PrometheusRule")
            cp.create(ISVCS, inference_service(SM, ROUTED, "ServiceMonitor"))
            cp.create(ISVCS, inference_service(PM, LOOPBACK, "PodMonitor"))
            # Prometheus Operator names each rule file <namespace>-<name>-<uid>.yaml.
            wanted = {f"{NS}-{SM}-slo", f"{NS}-{PM}-slo", f"{chart.NAMESPACE}-{chart_rule['metadata']['name']}"}
            config, rules = wait_generated(cp, promop, wanted)
            yield World(operator_dir, cp, workdir, config, rules, pod_with_ip(cp, PM))
            promop.check_alive()
        finally:
            if kvpilot is not None:
                kvpilot.close()
            assert promop.stop() == 0, f"prometheus-operator did not shut down cleanly:\n{promop.log()[-4000:]}"
        forbidden = [line for line in kvpilot.log().splitlines() if re.search(r"\b403\b|[Ff]orbidden", line)]
        assert forbidden == [], "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


@pytest.fixture(scope="module")
def prometheus(world: World) -> Iterator[PrometheusServer]:
    config = out_of_cluster(world.config, world.cp.admin_kubeconfig, world.rules, world.workdir / "rules",
                            reloader_env(PROMETHEUS))
    # Both, side by side, for whoever reads a failure.
    (world.workdir / "prometheus.generated.yaml").write_text(yaml.safe_dump(world.config, sort_keys=False))
    (world.workdir / "prometheus.out-of-cluster.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with SyntheticVllm(escaped=True, host=world.pm_pod["status"]["podIP"], port=ENGINE_PORT), \
            PrometheusServer(full_config=config, binary=str(world.operator_dir / "prometheus")) as prom:
        yield prom


def active_targets(prom: PrometheusServer, pool: str) -> list[dict[str, Any]]:
    targets = prom.api("targets", {"state": "active"})["data"]["activeTargets"]
    return [t for t in targets if t["scrapePool"] == pool]


@pytest.mark.parametrize(("name", "pool"), [(SM, SM_POOL), (PM, PM_POOL)])
def test_prometheus_discovers_the_pods_with_the_labels_the_rules_select(
        world: World, prometheus: PrometheusServer, name: str, pool: str) -> None:
    pods = world.cp.get(f"/api/v1/namespaces/{NS}/pods",
                           params={"labelSelector": f"app.kubernetes.io/instance={name}"})["items"]
    targets = wait_for(lambda: active_targets(prometheus, pool) or None, timeout=60, what=f"{pool}'s targets")
    assert {t["labels"]["pod"] for t in targets} == {p["metadata"]["name"] for p in pods}
    for target in targets:
        labels = target["labels"]
        assert labels["kvpilot_dev_inferenceservice"] == name
        assert labels["kvpilot_dev_track"] == "stable"
        assert labels["namespace"] == NS


def test_the_escaped_vllm_names_are_renamed_on_a_real_scrape(world: World,
                                                             prometheus: PrometheusServer) -> None:
    selector = f'kvpilot_dev_inferenceservice="{PM}", namespace="{NS}"'
    # The endpoint's interval is 15 s: the first scrape lands within one interval of start-up.
    series = prometheus.wait_for(f'vllm:time_to_first_token_seconds_count{{{selector}}}', timeout=60)
    assert series[0]["metric"]["kvpilot_dev_track"] == "stable"
    assert prometheus.query(f'{{__name__=~"vllm_.+", {selector}}}') == []
    (target,) = active_targets(prometheus, PM_POOL)
    assert target["health"] == "up", target


def test_the_recording_and_alerting_rules_load_and_evaluate(world: World, prometheus: PrometheusServer) -> None:
    written = {file for files in world.rules.values() for file in files}

    not_ok: list[tuple[str, str, str]] = []

    def evaluated() -> list[dict[str, Any]] | None:
        groups: list[dict[str, Any]] = prometheus.api("rules")["data"]["groups"]
        # A group evaluated less often than every minute (the error budget's, 5m) may not have run yet.
        not_ok[:] = [(r["name"], r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]
                     if r["health"] != "ok" and not (r["health"] == "unknown" and g["interval"] > 60)]
        return groups if groups and not not_ok else None
    # Rules are evaluated every evaluation_interval (Prometheus Operator's default, 30 s).
    try:
        groups = wait_for(evaluated, timeout=120, interval=1, what="every rule evaluated without error")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; not ok: {not_ok}") from None
    assert {Path(g["file"]).name for g in groups} == written
    assert [r for g in groups for r in g["rules"] if r["health"] == "err" or r.get("lastError")] == []
    assert {r["type"] for g in groups for r in g["rules"]} == {"recording", "alerting"}
    assert "kvpilot.operator" in {g["name"] for g in groups}
    # The SLO rules select the labels the PodMonitor gives the scraped series: all in TTFT's lowest
    # bucket, so no error at all.
    ratio = prometheus.wait_for(f'kvpilot:slo_ttft_error_ratio:rate5m{{inferenceservice="{PM}"}}', timeout=120)
    assert float(ratio[0]["value"][1]) == 0.0


@pytest.mark.parametrize(("name", "pool"), [(SM, SM_POOL), (PM, PM_POOL)])
def test_the_emulated_monitor_semantics_give_the_labels_the_real_ones_do(
        world: World, prometheus: PrometheusServer, name: str, pool: str) -> None:
    """tests/support/prometheus_operator.py (the unit tests' stand-in for Prometheus Operator and
    Kubernetes service discovery) against the real pair: the same target labels for each pod."""
    cp = world.cp
    kind, plural = ("ServiceMonitor", "servicemonitors") if name == SM else ("PodMonitor", "podmonitors")
    monitor = cp.get(f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/{plural}/{name}")
    assert monitor["kind"] == kind
    service = cp.get(f"/api/v1/namespaces/{NS}/services/{name}")
    targets = wait_for(lambda: active_targets(prometheus, pool) or None, timeout=60, what=f"{pool}'s targets")
    for target in targets:
        pod = cp.get(f"/api/v1/namespaces/{NS}/pods/{target['labels']['pod']}")
        emulated = emulation.monitor_targets(monitor, service, pod)
        assert emulated == [target["labels"]]


@pytest.mark.parametrize("plural_name", ["servicemonitors/sm", "podmonitors/pm", "prometheusrules/sm-slo",
                                         "prometheusrules/pm-slo", "prometheusrules/kvp-kvpilot",
                                         "servicemonitors/kvp-kvpilot"])
def test_prometheus_operator_accepts_each_monitor_and_rule(world: World, plural_name: str) -> None:
    """Prometheus Operator's own verdict (status.bindings, with StatusForConfigurationResources): a
    monitor or rule it finds invalid is left out of the configuration with Accepted False and why."""
    plural, name = plural_name.split("/")
    ns = chart.NAMESPACE if name == "kvp-kvpilot" else NS
    path = f"/apis/monitoring.coreos.com/v1/namespaces/{ns}/{plural}/{name}"

    def binding() -> dict[str, Any] | None:
        bindings = world.cp.get(path).get("status", {}).get("bindings") or []
        return next((b for b in bindings if (b["namespace"], b["name"]) == (MONITORING, PROMETHEUS)), None)
    bound = wait_for(binding, timeout=60, what=f"{plural_name} bound to Prometheus {PROMETHEUS}")
    accepted = {c["type"]: c for c in bound["conditions"]}["Accepted"]
    assert accepted["status"] == "True", accepted


def test_a_prometheus_selecting_by_release_label_gets_every_monitor_and_rule_with_monitor_labels(
        world: World) -> None:
    """kube-prometheus-stack's default selectors (release=<its release>) pick up each InferenceService's
    monitor and SLO rules once the operator runs with --monitor-label release=<it> (operator.monitorLabels)."""
    def generated() -> tuple[set[str], set[str]] | None:
        config = generated_config(world.cp, MONITORING, KPS)
        files = {f for fs in rule_files(world.cp, MONITORING, KPS).values() for f in fs}
        jobs = {j["job_name"] for j in (config or {}).get("scrape_configs") or []}
        return (jobs, files) if {SM_POOL, PM_POOL} <= jobs and len(files) >= 2 else None
    jobs, files = wait_for(generated, timeout=120, interval=0.5, what=f"Prometheus {KPS}'s configuration")
    # Prometheus Operator names each rule file <namespace>-<name>-<uid>.yaml.
    assert all(any(f.startswith(f"{NS}-{name}-slo-") for f in files) for name in (SM, PM)), files
    assert CHART_POOL not in jobs  # the chart's own monitor carries no release label in these values


def test_the_charts_operator_down_alert_selects_the_targets_its_service_monitor_gives(
        world: World, prometheus: PrometheusServer) -> None:
    """KvpilotOperatorDown keys on `up{job=..., namespace=...}`: the labels Prometheus Operator gives
    the targets of the chart's ServiceMonitor (the operator's pods here are never reachable, so `up` is 0)."""
    rule = chart.one(chart.render(CHART_VALUES), "PrometheusRule")
    (down,) = [r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "KvpilotOperatorDown"]
    selector = re.search(r"\bup\{[^}]*\}", down["expr"])
    assert selector is not None, down["expr"]
    pods = world.cp.get(f"/api/v1/namespaces/{chart.NAMESPACE}/pods",
                        params={"labelSelector": "app.kubernetes.io/component=operator"})["items"]
    assert pods
    # The chart's ServiceMonitor scrapes every 30 s: `up` exists once each target has been tried.
    wait_for(lambda: len(prometheus.query(selector.group(0))) == len(pods) or None, timeout=90,
             what=f"{selector.group(0)} for each of the chart's operator pods")
    assert {t["labels"]["pod"] for t in active_targets(prometheus, CHART_POOL)} == {p["metadata"]["name"] for p in pods}
