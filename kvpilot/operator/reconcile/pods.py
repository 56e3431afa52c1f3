"""An engine pod changed (`track_pod`): a new revision whose engine failed (vLLM could not start, or it
crash-loops) is rolled back to status.lastGoodEngine at once, not at the progress deadline."""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.operator.apply import ensure
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, LABEL_ISVC
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.pods import EngineFailure, engine_failure
from kvpilot.operator.builders.status import (
    REASON_IMAGE_NOT_ALLOWED,
    REASON_ROLLED_BACK,
    desired_status,
    engine_info,
    rolled_back_at,
    rollout_of,
)
from kvpilot.operator.kube import ApiError, resource_path
from kvpilot.operator.reconcile.common import (
    engine_failure_said,
    image_refusal,
    refused_in_force,
    render_options,
    usable_last_good,
    with_log,
)
from kvpilot.operator.reconcile.runtime import EmitOn, Logger, Runtime
from kvpilot.operator.reconcile.status import (
    decision,
    engine_summary,
    failure_record,
    isvc_path,
    update_status,
)


async def _restore_last_good(rt: Runtime, parent: dict[str, Any],
                             last_good: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Put the Deployment back on `last_good`: the Deployment as applied, and its config hash."""
    isvc = InferenceService.model_validate({k: v for k, v in parent.items() if k != "status"})
    options = render_options(rt.settings, await rt.discovery.served())
    restored = build_deployment(isvc, options, EngineSpec.model_validate(last_good))
    applied = await ensure(rt.client, restored)
    return applied.live, str(restored["metadata"]["annotations"][ANNOTATION_CONFIG_HASH])



async def track_pod(rt: Runtime, pod: dict[str, Any], emit_on: EmitOn,
                    logger: Logger) -> None:
    """An engine pod changed: if it shows its engine failed, handle that for its InferenceService."""
    failure = engine_failure(pod, crash_loop_restarts=rt.settings.crash_loop_restarts)
    if failure is None:
        return  # most pod events: no API call at all
    meta = pod.get("metadata", {})
    name = (meta.get("labels") or {}).get(LABEL_ISVC)
    namespace = meta.get("namespace")
    if not name or not namespace:
        return
    async with rt.lock_for(namespace, name):
        try:
            await _track_pod(rt, namespace, name, failure, emit_on, logger)
        except ApiError as exc:
            # The API kept failing through the client's retries; the pod's next status change (its
            # next restart) brings the failure here again.
            logger.warning("engine failure of %s/%s not handled yet: %s", namespace, name, exc)



def _already_told(previous: dict[str, Any], generation: int, config_hash: str | None) -> bool:
    """This generation was rolled back already, or its engine failure is on the status already."""
    if rolled_back_at(previous, generation):
        return True
    told = previous.get("lastFailure") or {}
    return engine_failure_said(previous, generation) and told.get("configHash") == config_hash


async def _track_pod(rt: Runtime, namespace: str, name: str, failure: EngineFailure,
                     emit_on: EmitOn, logger: Logger) -> None:
    deployment = await rt.client.get_or_none(resource_path("apps/v1", "deployments", namespace, name))
    if deployment is None:
        return
    rollout = rollout_of(deployment)
    if failure.config_hash is None or failure.config_hash != rollout.config_hash or rollout.complete:
        # A pod of another revision (the one rolled back from, or the old one going away), or of a
        # rollout that completed (its engine is lastGoodEngine itself: nothing to go back to).
        return
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        return
    owners = {ref.get("uid") for ref in deployment.get("metadata", {}).get("ownerReferences") or []
              if ref.get("controller")}
    if parent.get("metadata", {}).get("uid") not in owners:
        return
    previous = dict(parent.get("status") or {})
    generation = previous.get("observedGeneration")
    if generation is None or validate_object({k: v for k, v in parent.items() if k != "status"}):
        return
    last_good = usable_last_good(previous, logger)
    # The rollback was decided (its status written) but its patch did not hold: this pod of the failed
    # revision, still rendered, brings it here again to complete it.
    pending = rolled_back_at(previous, generation) and bool(last_good) and last_good != rollout.engine
    if (_already_told(previous, generation, failure.config_hash) and not pending) \
            or refused_in_force(rt, parent, previous, generation):
        return
    if failure.cause_above:
        failure = await with_log(rt, namespace, failure, logger)
    described = failure.describe()
    last_failure = failure_record(failure.reason, described, failure.config_hash, generation, failure.pod)
    refusal = image_refusal(rt, EngineSpec.model_validate(last_good), "status.lastGoodEngine.image") \
        if last_good else None
    if refusal is not None:
        # The allowlist changed since that engine ran: putting it back would run a refused image.
        message = (f"engine of configHash {rollout.config_hash} failed: {described}; "
                   f"lastGoodEngine is not put back: {refusal}")
        degraded = (REASON_IMAGE_NOT_ALLOWED, message)
        emit_on(parent, "Warning", REASON_IMAGE_NOT_ALLOWED, message)
        logger.warning("engine of %s/%s failed: %s", namespace, name, message)
    elif last_good and last_good != rollout.engine:
        failed = f"rollout of configHash {rollout.config_hash} ({engine_summary(rollout.engine, last_good)}) failed"
        if not pending:
            # The decision first, as at the progress deadline: an operator stopped (or an API failing)
            # between it and the patch leaves a status that says this generation is given up, so the
            # next reconcile renders lastGoodEngine, and the next event of this pod completes the patch.
            await update_status(rt, namespace, name, decision(
                REASON_ROLLED_BACK, f"{failed}: {described}; putting lastGoodEngine back; a new spec generation "
                "tries again", generation, last_failure), parent=parent)
            parent = await rt.client.get_or_none(isvc_path(namespace, name))
            if parent is None:
                return
        live, restored_hash = await _restore_last_good(rt, parent, last_good)
        deployment = live or deployment
        message = (f"{failed}: {described}; put lastGoodEngine back (configHash {restored_hash}); "
                   f"a new spec generation tries again")
        degraded = (REASON_ROLLED_BACK, message)
        rt.metrics.rollbacks.inc()
        emit_on(parent, "Warning", REASON_ROLLED_BACK, message)
        logger.warning("rolled back %s/%s: %s", namespace, name, message)
    else:
        why = ("no lastGoodEngine to roll back to" if not last_good
               else "its engine is lastGoodEngine (what changed is outside spec.engine): nothing to roll back to")
        message = f"engine of configHash {rollout.config_hash} failed: {described}; {why}"
        degraded = (failure.reason, message)
        emit_on(parent, "Warning", failure.reason, message)
        logger.warning("engine of %s/%s failed: %s", namespace, name, message)
    rt.metrics.set_engine(namespace, name, engine_info(rollout_of(deployment)))

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return desired_status(generation=generation, previous=fresh, deployment=deployment, degraded=degraded,
                              last_failure=last_failure)

    try:
        await update_status(rt, namespace, name, compute, parent=parent)
    except ApiError as exc:
        logger.warning("status of %s/%s not written: %s", namespace, name, exc)
        return
    version = (deployment.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        rt.status_basis[f"{namespace}/{name}"] = str(version)
