"""The Service in front of the engine pods, and the PodDisruptionBudget that keeps them serving."""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import InferenceService
from kvpilot.operator.builders.common import HTTP_PORT, HTTP_PORT_NAME, object_meta, selector_labels


def build_service(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(isvc),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(isvc),
            "ports": [{"name": HTTP_PORT_NAME, "port": HTTP_PORT, "targetPort": HTTP_PORT_NAME,
                       "protocol": "TCP"}],
        },
    }


def wants_pdb(isvc: InferenceService) -> bool:
    # With one replica a PDB of maxUnavailable 1 protects nothing, and 0 would block node drains.
    return isvc.spec.replicas > 1


def build_pdb(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(isvc),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(isvc)}},
    }
