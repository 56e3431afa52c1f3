"""A managed Deployment changed (`track_rollout`): its InferenceService's status follows it, and a
rollout past its progress deadline is rolled back to status.lastGoodEngine."""

from __future__ import annotations

from typing import Any, NoReturn

from kvpilot.operator.apply import ensure
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, LABEL_ISVC
from kvpilot.operator.builders.status import (
    DEGRADED,
    REASON_DEADLINE,
    REASON_IMAGE_NOT_ALLOWED,
    REASON_ROLLBACK_FAILED,
    REASON_ROLLED_BACK,
    desired_status,
    find_condition,
    rolled_back_at,
    rollout_of,
)
from kvpilot.operator.kube import ApiError, resource_path
from kvpilot.operator.reconcile.common import engine_failure_said, refused_in_force, usable_last_good
from kvpilot.operator.reconcile.runtime import EmitOn, HandleAgain, Logger, Runtime
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


async def track_rollout(rt: Runtime, deployment: dict[str, Any], emit_on: EmitOn, logger: Logger) -> None:
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
    _handle_again(rt, key, namespace, meta.get("name"), delay, emit_on, logger)


def _handle_again(rt: Runtime, key: str, namespace: str, deployment_name: Any, delay: float, emit_on: EmitOn,
                  logger: Logger) -> None:
    """Handle the Deployment again in `delay` seconds, from a fresh read (a failed read tries again later)."""
    path = resource_path("apps/v1", "deployments", namespace, str(deployment_name))

    async def again() -> None:
        try:
            fresh = await rt.client.get_or_none(path)
        except ApiError as exc:
            later = rt.next_event_retry_delay(key, exc.retry_after)
            logger.warning("reading Deployment %s/%s failed: %s; trying again in %.1fs",
                           namespace, deployment_name, exc, later)
            rt.handle_again(key, later, again, logger)
            return
        if fresh is None:
            return  # gone: its DELETED event does the rest
        await track_rollout(rt, fresh, emit_on, logger)

    rt.handle_again(key, delay, again, logger)


async def _track_rollout(rt: Runtime, namespace: str, name: str, deployment: dict[str, Any],
                         emit_on: EmitOn, logger: Logger) -> None:
    t = await _to_judge(rt, namespace, name, deployment, emit_on, logger)
    if t is None:
        return
    verdict = await _verdict(t)
    if verdict is None:
        return
    # A failure here (the API kept failing through the retries) is handled again by track_rollout:
    # this may be the last event the Deployment sends (its rollout completed).
    await write_verdict(t, verdict)


async def _to_judge(rt: Runtime, namespace: str, name: str, deployment: dict[str, Any], emit_on: EmitOn,
                    logger: Logger) -> Tracked | None:
    """The InferenceService this Deployment event says something new about, or None."""
    key = f"{namespace}/{name}"
    version = deployment.get("metadata", {}).get("resourceVersion")
    if version is not None and rt.status_basis.get(key) == str(version):
        return None  # the status was computed from exactly this Deployment
    rt.status_basis.pop(key, None)
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        rt.forget(namespace, name)
        return None  # deleted; the garbage collector takes the children
    if not owns(parent, deployment):
        return None
    previous = dict(parent.get("status") or {})
    generation = judged_generation(parent)
    if generation is None or refused_in_force(rt, parent, previous, generation):
        return None
    return Tracked(rt, namespace, name, parent, previous, generation, deployment, rollout_of(deployment),
                   usable_last_good(previous, logger), emit_on, logger)


async def _verdict(t: Tracked) -> Verdict | None:
    """A rollout past its progress deadline: roll back, or say why not.  None: the parent is gone."""
    if not t.rollout.deadline_exceeded or t.rollout.engine is None:
        return Verdict(t.deployment)
    refusal = last_good_refusal(t.rt, t.last_good)
    if refusal is not None:
        return _last_good_refused(t, refusal)
    if t.last_good and t.last_good != t.rollout.engine:
        return await _roll_back(t, t.last_good)
    if not t.last_good and not engine_failure_said(t.previous, t.generation):
        return _nothing_to_roll_back_to(t)
    return Verdict(t.deployment)


