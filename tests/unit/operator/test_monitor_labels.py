"""Every label the SLO rules, the dashboard and the tuner select vLLM's series by is a label the
series carries once the operator's monitor has Prometheus scrape it.

The labels are derived from the rendered objects by the Prometheus Operator's and Prometheus's own
rules (tests/support/prometheus_operator.py: the relabelling promcfg.go writes for the monitor,
Kubernetes service discovery of the rendered Service and a pod of the rendered Deployment), never
from kvpilot's constants; the series' own labels come from the twin's /metrics, which exposes vLLM
0.33's families. Every query is parsed with a real PromQL parser (promql-parser, the Rust parser
GreptimeDB uses) and each selector on a `vllm:` series or `up` is checked against that label set.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api import vllm
from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import SERIES_LABEL_INFERENCESERVICE, SERIES_LABEL_TRACK
from kvpilot.operator.builders.canary import CanaryRequest, build_canary_deployment
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.render import render_manifests
from kvpilot.slo import dashboard as dash
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.signals import signal_queries
from kvpilot.tuner.adapters.prometheus import PrometheusSignals, estimate_workload
from kvpilot.tuner.core.objective import SLO
from kvpilot.twin.metrics import VllmMetrics
from tests.support import prometheus_operator as po
from tests.support import promql_labels
from tests.unit.operator.fixtures import isvc_dict

NS, NAME = "team-a", "chat"
MONITOR_KINDS = ("ServiceMonitor", "PodMonitor")
# Series vLLM renamed in 0.11: the queries fall back to them; they carry their successor's labels.
RENAMED = {vllm.METRIC_ITL_LEGACY: vllm.METRIC_ITL, vllm.METRIC_KV_USAGE_LEGACY: vllm.METRIC_KV_USAGE}


def the_isvc(monitor: str) -> InferenceService:
    obj = isvc_dict(replicas=2, observability={"monitor": monitor})
    obj["metadata"].update(name=NAME, namespace=NS)
    return InferenceService.model_validate(obj)


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [m for m in manifests if m["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} rendered"
    return found[0]


def scraped_series(isvc: InferenceService, monitor_kind: str) -> tuple[dict[str, list[dict[str, str]]], dict[str, str]]:
    """Sample name -> the label sets of its series as Prometheus stores them, and the target's labels."""
    manifests = render_manifests(isvc, RenderOptions())
    deployment, service = one(manifests, "Deployment"), one(manifests, "Service")
    monitor = one(manifests, monitor_kind)
    pod = po.pod_from_template(deployment, f"{NAME}-5d8f7c9b6-x2x9k")
    targets = po.monitor_targets(monitor, service, pod)
    assert len(targets) == 1, f"the {monitor_kind} should make one target of the pod, made {targets}"
    target = targets[0]
    # A canary trial's pod beside it, through the same monitor: the per-track panels read its series.
    canary = build_canary_deployment(isvc, CanaryRequest(3, {"maxNumBatchedTokens": 4096,
                                                             "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128}))
    [canary_target] = po.monitor_targets(monitor, service, po.pod_from_template(
        canary, f"{NAME}-canary-7f9c8d6b5-q4w8z", ip="10.0.0.9"))
    exposition = VllmMetrics(isvc.spec.model, max_model_len=8192,
                             cache_config={"block_size": 16, "gpu_memory_utilization": 0.9}).render().decode()
    series: dict[str, list[dict[str, str]]] = defaultdict(list)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            for each in (target, canary_target):
                series[sample.name].append(po.series_labels(each, sample.labels, honor=po.honor_labels(monitor)))
    series["up"] = [target, canary_target]  # Prometheus's synthetic series carry the target's labels only
    return series, target


# --- the queries kvpilot sends ------------------------------------------------------------------


def rule_queries(isvc: InferenceService) -> list[str]:
    rule = one(render_manifests(isvc, RenderOptions()), "PrometheusRule")
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard_panels(isvc: InferenceService) -> Iterator[dict[str, Any]]:
    for board in (dash.dashboard_for(isvc), dash.dashboard_all()):
        for panel in board["panels"]:
            yield from panel.get("targets", [])


def dashboard_queries(isvc: InferenceService) -> list[str]:
    return [dash.resolve(t["expr"], NS, NAME) for t in dashboard_panels(isvc)]


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")


def dashboard_variable_reads(isvc: InferenceService) -> list[tuple[str, set[str]]]:
    """Grafana's `label_values(selector, label)`: the selector, and the label it reads values of."""
    out = []
    for board in (dash.dashboard_for(isvc), dash.dashboard_all()):
        for var in board["templating"]["list"]:
            if var["type"] != "query":
                continue
            match = _LABEL_VALUES.match(dash.resolve(var["definition"], NS, NAME))
            assert match, f"dashboard variable {var['name']}: not label_values(...): {var['definition']}"
            out.append((match["selector"], {match["label"]}))
    return out


def legend_reads(isvc: InferenceService) -> list[tuple[str, set[str]]]:
    """Legends like `{{pod}}` print a label of the series the target's query returns."""
    return [(dash.resolve(t["expr"], NS, NAME), set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"])))
            for t in dashboard_panels(isvc) if "{{" in t.get("legendFormat", "")]


class RecordingReader:
    """Stands in for the HTTP reader under PrometheusSignals: records each query, answers 1."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def scalar(self, expr: str, at: float | None = None) -> float:
        self.queries.append(expr)
        return 1.0


def tuner_queries(isvc: InferenceService) -> list[str]:
    """What the in-cluster tuner asks Prometheus while it measures a trial and estimates the workload."""
    slo = SLO(isvc.spec.slo.ttft_seconds, isvc.spec.slo.itl_seconds)
    signals = PrometheusSignals.for_inferenceservice("http://127.0.0.1:9", NS, NAME, slo=slo,
                                                     objective=isvc.spec.slo.objective)
    reader = RecordingReader()
    signals._reader = reader  # type: ignore[assignment]
    signals.measure(600.0)
    estimate_workload(signals, 3600.0)
    # The SLO reader (`kvpilot slo read`, status) reads the same target's signals.
    target = SloTarget.from_isvc(isvc)
    return reader.queries + list(signal_queries(target.pods, target, "10m").values())


# --- the check -----------------------------------------------------------------------------------


def engine_series(name: str) -> bool:
    return name.startswith("vllm:") or name == "up"


def renamed(name: str) -> str:
    for old, new in RENAMED.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def problems(series: dict[str, list[dict[str, str]]], reads: Iterable[tuple[str, set[str]]]) -> list[str]:
    return promql_labels.problems(series, reads, checked=engine_series, rename=renamed)


# --- the contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("monitor_kind", MONITOR_KINDS)
def test_the_monitor_gives_the_series_every_label_kvpilot_selects_on(monitor_kind: str) -> None:
    isvc = the_isvc(monitor_kind)
    series, target = scraped_series(isvc, monitor_kind)
    sources = {
        "rules": [(q, set()) for q in rule_queries(isvc)],
        "dashboard": [(q, set()) for q in dashboard_queries(isvc)] + dashboard_variable_reads(isvc)
        + legend_reads(isvc),
        "tuner": [(q, set()) for q in tuner_queries(isvc)],
    }
    for source, reads in sources.items():
        # Not vacuous: each source reads vLLM's series through several selectors.
        checked = promql_labels.count_checked(reads, engine_series)
        assert checked >= 5, f"{source}: only {checked} engine selectors found"
        found = problems(series, reads)
        assert found == [], (f"the {source} select what no series scraped through the {monitor_kind} "
                             f"carries (its target's labels: {target}):\n" + "\n".join(found[:10]))


@pytest.mark.parametrize("monitor_kind", MONITOR_KINDS)
def test_the_target_labels_are_the_operators_and_the_inferenceservice(monitor_kind: str) -> None:
    """The exact target labels, as the Prometheus Operator's rules make them of these objects."""
    _, target = scraped_series(the_isvc(monitor_kind), monitor_kind)
    pod = f"{NAME}-5d8f7c9b6-x2x9k"
    expected = {"namespace": NS, "pod": pod, "container": "engine", "endpoint": "http",
                "instance": "10.0.0.7:8000", "kvpilot_dev_inferenceservice": NAME, "kvpilot_dev_track": "stable"}
    if monitor_kind == "ServiceMonitor":
        expected |= {"service": NAME, "job": NAME}
    else:
        expected |= {"job": f"{NS}/{NAME}"}
    assert target == expected


@pytest.mark.parametrize("monitor_kind", MONITOR_KINDS)
def test_a_canary_pod_is_scraped_by_the_same_monitor_with_its_track_on_every_series(monitor_kind: str) -> None:
    """The canary's pod (the canary Deployment's template) is a target of the service's own monitor
    (through the same Service's endpoints, for a ServiceMonitor), and its series differ from the stable
    pods' by kvpilot_dev_track only: the tuner compares the tracks by that label."""
    service_obj = the_isvc(monitor_kind)
    manifests = render_manifests(service_obj, RenderOptions())
    service, monitor = one(manifests, "Service"), one(manifests, monitor_kind)
    canary = build_canary_deployment(service_obj, CanaryRequest(3, {"maxNumBatchedTokens": 4096,
                                                                     "gpuMemoryUtilization": 0.85,
                                                                     "maxNumSeqs": 128}))
    stable_pod = po.pod_from_template(one(manifests, "Deployment"), f"{NAME}-5d8f7c9b6-x2x9k")
    canary_pod = po.pod_from_template(canary, f"{NAME}-canary-7f9c8d6b5-q4w8z", ip="10.0.0.9")
    [stable_target] = po.monitor_targets(monitor, service, stable_pod)
    [canary_target] = po.monitor_targets(monitor, service, canary_pod)
    assert stable_target[SERIES_LABEL_TRACK] == "stable" and canary_target[SERIES_LABEL_TRACK] == "canary"
    assert canary_target[SERIES_LABEL_INFERENCESERVICE] == NAME
    differ = {k for k in stable_target.keys() | canary_target.keys() if stable_target.get(k) != canary_target.get(k)}
    assert differ == {"pod", "instance", SERIES_LABEL_TRACK}


def test_the_check_catches_a_selector_no_scraped_series_satisfies() -> None:
    """The contract test itself: a pod label the monitor does not copy is not on the series, and a
    label with another value (a Service's name where the pod's is meant) selects nothing."""
    series, _ = scraped_series(the_isvc("ServiceMonitor"), "ServiceMonitor")
    missing_label = f'sum(rate(vllm:request_success_total{{namespace="{NS}",app_kubernetes_io_instance="{NAME}"}}[5m]))'
    [found] = problems(series, [(missing_label, set())])
    assert "its series lack ['app_kubernetes_io_instance']" in found
    wrong_value = f'vllm:num_requests_running{{namespace="{NS}",pod="{NAME}"}}'
    [found] = problems(series, [(wrong_value, set())])
    assert "no series matches" in found and "lack" not in found
    assert problems(series, [(f'vllm:num_requests_running{{namespace="{NS}"}}', {"node"})])
    assert problems(series, [(f'vllm:num_requests_running{{namespace=~"team-.*",pod=~"{NAME}-.+"}}', {"pod"})]) == []


def sample_names(exposition: bytes) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in exposition.decode().splitlines()
            if line and not line.startswith("#")}


@pytest.mark.parametrize("monitor_kind", MONITOR_KINDS)
def test_the_monitors_metric_relabelling_gives_back_vllms_names_where_prometheus_2_gets_them_escaped(
        monitor_kind: str) -> None:
    """Served through prometheus_client's negotiation (vLLM's /metrics/ mount), Prometheus 2.x's
    Accept header gets `vllm_` sample names; the monitor's `metricRelabelings` (Prometheus's
    `metric_relabel_configs`) give back every declared name, and leave names with the colon as they are."""
    from harness.prometheus import PROMETHEUS_2_ACCEPT

    monitor = one(render_manifests(the_isvc(monitor_kind), RenderOptions()), monitor_kind)
    configs = po.metric_relabel_configs(monitor)
    metrics = VllmMetrics("m", max_model_len=8192, cache_config={"block_size": 16})
    declared = sample_names(metrics.render())
    escaped = sample_names(metrics.exposition(PROMETHEUS_2_ACCEPT)[0])
    assert vllm.METRIC_RUNNING in declared and vllm.METRIC_RUNNING not in escaped  # not vacuous

    def renamed_by_the_monitor(names: set[str]) -> set[str]:
        out = set()
        for name in names:
            relabelled = po.metric_relabel(name, {"engine": "0"}, configs)
            assert relabelled is not None and relabelled[1] == {"engine": "0"}, relabelled
            out.add(relabelled[0])
        return out

    assert renamed_by_the_monitor(escaped) == declared
    assert renamed_by_the_monitor(declared) == declared


def test_monitor_labels_of_the_operator_label_the_monitor_and_the_rule_not_the_others() -> None:
    """--monitor-label: a Prometheus selecting monitors and rules by label (kube-prometheus-stack's
    `release`) picks up every InferenceService's; kvpilot's own labels are kept where a key collides."""
    options = RenderOptions(monitor_labels=(("release", "kps"), ("app.kubernetes.io/managed-by", "someone")))
    for kind in MONITOR_KINDS:
        manifests = render_manifests(the_isvc(kind), options)
        for labelled in (one(manifests, kind), one(manifests, "PrometheusRule")):
            labels = labelled["metadata"]["labels"]
            assert labels["release"] == "kps" and labels["app.kubernetes.io/managed-by"] == "kvpilot"
        for other in ("Deployment", "Service"):
            assert "release" not in one(manifests, other)["metadata"]["labels"]
