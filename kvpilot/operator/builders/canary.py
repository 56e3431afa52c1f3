"""The canary track: a trial engine on a one-replica Deployment beside the stable one.

`parse_canary` reads the InferenceService annotation `kvpilot.dev/canary`; `build_canary_deployment`
renders the Deployment with the stable pod template.
Pure: no client, no I/O.  Why the two tracks never adopt each other's pods: docs/architecture.md,
"The canary track".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvpilot.api.conditions import set_condition
from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.tuned import TUNED
from kvpilot.api.vocabulary import (
    ANNOTATION_CANARY,
    ANNOTATION_TUNING_TRIAL,
    CANARY_SUFFIX,
    LABEL_TRACK,
    TRACK_CANARY,
    TUNED_ENGINE_FIELDS,
    CanaryPhase,
    ConditionType,
    Reason,
)
from kvpilot.operator.builders.common import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_ENGINE,
    RenderOptions,
    canonical_json,
    object_meta,
    selector_labels,
)
from kvpilot.operator.builders.deployment import REVISION_HISTORY_LIMIT, config_hash, pod_template
from kvpilot.operator.builders.status import ENGINE_FAILURE_REASONS, REASON_DEADLINE, rollout_of

CANARY = ConditionType.CANARY.value
REASON_INVALID_CANARY = Reason.INVALID_CANARY.value
REASON_UNSCHEDULABLE = Reason.UNSCHEDULABLE.value
REASON_CANARY_READY = Reason.CANARY_READY.value
REASON_CANARY_PROGRESSING = Reason.CANARY_PROGRESSING.value

# The JSON type each tuned field must have in the annotation (an int is a float too; a bool is neither).
_FIELD_TYPES: dict[str, type] = {f.name: f.type for f in TUNED}

CAPACITY_NOTE = ("a canary needs one replica's resources beyond the stable replicas (like maxSurge 1): "
                 "free them, or use spec.tuning.trialStrategy: rolling")


class InvalidCanary(ValueError):
    """The kvpilot.dev/canary annotation is not what the contract says; `trial` where it was readable."""

    def __init__(self, message: str, trial: int | None = None) -> None:
        super().__init__(message)
        self.trial = trial


@dataclass(frozen=True, slots=True)
class CanaryRequest:
    trial: int
    engine: dict[str, int | float]  # camelCase tuned fields, as in spec.engine


def canary_name(isvc: InferenceService) -> str:
    return f"{isvc.metadata.name}{CANARY_SUFFIX}"


def canary_selector(isvc: InferenceService) -> dict[str, str]:
    return {**selector_labels(isvc), LABEL_TRACK: TRACK_CANARY}


def parse_canary(annotations: dict[str, str] | None) -> CanaryRequest | None:
    """The canary the annotation asks for; None without the annotation; InvalidCanary if malformed."""
    text = (annotations or {}).get(ANNOTATION_CANARY)
    if text is None:
        return None
    where = f"annotation {ANNOTATION_CANARY}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidCanary(f"{where} is not JSON ({exc}); expected "
                            '{"trial": <int>, "engine": {<the tuned fields>}}') from None
    if not isinstance(value, dict):
        raise InvalidCanary(f"{where} must be a JSON object with trial and engine, got {text[:80]!r}")
    trial = value.get("trial")
    if isinstance(trial, bool) or not isinstance(trial, int) or trial < 0:
        raise InvalidCanary(f"{where}: trial must be a non-negative integer, got {trial!r}")
    extra = sorted(set(value) - {"trial", "engine"})
    if extra:
        raise InvalidCanary(f"{where}: unknown keys {', '.join(extra)}; allowed: trial, engine", trial)
    engine = value.get("engine")
    if not isinstance(engine, dict):
        raise InvalidCanary(f"{where}: engine must be an object of {', '.join(TUNED_ENGINE_FIELDS)}, "
                            f"got {engine!r}", trial)
    unknown = sorted(set(engine) - set(TUNED_ENGINE_FIELDS))
    if unknown:
        raise InvalidCanary(f"{where}: engine.{unknown[0]} is not a tuned field; allowed: "
                            f"{', '.join(TUNED_ENGINE_FIELDS)} (everything else comes from spec.engine)", trial)
    missing = [f for f in TUNED_ENGINE_FIELDS if f not in engine]
    if missing:
        raise InvalidCanary(f"{where}: engine.{missing[0]} is missing; all of {', '.join(TUNED_ENGINE_FIELDS)} "
                            "are required", trial)
    fields: dict[str, int | float] = {}
    for name, kind in _FIELD_TYPES.items():
        item = engine[name]
        ok = not isinstance(item, bool) and (isinstance(item, int) if kind is int else isinstance(item, int | float))
        if not ok or (isinstance(item, float) and not math.isfinite(item)):
            raise InvalidCanary(f"{where}: engine.{name} must be {'an integer' if kind is int else 'a number'}, "
                                f"got {item!r}", trial)
        fields[name] = float(item) if kind is float else int(item)
    return CanaryRequest(trial, fields)


def canary_engine(isvc: InferenceService, request: CanaryRequest) -> EngineSpec:
    """spec.engine with the tuned fields the canary asks for (InvalidCanary if the result is no valid engine)."""
    try:
        return EngineSpec.model_validate({**isvc.spec.engine.to_wire(), **request.engine})
    except ValidationError as exc:
        issues = "; ".join(f"engine.{'.'.join(str(p) for p in e['loc']) or '(engine)'}: {e['msg']}"
                           for e in exc.errors())
        raise InvalidCanary(f"annotation {ANNOTATION_CANARY} of trial {request.trial} makes no valid engine "
                            f"with spec.engine: {issues}", request.trial) from None


def build_canary_deployment(isvc: InferenceService, request: CanaryRequest, options: RenderOptions | None = None,
                            engine: EngineSpec | None = None) -> dict[str, Any]:
    """The one-replica canary Deployment running the trial's engine (InvalidCanary if it makes none)."""
    options = options or RenderOptions()
    engine = engine or canary_engine(isvc, request)
    template = pod_template(isvc, options, engine, track=TRACK_CANARY)
    digest = config_hash(template)
    template["metadata"]["annotations"] = {ANNOTATION_CONFIG_HASH: digest}
    meta = object_meta(isvc, name=canary_name(isvc), annotations={
        ANNOTATION_CONFIG_HASH: digest,
        ANNOTATION_ENGINE: canonical_json(engine.to_wire()),
        ANNOTATION_TUNING_TRIAL: str(request.trial),
    })
    meta["labels"] = dict(template["metadata"]["labels"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": canary_selector(isvc)},
            "strategy": {"type": "Recreate"},
            "progressDeadlineSeconds": isvc.spec.rollout.progress_deadline_seconds,
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "template": template,
        },
    }


