"""InferenceService objects for the operator's unit tests."""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.api.models import InferenceService

BASE: dict[str, Any] = {
    "apiVersion": "kvpilot.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llama", "namespace": "serving", "uid": "0b7c5a4e-1111-2222-3333-444455556666",
                 "generation": 1},
    "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2},
}


def isvc_dict(**spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(BASE)
    for key, value in spec.items():
        obj["spec"][key] = value
    return obj


def isvc(**spec: Any) -> InferenceService:
    return InferenceService.model_validate(isvc_dict(**spec))
