"""What the handlers do, kept out of kopf's decorators so each step reads (and tests) plainly.

`reconcile_service` runs for a created, changed or resumed InferenceService: validate, render,
create-or-patch the children, and return the status patch.  `track_rollout` runs for every event
of a Deployment kvpilot manages: it maps the Deployment back to its InferenceService, rolls back
a rollout that passed its progress deadline, and patches the parent's status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api.models import GROUP, PLURAL, VERSION, EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.operator.apply import MonitoringDiscovery, NotOwned, ensure, ensure_absent
from kvpilot.operator.builders.common import LABEL_ISVC, RenderOptions
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.render import render_manifests
from kvpilot.operator.builders.service import build_pdb, wants_pdb
from kvpilot.operator.builders.status import (
    DEGRADED,
    REASON_APPLY_FAILED,
    REASON_DEADLINE,
    REASON_INVALID_SPEC,
    REASON_ROLLED_BACK,
    desired_status,
    engine_info,
    find_condition,
    invalid_status,
    now_rfc3339,
    rolled_back_at,
    rollout_of,
    set_condition,
    status_patch,
)
from kvpilot.operator.kube import ApiError, KubeClient, resource_path
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.settings import OperatorSettings

Logger = logging.Logger | logging.LoggerAdapter[Any]

# emit(type, reason, message): an Event on the InferenceService being handled.
Emit = Callable[[str, str, str], None]

_MONITORING_KINDS = {"servicemonitors": "ServiceMonitor", "prometheusrules": "PrometheusRule"}


class RetryLater(Exception):
    """A transient failure outlasted the client's retries; kopf should run the handler again later."""

    def __init__(self, message: str, status_patch: dict[str, Any]) -> None:
        super().__init__(message)
        self.status_patch = status_patch


@dataclass
class Runtime:
    """Everything the handlers share in one operator process."""

    settings: OperatorSettings
    client: KubeClient
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    discovery: MonitoringDiscovery = field(init=False)
    # InferenceService uids already told that monitoring objects are skipped (the Event is sent once).
    skip_noted: set[str] = field(default_factory=set)
    # Pending settle passes, by namespace/name (one at a time per object).
    settling: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.discovery = MonitoringDiscovery(self.client, ttl=self.settings.discovery_ttl_seconds)


def isvc_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return resource_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name, subresource)


def _engine_summary(engine: dict[str, Any] | None, against: dict[str, Any] | None) -> str:
    """The engine fields that differ, e.g. 'maxNumBatchedTokens=8192 (was 2048)'."""
    engine, against = engine or {}, against or {}
    parts = [f"{k}={engine.get(k)!r} (was {against.get(k)!r})"
             for k in sorted(set(engine) | set(against)) if engine.get(k) != against.get(k)]
    return ", ".join(parts) or "an unchanged engine"


def _degraded_only(previous: dict[str, Any], reason: str, message: str, generation: int | None) -> dict[str, Any]:
    conditions = set_condition(previous.get("conditions"), DEGRADED, "True", reason, message,
                               generation, now_rfc3339())
    return status_patch(previous, {"conditions": conditions})


async def reconcile_service(rt: Runtime, body: dict[str, Any], emit: Emit, logger: Logger) -> dict[str, Any]:
    """Reconcile one InferenceService; returns the status merge patch (possibly empty)."""
    started = time.perf_counter()
    result = "error"
    try:
        patch, result = await _reconcile(rt, body, emit, logger)
        return patch
    except RetryLater:
        result = "retry"
        raise
    finally:
        rt.metrics.duration.observe(time.perf_counter() - started)
        rt.metrics.reconciles.labels(result=result).inc()


