"""Prometheus Operator objects: a ServiceMonitor scraping vLLM's /metrics, and the SLO PrometheusRule.

A series scraped through the ServiceMonitor carries the monitor's own labels (namespace, service, pod,
container, endpoint, job) and, of the pod's labels, only those named in `podTargetLabels`, sanitised
(`kvpilot.dev/inferenceservice` -> `kvpilot_dev_inferenceservice`).  The SLO rules, the dashboard and
the tuner select an InferenceService's series by that label, so the monitor lists
vocabulary.SERIES_POD_LABELS there.
"""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import SERIES_POD_LABELS
from kvpilot.operator.builders.common import HTTP_PORT_NAME, object_meta, owner_reference, selector_labels
from kvpilot.slo.rules import prometheus_rule_for

SCRAPE_INTERVAL = "15s"


def build_service_monitor(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": object_meta(isvc),
        "spec": {
            "selector": {"matchLabels": selector_labels(isvc)},
            "namespaceSelector": {"matchNames": [isvc.metadata.namespace]},
            "podTargetLabels": list(SERIES_POD_LABELS),
            "endpoints": [{"port": HTTP_PORT_NAME, "path": "/metrics", "interval": SCRAPE_INTERVAL}],
        },
    }


def build_prometheus_rule(isvc: InferenceService) -> dict[str, Any]:
    """The SLO rules from kvpilot.slo, owned by the InferenceService."""
    rule = prometheus_rule_for(isvc)
    rule["metadata"]["ownerReferences"] = [owner_reference(isvc)]
    return rule