def canary_ref(isvc: InferenceService) -> dict[str, Any]:
    """Enough of the canary Deployment to find it and check it is ours (for its deletion)."""
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": object_meta(isvc, name=canary_name(isvc))}


def is_canary(obj: dict[str, Any]) -> bool:
    """A canary Deployment or pod, by its track label."""
    return ((obj.get("metadata") or {}).get("labels") or {}).get(LABEL_TRACK) == TRACK_CANARY


def unschedulable(pod: dict[str, Any]) -> str | None:
    """The scheduler's message when the pod cannot be placed (PodScheduled False, reason Unschedulable)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                and cond.get("reason") == REASON_UNSCHEDULABLE:
            return str(cond.get("message") or REASON_UNSCHEDULABLE)
    return None


def canary_status(*, trial: int | None, deployment: dict[str, Any] | None, previous: dict[str, Any] | None,
                  problem: tuple[str, str] | None = None, invalid: str | None = None) -> dict[str, Any]:
    """status.canary for a canary asked for: from its Deployment as it is now, and `problem` (reason,
    message) a canary pod just showed (an engine failure or Unschedulable).  A canary Deployment past
    its progress deadline (never ready, e.g. never scheduled) is Failed with ProgressDeadlineExceeded.  An engine failure stays
    (as Failed) for the same template until its pod is ready after all; `invalid` (the annotation's
    fault) is Failed with InvalidCanary and no Deployment."""
    if invalid is not None:
        return {"trial": trial, "phase": CanaryPhase.FAILED.value, "reason": REASON_INVALID_CANARY,
                "readyReplicas": 0, "configHash": None, "message": invalid}
    rollout = rollout_of(deployment)
    previous = previous or {}
    base = {"trial": trial, "readyReplicas": rollout.ready, "configHash": rollout.config_hash}
    same = previous.get("trial") == trial and previous.get("configHash") == rollout.config_hash
    if rollout.exists and rollout.complete:
        return {**base, "phase": CanaryPhase.READY.value, "reason": REASON_CANARY_READY,
                "message": f"canary of trial {trial} ready (configHash {rollout.config_hash})"}
    if problem is None and same and previous.get("reason") in (*ENGINE_FAILURE_REASONS, REASON_UNSCHEDULABLE):
        problem = (str(previous["reason"]), str(previous.get("message") or ""))
    if rollout.deadline_exceeded and (problem is None or problem[0] == REASON_UNSCHEDULABLE):
        why = problem[1] if problem is not None else (rollout.message or REASON_DEADLINE)
        return {**base, "phase": CanaryPhase.FAILED.value, "reason": REASON_DEADLINE,
                "message": f"canary of trial {trial} not ready within its progress deadline: {why}"}
    if problem is not None:
        reason, message = problem
        phase = CanaryPhase.PROGRESSING if reason == REASON_UNSCHEDULABLE else CanaryPhase.FAILED
        return {**base, "phase": phase.value, "reason": reason, "message": message}
    if not rollout.exists:
        return {**base, "phase": CanaryPhase.PROGRESSING.value, "reason": REASON_CANARY_PROGRESSING,
                "message": f"creating the canary Deployment of trial {trial}"}
    return {**base, "phase": CanaryPhase.PROGRESSING.value, "reason": REASON_CANARY_PROGRESSING,
            "message": f"waiting for the canary pod of trial {trial}: {rollout.ready}/1 ready"}


def canary_condition(conditions: list[dict[str, Any]] | None, canary: dict[str, Any] | None,
                     generation: int | None, now: str) -> list[dict[str, Any]]:
    """The conditions with Canary set from status.canary (removed when there is no canary)."""
    if canary is None:
        return [dict(c) for c in conditions or [] if c.get("type") != CANARY]
    ready = canary.get("phase") == CanaryPhase.READY.value
    return set_condition(conditions, CANARY, "True" if ready else "False", str(canary.get("reason") or ""),
                         str(canary.get("message") or ""), generation, now)
