"""The reconcile of a created, changed or resumed InferenceService (`reconcile_service`): validate,
render, create or patch the children, and write the status."""

from __future__ import annotations

import time
from typing import Any

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.operator.apply import NotOwned, ensure, ensure_absent
from kvpilot.operator.builders.monitoring import MONITOR_PLURALS
from kvpilot.operator.builders.render import render_manifests, unwanted_monitors, wanted_monitor
from kvpilot.operator.builders.service import build_pdb, wants_pdb
from kvpilot.operator.builders.status import (
    DEGRADED,
    REASON_APPLY_FAILED,
    REASON_IMAGE_NOT_ALLOWED,
    REASON_INVALID_SPEC,
    desired_status,
    engine_info,
    find_condition,
    invalid_status,
    rolled_back_at,
    rollout_of,
)
from kvpilot.operator.kube import ApiError
from kvpilot.operator.reconcile.canary import reconcile_canary, with_canary
from kvpilot.operator.reconcile.common import image_refusal, render_options
from kvpilot.operator.reconcile.runtime import Emit, Logger, RetryLater, Runtime
from kvpilot.operator.reconcile.status import ComputeStatus, degraded_only, update_status


def _unserved_kinds(isvc: InferenceService, served: frozenset[str]) -> list[str]:
    """The monitoring kinds this InferenceService asks for that the cluster does not serve."""
    wanted = {"prometheusrules": "PrometheusRule"}
    monitor = wanted_monitor(isvc)
    if monitor is not None:
        wanted = {MONITOR_PLURALS[monitor]: monitor.value, **wanted}
    return [kind for plural, kind in wanted.items() if plural not in served]



async def reconcile_service(rt: Runtime, body: dict[str, Any], emit: Emit, logger: Logger) -> None:
    """Reconcile one InferenceService and write its status (raises RetryLater on transient failures)."""
    started = time.perf_counter()
    result = "error"
    meta = body.get("metadata", {})
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    try:
        async with rt.lock_for(namespace, name):
            rt.status_basis.pop(f"{namespace}/{name}", None)
            try:
                compute, result, deployment = await _reconcile(rt, body, emit, logger)
            except RetryLater as exc:
                result = "retry"
                compute = degraded_only(REASON_APPLY_FAILED, str(exc), meta.get("generation"))
                await _write_status(rt, namespace, name, compute, body, logger)
                raise
            if await _write_status(rt, namespace, name, compute, body, logger) and deployment is not None:
                version = deployment.get("metadata", {}).get("resourceVersion")
                if version is not None:
                    rt.status_basis[f"{namespace}/{name}"] = str(version)
    except RetryLater:
        result = "retry"
        raise
    finally:
        rt.metrics.duration.observe(time.perf_counter() - started)
        rt.metrics.reconciles.labels(result=result).inc()


async def _write_status(rt: Runtime, namespace: str, name: str, compute: ComputeStatus, body: dict[str, Any],
                        logger: Logger) -> bool:
    """True once the status is written (or already was as computed)."""
    try:
        await update_status(rt, namespace, name, compute, parent=body)
        return True
    except ApiError as exc:
        if exc.retriable:
            raise RetryLater(f"writing the status failed: {exc}", retry_after=exc.retry_after) from exc
        logger.warning("status of %s/%s not written: %s", namespace, name, exc)
        return False


