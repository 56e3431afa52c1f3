"""The canary track's events: its Deployment changed (`track_canary`) or is gone (`canary_deleted`),
its pod failed or cannot be scheduled (`track_canary_pod`); status.canary says so, the stable track
is left alone."""

from __future__ import annotations

from typing import Any

import kopf

from kvpilot.api.vocabulary import ANNOTATION_TUNING_TRIAL, CANARY_SUFFIX
from kvpilot.operator.builders.canary import (
    CAPACITY_NOTE,
    REASON_UNSCHEDULABLE,
    CanaryRequest,
    InvalidCanary,
    parse_canary,
    unschedulable,
)
from kvpilot.operator.builders.common import LABEL_ISVC
from kvpilot.operator.builders.pods import EngineFailure, engine_failure, pod_config_hash
from kvpilot.operator.builders.status import rollout_of
from kvpilot.operator.kube import ApiError, resource_path
from kvpilot.operator.reconcile.canary import CanaryView, with_canary
from kvpilot.operator.reconcile.common import with_log
from kvpilot.operator.reconcile.runtime import EmitOn, Logger, Runtime
from kvpilot.operator.reconcile.service import reconcile_service
from kvpilot.operator.reconcile.status import isvc_path, update_status
from kvpilot.operator.reconcile.tracking import owns


def _parent_canary(parent: dict[str, Any]) -> CanaryRequest | None:
    """The canary the parent's annotation asks for (None if none, or a malformed one: the reconcile says so)."""
    try:
        return parse_canary((parent.get("metadata") or {}).get("annotations"))
    except InvalidCanary:
        return None