def _last_good_refused(t: Tracked, refusal: str) -> Verdict:
    """The allowlist changed since lastGoodEngine ran: putting it back would run a refused image."""
    message = (f"rollout of configHash {t.rollout.config_hash} did not progress "
               f"and lastGoodEngine is not put back: {refusal}")
    old = find_condition(t.previous.get("conditions"), DEGRADED) or {}
    if old.get("reason") != REASON_IMAGE_NOT_ALLOWED:
        t.warn(REASON_IMAGE_NOT_ALLOWED, message)
    return Verdict(t.deployment, (REASON_IMAGE_NOT_ALLOWED, message))


def _nothing_to_roll_back_to(t: Tracked) -> Verdict:
    why = t.rollout.message or REASON_DEADLINE
    message = (f"rollout of configHash {t.rollout.config_hash} did not progress: {why}; "
               "no lastGoodEngine to roll back to")
    old = find_condition(t.previous.get("conditions"), DEGRADED) or {}
    if old.get("reason") == REASON_DEADLINE:
        return Verdict(t.deployment, (REASON_DEADLINE, message))
    t.warn(REASON_DEADLINE, message)
    return Verdict(t.deployment, (REASON_DEADLINE, message),
                   failure_record(REASON_DEADLINE, why, t.rollout.config_hash, t.generation))


async def _roll_back(t: Tracked, last_good: dict[str, Any]) -> Verdict | None:
    """Put lastGoodEngine back: the decision first, then the patch (HandleAgain if the patch fails)."""
    restored = await render_last_good(t.rt, t.parent, last_good)
    why = t.rollout.message or REASON_DEADLINE
    failed = (f"rollout of configHash {t.rollout.config_hash} ({engine_summary(t.rollout.engine, last_good)}) "
              f"did not progress: {why}")
    restored_hash = restored["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    message = f"{failed}; put lastGoodEngine back (configHash {restored_hash}); a new spec generation tries again"
    last_failure = failure_record(REASON_DEADLINE, why, t.rollout.config_hash, t.generation)
    if not rolled_back_at(t.previous, t.generation):
        # NOTE: the decision first, then the patch: an operator stopped between the two would
        # otherwise, restarted, render the failed engine again, since nothing in the status would
        # say this generation failed.  The write after the patch completes it.
        await update_status(t.rt, t.namespace, t.name,
                            decision(REASON_ROLLED_BACK, message, t.generation, last_failure), parent=t.parent)
        parent = await t.rt.client.get_or_none(isvc_path(t.namespace, t.name))
        if parent is None:
            return None
        t.parent = parent
    try:
        applied = await ensure(t.rt.client, restored)
    except ApiError as exc:
        await _rollback_failed(t, f"{failed}; putting lastGoodEngine back (configHash {restored_hash}) "
                               f"failed: {exc}", exc)
    if applied.action == "unchanged":
        # This event is older than the Deployment (kopf's listing at a start can be): lastGoodEngine
        # runs already, put back by whoever counted and said it.  The status stays as it is.
        return Verdict(applied.live or t.deployment)
    t.rt.metrics.rollbacks.inc()
    t.warn(REASON_ROLLED_BACK, message)
    t.logger.warning("rolled back %s/%s: %s", t.namespace, t.name, message)
    return Verdict(applied.live or t.deployment, (REASON_ROLLED_BACK, message), last_failure)


async def _rollback_failed(t: Tracked, what: str, exc: ApiError) -> NoReturn:
    """Say that the rollback is pending (Degraded RollbackFailed, and Ready/Progressing from the
    Deployment that did not progress; an Event the first time) and raise HandleAgain: the Deployment
    is read and the rollback tried again after the delay."""
    key = f"{t.namespace}/{t.name}"
    delay = t.rt.next_event_retry_delay(key, exc.retry_after)
    attempts = t.rt.event_retry_attempts[key]
    message = f"{what}; trying again in {delay:.0f}s (failed attempts: {attempts})"
    t.logger.warning("rollback of %s/%s failed: %s", t.namespace, t.name, message)
    old = find_condition((t.parent.get("status") or {}).get("conditions"), DEGRADED) or {}
    if old.get("reason") != REASON_ROLLBACK_FAILED:
        t.warn(REASON_ROLLBACK_FAILED, message)
    generation, deployment = t.generation, t.deployment
    try:
        await update_status(t.rt, t.namespace, t.name, lambda fresh: desired_status(
            generation=generation, previous=fresh, deployment=deployment, degraded=(REASON_ROLLBACK_FAILED, message)),
            parent=t.parent)
    except ApiError as status_exc:  # the API is failing: the next try writes it
        t.logger.warning("status of %s/%s not written: %s", t.namespace, t.name, status_exc)
    raise HandleAgain(delay) from exc
