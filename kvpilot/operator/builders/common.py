"""Names, labels and owner references every child of an InferenceService shares."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot import __version__
from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_ENGINE,
    API_VERSION,
    KIND,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
)
from kvpilot.api.vocabulary import LABEL_INFERENCESERVICE as LABEL_ISVC

__all__ = ["ANNOTATION_CONFIG_HASH", "ANNOTATION_ENGINE", "LABEL_COMPONENT", "LABEL_INSTANCE", "LABEL_ISVC",
           "LABEL_MANAGED_BY", "LABEL_NAME", "MANAGED_BY"]

HTTP_PORT = 8000
HTTP_PORT_NAME = "http"

# The chart's image (repository and appVersion): the operator's own release runs the twin.
DEFAULT_TWIN_IMAGE = f"ghcr.io/kvpilot/kvpilot:{__version__}"


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """What the builders need to know besides the InferenceService itself."""

    twin_image: str = DEFAULT_TWIN_IMAGE
    # Whether the cluster serves the Prometheus Operator's CRDs (found by discovery).
    service_monitors: bool = True
    pod_monitors: bool = True
    prometheus_rules: bool = True
    # A numeric uid to run vLLM containers as (OperatorSettings.engine_run_as_user); None: the image's user.
    engine_run_as_user: int | None = None
    # Labels for the ServiceMonitor, PodMonitor and PrometheusRule of every InferenceService, so that a
    # Prometheus selecting on labels (kube-prometheus-stack: release=<its release>) picks them up; kvpilot's
    # own labels win over these (OperatorSettings.monitor_labels).
    monitor_labels: tuple[tuple[str, str], ...] = ()


def app_name(isvc: InferenceService) -> str:
    return "vllm" if isvc.spec.engine.kind == "vllm" else "kvpilot-twin"


def selector_labels(isvc: InferenceService) -> dict[str, str]:
    """The immutable Deployment selector: one InferenceService's pods, whatever engine they run."""
    return {LABEL_ISVC: isvc.metadata.name}


def common_labels(isvc: InferenceService) -> dict[str, str]:
    return {
        LABEL_NAME: app_name(isvc),
        LABEL_INSTANCE: isvc.metadata.name,
        LABEL_COMPONENT: "inference-engine",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_ISVC: isvc.metadata.name,
    }


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    """controller + blockOwnerDeletion: the garbage collector removes children with their owner."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": isvc.metadata.name,
        "uid": isvc.metadata.uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(isvc: InferenceService, name: str | None = None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name or isvc.metadata.name,
        "namespace": isvc.metadata.namespace,
        "labels": common_labels(isvc),
        "ownerReferences": [owner_reference(isvc)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def canonical_json(value: Any) -> str:
    """Stable text for hashing and annotations: sorted keys, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
