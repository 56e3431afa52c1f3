"""Prometheus Operator objects: a ServiceMonitor or a PodMonitor scraping vLLM's /metrics, and the SLO
PrometheusRule.

A series scraped through either monitor carries the monitor's own labels (namespace, pod, container,
endpoint, job; a ServiceMonitor adds service) and, of the pod's labels, only those named in
`podTargetLabels`, sanitised (`kvpilot.dev/inferenceservice` -> `kvpilot_dev_inferenceservice`).
The SLO rules, the dashboard and the tuner select an InferenceService's series by that label, so
both monitors list vocabulary.SERIES_POD_LABELS there.

Both monitors' endpoints also carry a `metricRelabelings` rule that renames `vllm_<name>` samples back
to `vllm:<name>`, as every query kvpilot writes asks for `vllm:` names.  vLLM 0.32's GET /metrics keeps
the colon; served through prometheus_client's content negotiation (vLLM's /metrics/ mount, a build whose
/metrics negotiates), Prometheus 2.x gets OpenMetrics with `escaping=underscores` and `_` for `:`
(prometheus/client_python#1177).  Where the names arrive with the colon the rule matches nothing.
"""

from __future__ import annotations

from typing import Any

from kvpilot.api import vllm
from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import SERIES_POD_LABELS, MonitorKind
from kvpilot.operator.builders.common import HTTP_PORT_NAME, object_meta, owner_reference, selector_labels
from kvpilot.slo.rules import prometheus_rule_for

SCRAPE_INTERVAL = "15s"
MONITORING_API_VERSION = "monitoring.coreos.com/v1"
# The monitor kinds the operator can render, and the resource (plural) each is served as.
MONITOR_PLURALS: dict[MonitorKind, str] = {
    MonitorKind.SERVICE_MONITOR: "servicemonitors",
    MonitorKind.POD_MONITOR: "podmonitors",
}


# Prometheus's name for a series' metric name, as a label.
METRIC_NAME_LABEL = "__name__"


def metric_name_relabelings() -> list[dict[str, Any]]:
    """`vllm_<name>` -> `vllm:<name>` after the scrape (see the module's docstring)."""
    return [{"sourceLabels": [METRIC_NAME_LABEL], "regex": vllm.METRIC_NAME_ESCAPED_REGEX,
             "targetLabel": METRIC_NAME_LABEL, "replacement": vllm.METRIC_NAME_ESCAPED_REPLACEMENT,
             "action": "replace"}]


def _endpoint() -> dict[str, Any]:
    return {"port": HTTP_PORT_NAME, "path": "/metrics", "interval": SCRAPE_INTERVAL,
            "metricRelabelings": metric_name_relabelings()}


def _monitor_spec(isvc: InferenceService) -> dict[str, Any]:
    return {
        "selector": {"matchLabels": selector_labels(isvc)},
        "namespaceSelector": {"matchNames": [isvc.metadata.namespace]},
        "podTargetLabels": list(SERIES_POD_LABELS),
    }


def build_service_monitor(isvc: InferenceService) -> dict[str, Any]:
    """Scrapes the Service's endpoints (the ready pods) on the named port."""
    return {
        "apiVersion": MONITORING_API_VERSION,
        "kind": MonitorKind.SERVICE_MONITOR.value,
        "metadata": object_meta(isvc),
        "spec": {**_monitor_spec(isvc), "endpoints": [_endpoint()]},
    }


def build_pod_monitor(isvc: InferenceService) -> dict[str, Any]:
    """Scrapes the pods directly on the container port of that name (no Service in between)."""
    return {
        "apiVersion": MONITORING_API_VERSION,
        "kind": MonitorKind.POD_MONITOR.value,
        "metadata": object_meta(isvc),
        "spec": {**_monitor_spec(isvc), "podMetricsEndpoints": [_endpoint()]},
    }


def build_monitor(isvc: InferenceService, kind: MonitorKind) -> dict[str, Any]:
    if kind is MonitorKind.POD_MONITOR:
        return build_pod_monitor(isvc)
    if kind is MonitorKind.SERVICE_MONITOR:
        return build_service_monitor(isvc)
    raise ValueError(f"no monitor object for spec.observability.monitor {kind.value!r}")


def build_prometheus_rule(isvc: InferenceService) -> dict[str, Any]:
    """The SLO rules from kvpilot.slo, owned by the InferenceService."""
    rule = prometheus_rule_for(isvc)
    rule["metadata"]["ownerReferences"] = [owner_reference(isvc)]
    return rule
