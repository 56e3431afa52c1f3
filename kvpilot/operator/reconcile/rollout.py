"""A managed Deployment changed (`track_rollout`): its InferenceService's status follows it, and a
rollout past its progress deadline is rolled back to status.lastGoodEngine."""

from __future__ import annotations

from typing import Any, NoReturn

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.operator.apply import ensure
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, LABEL_ISVC
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.status import (
    DEGRADED,
    REASON_DEADLINE,
    REASON_IMAGE_NOT_ALLOWED,
    REASON_ROLLBACK_FAILED,
    REASON_ROLLED_BACK,
    desired_status,
    engine_info,
    find_condition,
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
)
from kvpilot.operator.reconcile.runtime import EmitOn, HandleAgain, Logger, Runtime
from kvpilot.operator.reconcile.status import (
    decision,
    engine_summary,
    failure_record,
    isvc_path,
    update_status,
)


async def track_rollout(rt: Runtime, deployment: dict[str, Any], emit_on: EmitOn,
                        logger: Logger) -> None:
    """Map a Deployment event to its InferenceService: status, lastGoodEngine, rollback.  When the
    API fails it through the client's retries, the same handling runs again later (kopf never runs a
    Deployment event handler again), from the Deployment as it is then."""
    meta = deployment.get("metadata", {})
    name = (meta.get("labels") or {}).get(LABEL_ISVC)
    namespace = meta.get("namespace")
    if not name or not namespace:
        return
    key = f"{namespace}/{name}"
    rt.cancel_event_retry(key)  # this event is newer than what a pending try would read
    try:
        async with rt.lock_for(namespace, name):
            await _track_rollout(rt, namespace, name, deployment, emit_on, logger)
    except HandleAgain as pending:
        delay = pending.delay
    except ApiError as exc:
        delay = rt.next_event_retry_delay(key, exc.retry_after)
        logger.warning("handling Deployment %s/%s failed: %s; handling it again in %.1fs",
                       namespace, meta.get("name"), exc, delay)
    else:
        rt.event_retry_attempts.pop(key, None)
        return
    path = resource_path("apps/v1", "deployments", namespace, str(meta.get("name")))

    async def again() -> None:
        try:
            fresh = await rt.client.get_or_none(path)
        except ApiError as exc:
            later = rt.next_event_retry_delay(key, exc.retry_after)
            logger.warning("reading Deployment %s/%s failed: %s; trying again in %.1fs",
                           namespace, meta.get("name"), exc, later)
            rt.handle_again(key, later, again, logger)
            return
        if fresh is None:
            return  # gone: its DELETED event does the rest
        await track_rollout(rt, fresh, emit_on, logger)

    rt.handle_again(key, delay, again, logger)


