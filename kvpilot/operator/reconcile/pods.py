"""An engine pod changed (`track_pod`): a new revision whose engine failed (vLLM could not start, or it
crash-loops) is rolled back to status.lastGoodEngine at once, not at the progress deadline."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.apply import ensure
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, LABEL_ISVC
from kvpilot.operator.builders.pods import EngineFailure, engine_failure
from kvpilot.operator.builders.status import (
    REASON_IMAGE_NOT_ALLOWED,
    REASON_ROLLED_BACK,
    rolled_back_at,
    rollout_of,
)
from kvpilot.operator.kube import ApiError, resource_path
from kvpilot.operator.reconcile.common import (
    engine_failure_said,
    refused_in_force,
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
from kvpilot.operator.reconcile.tracking import (
    Tracked,
    Verdict,
    judged_generation,
    last_good_refusal,
    owns,
    render_last_good,
    write_verdict,
)


async def track_pod(rt: Runtime, pod: dict[str, Any], emit_on: EmitOn, logger: Logger) -> None:
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


async def _track_pod(rt: Runtime, namespace: str, name: str, failure: EngineFailure, emit_on: EmitOn,
                     logger: Logger) -> None:
    t = await _failed_revision(rt, namespace, name, failure, emit_on, logger)
    if t is None:
        return
    # The rollback was decided (its status written) but its patch did not hold: this pod of the failed
    # revision, still rendered, brings it here again to complete it.
    pending = rolled_back_at(t.previous, t.generation) and bool(t.last_good) and t.last_good != t.rollout.engine
    if (_already_told(t.previous, t.generation, failure.config_hash) and not pending) \
            or refused_in_force(rt, t.parent, t.previous, t.generation):
        return
    if failure.cause_above:
        failure = await with_log(rt, namespace, failure, logger)
    verdict = await _verdict(t, failure, pending)
    if verdict is None:
        return
    try:
        await write_verdict(t, verdict)
    except ApiError as exc:
        logger.warning("status of %s/%s not written: %s", namespace, name, exc)


async def _failed_revision(rt: Runtime, namespace: str, name: str, failure: EngineFailure, emit_on: EmitOn,
                           logger: Logger) -> Tracked | None:
    """The InferenceService whose rollout this failed pod belongs to, or None."""
    deployment = await rt.client.get_or_none(resource_path("apps/v1", "deployments", namespace, name))
    if deployment is None:
        return None
    rollout = rollout_of(deployment)
    if failure.config_hash is None or failure.config_hash != rollout.config_hash or rollout.complete:
        # A pod of another revision (the one rolled back from, or the old one going away), or of a
        # rollout that completed (its engine is lastGoodEngine itself: nothing to go back to).
        return None
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None or not owns(parent, deployment):
        return None
    previous = dict(parent.get("status") or {})
    generation = judged_generation(parent)
    if generation is None:
        return None
    return Tracked(rt, namespace, name, parent, previous, generation, deployment, rollout,
                   usable_last_good(previous, logger), emit_on, logger)


def _already_told(previous: dict[str, Any], generation: int, config_hash: str | None) -> bool:
    """This generation was rolled back already, or its engine failure is on the status already."""
    if rolled_back_at(previous, generation):
        return True
    told = previous.get("lastFailure") or {}
    return engine_failure_said(previous, generation) and told.get("configHash") == config_hash


async def _verdict(t: Tracked, failure: EngineFailure, pending: bool) -> Verdict | None:
    """Roll back to lastGoodEngine, or say why not.  None: the parent is gone."""
    described = failure.describe()
    last_failure = failure_record(failure.reason, described, failure.config_hash, t.generation, failure.pod)
    refusal = last_good_refusal(t.rt, t.last_good)
    if refusal is not None:
        # The allowlist changed since that engine ran: putting it back would run a refused image.
        return _failure_stands(t, REASON_IMAGE_NOT_ALLOWED, f"engine of configHash {t.rollout.config_hash} failed: "
                               f"{described}; lastGoodEngine is not put back: {refusal}", last_failure)
    if t.last_good and t.last_good != t.rollout.engine:
        return await _roll_back(t, t.last_good, described, pending, last_failure)
    why = ("no lastGoodEngine to roll back to" if not t.last_good
           else "its engine is lastGoodEngine (what changed is outside spec.engine): nothing to roll back to")
    return _failure_stands(t, failure.reason, f"engine of configHash {t.rollout.config_hash} failed: "
                           f"{described}; {why}", last_failure)


def _failure_stands(t: Tracked, reason: str, message: str, last_failure: dict[str, Any]) -> Verdict:
    """No rollback: Degraded, a Warning Event and the log say why."""
    t.warn(reason, message)
    t.logger.warning("engine of %s/%s failed: %s", t.namespace, t.name, message)
    return Verdict(t.deployment, (reason, message), last_failure)


async def _roll_back(t: Tracked, last_good: dict[str, Any], described: str, pending: bool,
                     last_failure: dict[str, Any]) -> Verdict | None:
    """Put lastGoodEngine back: the decision first (unless it is written already), then the patch."""
    failed = f"rollout of configHash {t.rollout.config_hash} ({engine_summary(t.rollout.engine, last_good)}) failed"
    if not pending:
        # The decision first, as at the progress deadline: an operator stopped (or an API failing)
        # between it and the patch leaves a status that says this generation is given up, so the
        # next reconcile renders lastGoodEngine, and the next event of this pod completes the patch.
        await update_status(t.rt, t.namespace, t.name, decision(
            REASON_ROLLED_BACK, f"{failed}: {described}; putting lastGoodEngine back; a new spec generation "
            "tries again", t.generation, last_failure), parent=t.parent)
        parent = await t.rt.client.get_or_none(isvc_path(t.namespace, t.name))
        if parent is None:
            return None
        t.parent = parent
    restored = await render_last_good(t.rt, t.parent, last_good)
    applied = await ensure(t.rt.client, restored)
    restored_hash = str(restored["metadata"]["annotations"][ANNOTATION_CONFIG_HASH])
    message = (f"{failed}: {described}; put lastGoodEngine back (configHash {restored_hash}); "
               f"a new spec generation tries again")
    t.rt.metrics.rollbacks.inc()
    t.warn(REASON_ROLLED_BACK, message)
    t.logger.warning("rolled back %s/%s: %s", t.namespace, t.name, message)
    return Verdict(applied.live or t.deployment, (REASON_ROLLED_BACK, message), last_failure)