async def _reconcile(rt: Runtime, body: dict[str, Any], emit: Emit,
                     logger: Logger) -> tuple[dict[str, Any], str]:
    meta = body.get("metadata", {})
    generation = meta.get("generation")
    previous = dict(body.get("status") or {})

    issues = validate_object({k: v for k, v in body.items() if k != "status"})
    if issues:
        message = "; ".join(str(issue) for issue in issues)
        old = find_condition(previous.get("conditions"), DEGRADED) or {}
        if old.get("reason") != REASON_INVALID_SPEC or old.get("message") != message:
            emit("Warning", REASON_INVALID_SPEC, message)
        logger.warning("invalid spec, nothing deployed or changed: %s", message)
        return status_patch(previous, invalid_status(generation=generation, previous=previous,
                                                     message=message)), "invalid"

    isvc = InferenceService.model_validate({k: v for k, v in body.items() if k != "status"})
    engine: EngineSpec | None = None
    if rolled_back_at(previous, generation) and previous.get("lastGoodEngine"):
        # This generation already failed its rollout: keep the last good engine until the spec changes.
        engine = EngineSpec.model_validate(previous["lastGoodEngine"])

    try:
        served = await rt.discovery.served()
        options = RenderOptions(twin_image=rt.settings.twin_image,
                                service_monitors="servicemonitors" in served,
                                prometheus_rules="prometheusrules" in served)
        missing = [kind for plural, kind in _MONITORING_KINDS.items() if plural not in served]
        if missing and isvc.metadata.uid not in rt.skip_noted:
            rt.skip_noted.add(str(isvc.metadata.uid))
            emit("Normal", "MonitoringSkipped",
                 f"the cluster does not serve monitoring.coreos.com/v1 {', '.join(missing)}; "
                 f"not creating {' or '.join(missing)} (install the Prometheus Operator CRDs to get them)")
        deployment: dict[str, Any] | None = None
        for manifest in render_manifests(isvc, options, engine):
            applied = await ensure(rt.client, manifest)
            what = f"{applied.kind} {applied.name}"
            if applied.action == "created":
                emit("Normal", "Created", f"Created {what}")
                logger.info("created %s", what)
            elif applied.action == "updated":
                changed = ", ".join(applied.changed[:6]) + (" ..." if len(applied.changed) > 6 else "")
                emit("Normal", "Updated", f"Updated {what}: {changed}")
                logger.info("updated %s: %s", what, changed)
            if manifest["kind"] == "Deployment":
                deployment = applied.live
        if not wants_pdb(isvc):
            removed = await ensure_absent(rt.client, build_pdb(isvc))
            if removed is not None:
                emit("Normal", "Deleted", f"Deleted PodDisruptionBudget {removed.name} (replicas <= 1)")
    except NotOwned as exc:
        emit("Warning", REASON_APPLY_FAILED, str(exc))
        return _degraded_only(previous, REASON_APPLY_FAILED, str(exc), generation), "error"
    except ApiError as exc:
        message = f"applying children failed: {exc}"
        emit("Warning", REASON_APPLY_FAILED, message)
        if exc.retriable:
            # kopf applies the patch before the retry, so the condition shows while we wait.
            raise RetryLater(message, _degraded_only(previous, REASON_APPLY_FAILED, message, generation)) from exc
        return _degraded_only(previous, REASON_APPLY_FAILED, message, generation), "error"

    new = desired_status(generation=generation, previous=previous, deployment=deployment)
    rt.metrics.set_engine(str(meta.get("namespace")), str(meta.get("name")), engine_info(rollout_of(deployment)))
    return status_patch(previous, new), "success"