async def _track_rollout(rt: Runtime, namespace: str, name: str, deployment: dict[str, Any],
                         emit_on: EmitOn, logger: Logger) -> None:
    meta = deployment.get("metadata", {})
    key = f"{namespace}/{name}"
    version = meta.get("resourceVersion")
    if version is not None and rt.status_basis.get(key) == str(version):
        return  # the status was computed from exactly this Deployment
    rt.status_basis.pop(key, None)
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        rt.forget(namespace, name)
        return  # deleted; the garbage collector takes the children
    owner_uids = {ref.get("uid") for ref in meta.get("ownerReferences") or [] if ref.get("controller")}
    if parent.get("metadata", {}).get("uid") not in owner_uids:
        return
    previous = dict(parent.get("status") or {})
    # The generation the service handler last reconciled: a Deployment event must never claim a
    # newer spec is in force before that handler has rendered it.
    generation = previous.get("observedGeneration")
    if generation is None or validate_object({k: v for k, v in parent.items() if k != "status"}):
        return

    if refused_in_force(rt, parent, previous, generation):
        return

    rollout = rollout_of(deployment)
    degraded: tuple[str, str] | None = None
    last_failure: dict[str, Any] | None = None
    last_good = usable_last_good(previous, logger)
    if rollout.deadline_exceeded and rollout.engine is not None:
        refusal = image_refusal(rt, EngineSpec.model_validate(last_good), "status.lastGoodEngine.image") \
            if last_good else None
        if refusal is not None:
            # The allowlist changed since that engine ran: putting it back would run a refused image.
            degraded = (REASON_IMAGE_NOT_ALLOWED, f"rollout of configHash {rollout.config_hash} did not progress "
                        f"and lastGoodEngine is not put back: {refusal}")
            old = find_condition(previous.get("conditions"), DEGRADED) or {}
            if old.get("reason") != REASON_IMAGE_NOT_ALLOWED:
                emit_on(parent, "Warning", REASON_IMAGE_NOT_ALLOWED, degraded[1])
        elif last_good and last_good != rollout.engine:
            isvc = InferenceService.model_validate({k: v for k, v in parent.items() if k != "status"})
            options = render_options(rt.settings, await rt.discovery.served())
            restored = build_deployment(isvc, options, EngineSpec.model_validate(last_good))
            failed = (f"rollout of configHash {rollout.config_hash} ({engine_summary(rollout.engine, last_good)}) "
                      f"did not progress: {rollout.message or REASON_DEADLINE}")
            restored_hash = restored["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
            message = (f"{failed}; put lastGoodEngine back (configHash {restored_hash}); "
                       f"a new spec generation tries again")
            last_failure = failure_record(REASON_DEADLINE, rollout.message or REASON_DEADLINE, rollout.config_hash,
                                         generation)
            if not rolled_back_at(previous, generation):
                # NOTE: the decision first, then the patch: an operator stopped between the two would
                # otherwise, restarted, render the failed engine again, since nothing in the status would
                # say this generation failed.  The write after the patch completes it.
                await update_status(rt, namespace, name,
                                    decision(REASON_ROLLED_BACK, message, generation, last_failure), parent=parent)
                parent = await rt.client.get_or_none(isvc_path(namespace, name))
                if parent is None:
                    return
            try:
                applied = await ensure(rt.client, restored)
            except ApiError as exc:
                await _rollback_failed(rt, namespace, name, parent, generation, deployment, emit_on, logger,
                                       f"{failed}; putting lastGoodEngine back (configHash {restored_hash}) failed: "
                                       f"{exc}", exc)
            deployment = applied.live or deployment
            degraded = (REASON_ROLLED_BACK, message)
            rt.metrics.rollbacks.inc()
            emit_on(parent, "Warning", REASON_ROLLED_BACK, message)
            logger.warning("rolled back %s/%s: %s", namespace, name, message)
        elif not last_good and not engine_failure_said(previous, generation):
            degraded = (REASON_DEADLINE, f"rollout of configHash {rollout.config_hash} did not progress: "
                        f"{rollout.message or REASON_DEADLINE}; no lastGoodEngine to roll back to")
            old = find_condition(previous.get("conditions"), DEGRADED) or {}
            if old.get("reason") != REASON_DEADLINE:
                emit_on(parent, "Warning", REASON_DEADLINE, degraded[1])
                last_failure = failure_record(REASON_DEADLINE, rollout.message or REASON_DEADLINE,
                                             rollout.config_hash, generation)
    rt.metrics.set_engine(namespace, name, engine_info(rollout_of(deployment)))

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return desired_status(generation=generation, previous=fresh, deployment=deployment, degraded=degraded,
                              last_failure=last_failure)

    # A failure here (the API kept failing through the retries) is handled again by track_rollout:
    # this may be the last event the Deployment sends (its rollout completed).
    await update_status(rt, namespace, name, compute, parent=parent)
    version = (deployment.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        rt.status_basis[key] = str(version)


async def _rollback_failed(rt: Runtime, namespace: str, name: str, parent: dict[str, Any], generation: int,
                           deployment: dict[str, Any], emit_on: EmitOn,
                           logger: Logger, what: str, exc: ApiError) -> NoReturn:
    """Say that the rollback is pending (Degraded RollbackFailed, and Ready/Progressing from the
    Deployment that did not progress; an Event the first time) and raise HandleAgain: the Deployment
    is read and the rollback tried again after the delay."""
    key = f"{namespace}/{name}"
    delay = rt.next_event_retry_delay(key, exc.retry_after)
    attempts = rt.event_retry_attempts[key]
    message = f"{what}; trying again in {delay:.0f}s (failed attempts: {attempts})"
    logger.warning("rollback of %s/%s failed: %s", namespace, name, message)
    old = find_condition((parent.get("status") or {}).get("conditions"), DEGRADED) or {}
    if old.get("reason") != REASON_ROLLBACK_FAILED:
        emit_on(parent, "Warning", REASON_ROLLBACK_FAILED, message)
    try:
        await update_status(rt, namespace, name, lambda fresh: desired_status(
            generation=generation, previous=fresh, deployment=deployment, degraded=(REASON_ROLLBACK_FAILED, message)),
            parent=parent)
    except ApiError as status_exc:  # the API is failing: the next try writes it
        logger.warning("status of %s/%s not written: %s", namespace, name, status_exc)
    raise HandleAgain(delay) from exc