async def _reconcile(rt: Runtime, body: dict[str, Any], emit: Emit,
                     logger: Logger) -> tuple[ComputeStatus, str, dict[str, Any] | None]:
    """The status to write, the result for the metrics, and the Deployment as applied (if it was)."""
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
        return (lambda fresh: invalid_status(generation=generation, previous=fresh, message=message)), "invalid", None

    isvc = InferenceService.model_validate({k: v for k, v in body.items() if k != "status"})
    engine: EngineSpec | None = None
    if rolled_back_at(previous, generation) and previous.get("lastGoodEngine"):
        # This generation already failed its rollout: keep the last good engine until the spec changes.
        engine = EngineSpec.model_validate(previous["lastGoodEngine"])

    refusal = image_refusal(rt, engine or isvc.spec.engine)
    if refusal is not None:
        old = find_condition(previous.get("conditions"), DEGRADED) or {}
        if old.get("reason") != REASON_IMAGE_NOT_ALLOWED or old.get("message") != refusal:
            emit("Warning", REASON_IMAGE_NOT_ALLOWED, refusal)
        logger.warning("image not allowed, nothing deployed or changed: %s", refusal)
        return ((lambda fresh: invalid_status(generation=generation, previous=fresh, message=refusal,
                                              reason=REASON_IMAGE_NOT_ALLOWED)), "invalid", None)

    try:
        served = await rt.discovery.served()
        options = render_options(rt.settings, served)
        missing = _unserved_kinds(isvc, served)
        if missing and isvc.metadata.uid not in rt.skip_noted:
            rt.skip_noted.add(str(isvc.metadata.uid))
            emit("Normal", "MonitoringSkipped",
                 f"the cluster does not serve monitoring.coreos.com/v1 {', '.join(missing)}; "
                 f"not creating {' or '.join(missing)} (install the Prometheus Operator CRDs to get them)")
        deployment: dict[str, Any] | None = None
        # Never reconciled (no status yet): its children almost surely do not exist.
        new_object = previous.get("observedGeneration") is None
        # One Created Event naming every child created in this pass (a new object's three or four
        # Events would be the bulk of its API calls), posted even if a later child fails.
        created: list[str] = []
        try:
            for manifest in render_manifests(isvc, options, engine):
                applied = await ensure(rt.client, manifest, likely_absent=new_object)
                what = f"{applied.kind} {applied.name}"
                if applied.action == "created":
                    created.append(what)
                    logger.info("created %s", what)
                elif applied.action == "updated":
                    changed = ", ".join(applied.changed[:6]) + (" ..." if len(applied.changed) > 6 else "")
                    emit("Normal", "Updated", f"Updated {what}: {changed}")
                    logger.info("updated %s: %s", what, changed)
                if manifest["kind"] == "Deployment":
                    deployment = applied.live
        finally:
            if created:
                emit("Normal", "Created", f"Created {', '.join(created)}")
        canary = await reconcile_canary(rt, isvc, previous, options, new_object, emit, logger)
        if not wants_pdb(isvc):
            removed = await ensure_absent(rt.client, build_pdb(isvc))
            if removed is not None:
                emit("Normal", "Deleted", f"Deleted PodDisruptionBudget {removed.name} (replicas <= 1)")
        # A monitor of another kind exists only after spec.observability.monitor changed: look for
        # one when the spec generation moved on, not on every resync.
        if not new_object and previous.get("observedGeneration") != generation:
            for stale in unwanted_monitors(isvc, options):
                removed = await ensure_absent(rt.client, stale)
                if removed is not None:
                    emit("Normal", "Deleted", f"Deleted {removed.kind} {removed.name} "
                         f"(spec.observability.monitor is {isvc.spec.observability.monitor})")
    except NotOwned as exc:
        emit("Warning", REASON_APPLY_FAILED, str(exc))
        return degraded_only(REASON_APPLY_FAILED, str(exc), generation), "error", None
    except ApiError as exc:
        message = f"applying children failed: {exc}"
        emit("Warning", REASON_APPLY_FAILED, message)
        if exc.retriable:
            # The caller writes Degraded before kopf's retry, so the condition shows while we wait.
            raise RetryLater(message, retry_after=exc.retry_after) from exc
        return degraded_only(REASON_APPLY_FAILED, message, generation), "error", None

    rt.metrics.set_engine(str(meta.get("namespace")), str(meta.get("name")), engine_info(rollout_of(deployment)))

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return with_canary(desired_status(generation=generation, previous=fresh, deployment=deployment), fresh,
                           canary, generation)

    return compute, "success", deployment