async def track_rollout(rt: Runtime, deployment: dict[str, Any], emit_on: Callable[[dict[str, Any], str, str, str], None],
                        logger: Logger) -> None:
    """Map a Deployment event to its InferenceService: status, lastGoodEngine, rollback."""
    meta = deployment.get("metadata", {})
    name = (meta.get("labels") or {}).get(LABEL_ISVC)
    namespace = meta.get("namespace")
    if not name or not namespace:
        return
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        rt.metrics.forget_engine(namespace, name)
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

    rollout = rollout_of(deployment)
    degraded: tuple[str, str] | None = None
    last_good = previous.get("lastGoodEngine")
    if rollout.deadline_exceeded and rollout.engine is not None:
        if last_good and last_good != rollout.engine:
            isvc = InferenceService.model_validate({k: v for k, v in parent.items() if k != "status"})
            served = await rt.discovery.served()
            options = RenderOptions(twin_image=rt.settings.twin_image,
                                    service_monitors="servicemonitors" in served,
                                    prometheus_rules="prometheusrules" in served)
            restored = build_deployment(isvc, options, EngineSpec.model_validate(last_good))
            applied = await ensure(rt.client, restored)
            deployment = applied.live or deployment
            message = (f"rollout of configHash {rollout.config_hash} ({_engine_summary(rollout.engine, last_good)}) "
                       f"did not progress: {rollout.message or REASON_DEADLINE}; put lastGoodEngine back "
                       f"(configHash {restored['metadata']['annotations']['kvpilot.dev/config-hash']}); "
                       f"a new spec generation tries again")
            degraded = (REASON_ROLLED_BACK, message)
            rt.metrics.rollbacks.inc()
            emit_on(parent, "Warning", REASON_ROLLED_BACK, message)
            logger.warning("rolled back %s/%s: %s", namespace, name, message)
        elif not last_good:
            degraded = (REASON_DEADLINE, f"rollout of configHash {rollout.config_hash} did not progress: "
                        f"{rollout.message or REASON_DEADLINE}; no lastGoodEngine to roll back to")
            old = find_condition(previous.get("conditions"), DEGRADED) or {}
            if old.get("reason") != REASON_DEADLINE:
                emit_on(parent, "Warning", REASON_DEADLINE, degraded[1])
    new = desired_status(generation=generation, previous=previous, deployment=deployment, degraded=degraded)
    rt.metrics.set_engine(namespace, name, engine_info(rollout_of(deployment)))
    patch = status_patch(previous, new)
    if patch:
        try:
            await rt.client.merge_patch(isvc_path(namespace, name, "status"), {"status": patch})
        except ApiError as exc:
            # Deleted meanwhile, or the API kept failing through the retries: the next Deployment
            # event or reconcile writes the status again; a traceback would tell nobody more.
            logger.warning("status of %s/%s not written: %s", namespace, name, exc)


def schedule_settle(rt: Runtime, namespace: str, name: str,
                    emit_on: Callable[[dict[str, Any], str, str, str], None], logger: Logger) -> None:
    """Re-read the Deployment shortly after a reconcile and fix the status if it moved meanwhile.

    The reconcile computes its status from the Deployment as it read it, and kopf writes that
    status after the handler returns; a Deployment event in between is handled against the old
    status (or skipped, before the first one), and the reconcile's write can then overwrite it.
    One pass after kopf has written the reconcile's status closes that window.
    """
    key = f"{namespace}/{name}"
    pending = rt.settling.get(key)
    if pending is not None and not pending.done():
        return
    rt.settling[key] = asyncio.create_task(_settle(rt, namespace, name, emit_on, logger))


async def _settle(rt: Runtime, namespace: str, name: str,
                  emit_on: Callable[[dict[str, Any], str, str, str], None], logger: Logger) -> None:
    try:
        for _ in range(rt.settings.settle_attempts):
            await asyncio.sleep(rt.settings.settle_delay_seconds)
            parent = await rt.client.get_or_none(isvc_path(namespace, name))
            if parent is None:
                return
            status = parent.get("status") or {}
            if status.get("observedGeneration") != parent.get("metadata", {}).get("generation"):
                continue  # kopf has not written the reconcile's status yet (or the spec moved on)
            deployment = await rt.client.get_or_none(resource_path("apps/v1", "deployments", namespace, name))
            if deployment is not None:
                await track_rollout(rt, deployment, emit_on, logger)
            return
    except ApiError as exc:
        logger.warning("settling the status of %s/%s failed: %s", namespace, name, exc)
    finally:
        rt.settling.pop(f"{namespace}/{name}", None)
