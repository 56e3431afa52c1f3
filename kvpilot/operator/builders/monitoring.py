"""Prometheus Operator objects: a ServiceMonitor scraping vLLM's /metrics, and the SLO PrometheusRule."""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import InferenceService
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
            "endpoints": [{"port": HTTP_PORT_NAME, "path": "/metrics", "interval": SCRAPE_INTERVAL}],
        },
    }


def build_prometheus_rule(isvc: InferenceService) -> dict[str, Any]:
    """The SLO rules from kvpilot.slo, owned by the InferenceService."""
    rule = prometheus_rule_for(isvc)
    rule["metadata"]["ownerReferences"] = [owner_reference(isvc)]
    return rule