def _trial_of(obj: dict[str, Any]) -> int | None:
    value = ((obj.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TUNING_TRIAL)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


async def track_canary(rt: Runtime, deployment: dict[str, Any], logger: Logger) -> None:
    """A canary Deployment changed: status.canary and the Canary condition follow it."""
    meta = deployment.get("metadata", {})
    name, namespace = (meta.get("labels") or {}).get(LABEL_ISVC), meta.get("namespace")
    if not name or not namespace:
        return
    async with rt.lock_for(namespace, name):
        try:
            await _update_canary(rt, namespace, name, deployment, None, logger)
        except ApiError as exc:  # the next event (or reconcile) writes it
            logger.warning("canary status of %s/%s not written: %s", namespace, name, exc)


async def _update_canary(rt: Runtime, namespace: str, name: str, deployment: dict[str, Any],
                         problem: tuple[str, str] | None, logger: Logger,
                         parent: dict[str, Any] | None = None) -> bool:
    """Write status.canary from the canary Deployment (and a pod's problem); False when the parent does
    not (or no longer) ask for this Deployment's trial."""
    parent = parent or await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        return False
    request = _parent_canary(parent)
    if not owns(parent, deployment) or request is None or _trial_of(deployment) != request.trial:
        return False  # not ours, or a trial the reconcile is replacing or removing
    generation = (parent.get("status") or {}).get("observedGeneration")
    view = CanaryView(asked=True, trial=request.trial, deployment=deployment, problem=problem)

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return with_canary({}, fresh, view, generation)

    await update_status(rt, namespace, name, compute, parent=parent)
    return True


async def canary_deleted(rt: Runtime, deployment: dict[str, Any],
                         emit_on: EmitOn, logger: Logger) -> None:
    """A canary Deployment is gone: if its InferenceService still asks for a canary (someone deleted
    it by hand), reconcile, which makes it again.  Deleted by the reconcile itself (the annotation
    removed) or with its owner, there is nothing to do."""
    meta = deployment.get("metadata", {})
    name, namespace = (meta.get("labels") or {}).get(LABEL_ISVC), meta.get("namespace")
    if not name or not namespace:
        return
    try:
        parent = await rt.client.get_or_none(isvc_path(namespace, name))
        if parent is None or _parent_canary(parent) is None:
            return  # not asked for (or malformed: the reconcile that deleted it said so)
        logger.info("canary %s of %s/%s deleted while still asked for: making it again", meta.get("name"),
                    namespace, name)
        await reconcile_service(rt, parent, lambda type_, reason, message: emit_on(parent, type_, reason, message),
                                logger)
    except (ApiError, kopf.TemporaryError) as exc:  # the next change of the object (or a restart) makes it
        logger.warning("canary of %s/%s not made again: %s", namespace, name, exc)


async def track_canary_pod(rt: Runtime, pod: dict[str, Any], emit_on: EmitOn,
                           logger: Logger) -> None:
    """A canary pod changed: its engine failed (vLLM's start-up failure, a crash loop) or it cannot be
    scheduled -> a Warning Event and status.canary say so, in vLLM's words; the stable track is left
    alone.  A pod scheduled after all clears Unschedulable."""
    failure = engine_failure(pod, crash_loop_restarts=rt.settings.crash_loop_restarts)
    pending = unschedulable(pod) if failure is None else None
    if failure is None and pending is None and not _scheduled_not_ready(pod):
        return
    meta = pod.get("metadata", {})
    name, namespace = (meta.get("labels") or {}).get(LABEL_ISVC), meta.get("namespace")
    if not name or not namespace:
        return
    async with rt.lock_for(namespace, name):
        try:
            await _track_canary_pod(rt, namespace, str(name), pod, failure, pending, emit_on, logger)
        except ApiError as exc:
            logger.warning("canary pod of %s/%s not handled yet: %s", namespace, name, exc)


def _scheduled_not_ready(pod: dict[str, Any]) -> bool:
    """Scheduled but not ready yet: the one time a pod event clears Unschedulable (once it is ready, the
    canary Deployment's own event says Ready)."""
    conditions = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return conditions.get("PodScheduled") == "True" and conditions.get("Ready") != "True"


async def _track_canary_pod(rt: Runtime, namespace: str, name: str, pod: dict[str, Any], failure: EngineFailure | None,
                            pending: str | None, emit_on: EmitOn,
                            logger: Logger) -> None:
    found = await _canary_of(rt, namespace, name, pod)
    if found is None:
        return
    deployment, parent = found
    told = (parent.get("status") or {}).get("canary") or {}
    trial = _trial_of(deployment)
    problem: tuple[str, str] | None = None
    if failure is not None or pending is not None:
        problem = await _problem(rt, namespace, pod, trial, failure, pending, logger)
    elif told.get("reason") != REASON_UNSCHEDULABLE:
        return  # scheduled, and nothing to clear
    else:
        parent = {**parent, "status": {**parent["status"], "canary": {**told, "reason": None}}}
    same = _told_already(told, problem, trial, deployment)
    if not await _update_canary(rt, namespace, name, deployment, problem, logger, parent=parent):
        return
    if problem is not None and not same:
        emit_on(parent, "Warning", problem[0], problem[1])
        logger.warning("canary of %s/%s: %s", namespace, name, problem[1])


async def _canary_of(rt: Runtime, namespace: str, name: str,
                     pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The canary Deployment this pod is of (as its template is now) and its InferenceService, or None."""
    deployment = await rt.client.get_or_none(resource_path("apps/v1", "deployments", namespace, f"{name}{CANARY_SUFFIX}"))
    if deployment is None or pod_config_hash(pod) != rollout_of(deployment).config_hash:
        return None  # a pod of a canary template already replaced
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        return None
    return deployment, parent


def _told_already(told: dict[str, Any], problem: tuple[str, str] | None, trial: int | None,
                  deployment: dict[str, Any]) -> bool:
    """status.canary says this problem already, of this trial and template (no second Event)."""
    return (told.get("reason") == (problem or ("",))[0] and told.get("trial") == trial
            and told.get("configHash") == rollout_of(deployment).config_hash)


async def _problem(rt: Runtime, namespace: str, pod: dict[str, Any], trial: int | None, failure: EngineFailure | None,
                   pending: str | None, logger: Logger) -> tuple[str, str]:
    """(reason, message) of a canary pod whose engine failed (in vLLM's words), or that cannot be scheduled."""
    if failure is not None:
        if failure.cause_above:
            failure = await with_log(rt, namespace, failure, logger)
        return (failure.reason, f"canary of trial {trial} failed: {failure.describe()}; "
                "the stable track is left as it is")
    pod_name = str(pod.get("metadata", {}).get("name", ""))
    return (REASON_UNSCHEDULABLE, f"canary pod {pod_name} of trial {trial} cannot be scheduled: {pending}; "
            f"{CAPACITY_NOTE}")
