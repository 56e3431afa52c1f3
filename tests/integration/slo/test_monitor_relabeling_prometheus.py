"""A real Prometheus applies the relabelling the Prometheus Operator writes for kvpilot's monitor to a
real twin target, and the SLO rules' and the tuner's selectors find its series.

There is no Kubernetes here: the target is a static one carrying the meta labels Kubernetes service
discovery would give the rendered Service and a pod of the rendered Deployment
(tests/support/prometheus_operator.py), and the scrape config's `relabel_configs` are those the
operator generates for the rendered ServiceMonitor or PodMonitor. Prometheus itself does the
relabelling, so this also holds the unit contract test's label derivation to Prometheus's own.

The monitors' `metricRelabelings` (the scrape config's `metric_relabel_configs`) rename `vllm_<name>`
samples to `vllm:<name>`. vLLM's GET /metrics keeps the colon for any Prometheus, but its
prometheus_client mount under /metrics/ negotiates, and to Prometheus 2.x (Debian's 2.42 here) it
answers OpenMetrics with `escaping=underscores`: `vllm_` sample names. The twin serves both as vLLM
does, so the rule is tested on the twin's /metrics/ too, against a control without it.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.prometheus import VLLM_METRIC_RELABEL_CONFIGS, PrometheusServer, require_prometheus
from harness.twin_process import twin_server
from kvpilot.api import vllm
from kvpilot.api.models import InferenceService
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.render import render_manifests
from kvpilot.slo import promql
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.rules import ALERT_METRICS_ABSENT
from tests.support import prometheus_operator as po

pytestmark = pytest.mark.integration

NS, NAME = "team-a", "chat"


def the_isvc(monitor: str) -> InferenceService:
    return InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {"model": "Llama-3.1-8B", "replicas": 2, "engine": {"kind": "twin"},
                 "observability": {"monitor": monitor}},
    })


def one(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = [m for m in manifests if m["kind"] == kind]
    return found


@pytest.mark.parametrize("monitor_kind", ["ServiceMonitor", "PodMonitor"])
def test_prometheus_relabels_the_twin_as_the_monitor_says(monitor_kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_prometheus()
    isvc = the_isvc(monitor_kind)
    manifests = render_manifests(isvc, RenderOptions())
    monitor, service = one(manifests, monitor_kind), one(manifests, "Service")
    pod = po.pod_from_template(one(manifests, "Deployment"), f"{NAME}-5d8f7c9b6-x2x9k")
    discovered = (po.endpoints_targets(service, pod) if monitor_kind == "ServiceMonitor" else po.pod_targets(pod))
    assert len(discovered) == 1
    rule = one(manifests, "PrometheusRule")
    absent_expr = next(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]
                       if r.get("alert") == ALERT_METRICS_ABSENT)

    with twin_server("--model", "Llama-3.1-8B", "--gpu", "A10G", "--max-model-len", "4096",
                     log_dir=tmp_path) as twin:
        address = f"127.0.0.1:{twin.port}"
        config = po.scrape_config(monitor, discovered[0], address=address)
        with PrometheusServer(scrape_configs=[config]) as prom:
            selector = SloTarget.from_isvc(isvc).pods
            running = prom.wait_for(promql.metrics_present(selector))
            # What the unit contract test derives for this target, with the twin's address.
            expected_target = po.target_labels({**discovered[0], "__address__": address},
                                               po.relabel_configs(monitor), job=po.job_name(monitor))
            assert expected_target is not None
            exposed = next(s.labels for s in twin.metric_families()[vllm.METRIC_RUNNING].samples)
            expected = po.series_labels(expected_target, exposed, honor=po.honor_labels(monitor))
            assert [r["metric"] for r in running] == [{"__name__": vllm.METRIC_RUNNING, **expected}]
            # The MetricsAbsent alert's expression is empty: the service's metrics are there.
            assert prom.query(absent_expr) == []
            # The tuner's and the rules' histogram selectors find the twin's series too.
            assert prom.query(f"{vllm.METRIC_TTFT}_count{{{selector.render()}}}")
            assert prom.query(promql.up(selector))[0]["value"][1] == "1"
            assert prom.query('{__name__=~"vllm_.+"}') == []


def own_scrape_config(address: str) -> dict[str, Any]:
    """`observability.monitor: None`: a scrape config of one's own, with the labels kvpilot selects on
    and the metric relabelling docs/resource.md gives."""
    return {"job_name": "own", "scrape_interval": "1s", "scrape_timeout": "1s",
            "static_configs": [{"targets": [address],
                                "labels": {"namespace": NS, "kvpilot_dev_inferenceservice": NAME}}],
            "metric_relabel_configs": VLLM_METRIC_RELABEL_CONFIGS}


@pytest.mark.parametrize("monitor_kind", ["ServiceMonitor", "PodMonitor", "None"])
def test_the_monitors_metric_relabelling_restores_vllms_names_where_prometheus_2_gets_them_escaped(
        monitor_kind: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    require_prometheus()
    isvc = the_isvc(monitor_kind)
    selector = SloTarget.from_isvc(isvc).pods

    with twin_server("--model", "Llama-3.1-8B", "--gpu", "A10G", "--max-model-len", "4096",
                     log_dir=tmp_path) as twin:
        address = f"127.0.0.1:{twin.port}"
        if monitor_kind == "None":
            config = own_scrape_config(address)
        else:
            manifests = render_manifests(isvc, RenderOptions())
            monitor, service = one(manifests, monitor_kind), one(manifests, "Service")
            pod = po.pod_from_template(one(manifests, "Deployment"), f"{NAME}-5d8f7c9b6-x2x9k")
            [discovered] = (po.endpoints_targets(service, pod) if monitor_kind == "ServiceMonitor"
                            else po.pod_targets(pod))
            config = po.scrape_config(monitor, discovered, address=address)
        assert config["metric_relabel_configs"], "the scrape config renames nothing"
        # Pointed at the negotiating path (vLLM's prometheus_client mount under /metrics/).
        config["metrics_path"] = "/metrics/"
        control = {**config, "metric_relabel_configs": []}
        with PrometheusServer(scrape_configs=[config]) as prom, PrometheusServer(scrape_configs=[control]) as bare:
            [running] = prom.wait_for(promql.metrics_present(selector))
            assert running["metric"]["__name__"] == vllm.METRIC_RUNNING
            assert prom.query(f"{vllm.METRIC_TTFT}_count{{{selector.render()}}}")
            assert prom.query('{__name__=~"vllm_.+"}') == []
            # The control: what the Prometheus stores without the rule depends on its Accept header.
            if bare.version().startswith("2."):  # OpenMetrics, escaping=underscores
                escaped = "vllm_" + vllm.METRIC_RUNNING.removeprefix("vllm:")
                [series] = bare.wait_for(f"{escaped}{{{selector.render()}}}")
                assert {k: v for k, v in series["metric"].items() if k != "__name__"} == \
                    {k: v for k, v in running["metric"].items() if k != "__name__"}
                assert bare.query(promql.metrics_present(selector)) == []
                assert bare.query(f"{vllm.METRIC_TTFT}_count{{{selector.render()}}}") == []
                assert bare.query('{__name__=~"vllm:.+"}') == []
            else:  # Prometheus 3.x asks for escaping=allow-utf-8: the names keep their colon
                assert bare.wait_for(promql.metrics_present(selector))
