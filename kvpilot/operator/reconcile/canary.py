"""The reconcile's canary step (`reconcile_canary`, builders.canary) and the status it says it in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import ANNOTATION_CANARY
from kvpilot.operator.apply import ensure, ensure_absent
from kvpilot.operator.builders.canary import (
    REASON_INVALID_CANARY,
    CanaryRequest,
    InvalidCanary,
    build_canary_deployment,
    canary_condition,
    canary_ref,
    canary_status,
    parse_canary,
)
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.status import now_rfc3339
from kvpilot.operator.reconcile.runtime import Emit, Logger, Runtime


@dataclass(frozen=True, slots=True)
class CanaryView:
    """What a reconcile found of the canary: asked for or not, the trial, its Deployment as applied,
    and why the annotation was refused (then no canary runs)."""

    asked: bool
    trial: int | None = None
    deployment: dict[str, Any] | None = None
    invalid: str | None = None
    problem: tuple[str, str] | None = None


def with_canary(status: dict[str, Any], fresh: dict[str, Any], canary: CanaryView,
                generation: int | None) -> dict[str, Any]:
    """`status` (the keys the operator owns) with status.canary and the Canary condition from `canary`;
    the conditions as given (from `fresh` where `status` has none)."""
    value = None
    if canary.asked:
        value = canary_status(trial=canary.trial, deployment=canary.deployment, previous=fresh.get("canary"),
                              problem=canary.problem, invalid=canary.invalid)
    conditions = status.get("conditions", fresh.get("conditions"))
    return {**status, "canary": value, "conditions": canary_condition(conditions, value, generation, now_rfc3339())}


async def reconcile_canary(rt: Runtime, isvc: InferenceService, previous: dict[str, Any], options: RenderOptions,
                            new_object: bool, emit: Emit, logger: Logger) -> CanaryView:
    """Create or patch `<name>-canary` while the kvpilot.dev/canary annotation asks for one; delete
    it otherwise (level-triggered: a restarted operator resumes or cleans up from the annotation)."""
    view, planned = _asked(isvc, previous, options, emit, logger)
    if planned is None:
        if not new_object:
            await _remove(rt, isvc, view, emit, logger)
        return view
    request, manifest = planned
    applied = await ensure(rt.client, manifest, likely_absent=new_object)
    if applied.action == "created":
        emit("Normal", "Created", f"Created Deployment {applied.name} (canary of trial {request.trial}; "
             f"it takes one replica's resources beyond spec.replicas)")
        logger.info("created canary %s of trial %d", applied.name, request.trial)
    elif applied.action == "updated":
        emit("Normal", "Updated", f"Updated Deployment {applied.name} (canary of trial {request.trial})")
    return CanaryView(asked=True, trial=request.trial, deployment=applied.live)


def _asked(isvc: InferenceService, previous: dict[str, Any], options: RenderOptions, emit: Emit,
           logger: Logger) -> tuple[CanaryView, tuple[CanaryRequest, dict[str, Any]] | None]:
    """What the annotation asks for, and the canary to apply (None: none asked for, or the annotation refused)."""
    try:
        request = parse_canary(isvc.metadata.annotations)
        if request is None:
            return CanaryView(asked=False), None
        return CanaryView(asked=True), (request, build_canary_deployment(isvc, request, options))
    except InvalidCanary as exc:
        told = previous.get("canary") or {}
        if told.get("reason") != REASON_INVALID_CANARY or told.get("message") != str(exc):
            emit("Warning", REASON_INVALID_CANARY, f"{exc}; no canary runs")
        logger.warning("invalid canary annotation, no canary: %s", exc)
        return CanaryView(asked=True, trial=exc.trial, invalid=str(exc)), None


async def _remove(rt: Runtime, isvc: InferenceService, view: CanaryView, emit: Emit, logger: Logger) -> None:
    """Delete the canary Deployment no annotation (or no valid one) asks for."""
    removed = await ensure_absent(rt.client, canary_ref(isvc))
    if removed is not None:
        why = "its annotation is not valid" if view.asked else f"the {ANNOTATION_CANARY} annotation is gone"
        emit("Normal", "Deleted", f"Deleted Deployment {removed.name} (canary: {why})")
        logger.info("deleted canary %s", removed.name)
