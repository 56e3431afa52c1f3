"""What the handlers do, kept out of kopf's decorators so each step reads (and tests) plainly.

`reconcile_service` runs for a created, changed or resumed InferenceService: validate, render,
create-or-patch the children, and write the status.  `track_rollout` runs for every event of a
Deployment kvpilot manages: it maps the Deployment back to its InferenceService, rolls back a
rollout that passed its progress deadline, and writes the parent's status.

Both hold the InferenceService's lock (`Runtime.lock_for`) from their first read to their status
write, and write the status themselves, inside the lock (not through kopf's patch, which kopf
applies after the handler has returned).  So a Deployment event that arrives while a reconcile is
running (its rollout finished the moment the reconcile created it) waits, and is then judged
against the status the reconcile wrote; nothing can overwrite it with an older view.

Status writes are read-modify-write (`update_status`): the operator owns the conditions Ready,
Progressing and Degraded and keeps every other type (the tuner's Tuning, SLOBurning) as it finds
it; the write carries the resourceVersion it was computed from, and a conflict (someone else
wrote meanwhile) reads again and recomputes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.api.vocabulary import GROUP, PLURAL, VERSION
from kvpilot.operator.apply import MonitoringDiscovery, NotOwned, ensure, ensure_absent
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, LABEL_ISVC, RenderOptions
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.render import render_manifests
from kvpilot.operator.builders.service import build_pdb, wants_pdb
from kvpilot.operator.builders.status import (
    DEGRADED,
    REASON_APPLY_FAILED,
    REASON_DEADLINE,
    REASON_IMAGE_NOT_ALLOWED,
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


# new status (the keys the operator owns) from the status as last read; the conditions it returns
# keep every condition type of the one it was given that the operator does not own.
ComputeStatus = Callable[[dict[str, Any]], dict[str, Any]]

# Reads and recomputations of one status write when others keep writing in between.
STATUS_CONFLICT_ATTEMPTS = 5


class RetryLater(Exception):
    """A transient failure outlasted the client's retries; kopf should run the handler again later."""


@dataclass
class Runtime:
    """Everything the handlers share in one operator process."""

    settings: OperatorSettings
    client: KubeClient
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    discovery: MonitoringDiscovery = field(init=False)
    # InferenceService uids already told that monitoring objects are skipped (the Event is sent once).
    skip_noted: set[str] = field(default_factory=set)
    # One lock per InferenceService (namespace/name): a reconcile and a Deployment event of the
    # same object never interleave (see the module docstring).
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # namespace/name -> resourceVersion of the Deployment its status was last computed from: an
    # event for that same version (our own create or patch coming back) has nothing new to say.
    status_basis: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.discovery = MonitoringDiscovery(self.client, ttl=self.settings.discovery_ttl_seconds)

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault(f"{namespace}/{name}", asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The InferenceService (or its Deployment) is gone: drop what the process keeps for it.
        A lock in use stays; an unused one is made again when needed."""
        key = f"{namespace}/{name}"
        lock = self.locks.get(key)
        if lock is not None and not lock.locked():
            del self.locks[key]
        self.status_basis.pop(key, None)
        self.metrics.forget_engine(namespace, name)


def isvc_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return resource_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name, subresource)


def _engine_summary(engine: dict[str, Any] | None, against: dict[str, Any] | None) -> str:
    """The engine fields that differ, e.g. 'maxNumBatchedTokens=8192 (was 2048)'."""
    engine, against = engine or {}, against or {}
    parts = [f"{k}={engine.get(k)!r} (was {against.get(k)!r})"
             for k in sorted(set(engine) | set(against)) if engine.get(k) != against.get(k)]
    return ", ".join(parts) or "an unchanged engine"


def _degraded_only(reason: str, message: str, generation: int | None) -> ComputeStatus:
    def compute(previous: dict[str, Any]) -> dict[str, Any]:
        return {"conditions": set_condition(previous.get("conditions"), DEGRADED, "True", reason, message,
                                            generation, now_rfc3339())}
    return compute


async def update_status(rt: Runtime, namespace: str, name: str, compute: ComputeStatus, *,
                        parent: dict[str, Any] | None = None) -> None:
    """Read-modify-write of an InferenceService's status: `compute` gets the status as read and
    returns the keys the operator owns; only what changed is written, with the resourceVersion it
    was computed from, so a concurrent writer's change is read and kept, never overwritten.
    `parent` is the object as the caller last read it (saves a read; a conflict reads it anew)."""
    for _ in range(STATUS_CONFLICT_ATTEMPTS):
        if parent is None:
            parent = await rt.client.get_or_none(isvc_path(namespace, name))
            if parent is None:
                return  # deleted
        previous = dict(parent.get("status") or {})
        patch = status_patch(previous, compute(previous))
        if not patch:
            return
        version = parent.get("metadata", {}).get("resourceVersion")
        body: dict[str, Any] = {"status": patch}
        if version is not None:
            body["metadata"] = {"resourceVersion": version}
        try:
            await rt.client.merge_patch(isvc_path(namespace, name, "status"), body, retry_conflicts=False)
            return
        except ApiError as exc:
            if exc.not_found:
                return
            if exc.status != 409:
                raise
        parent = None  # someone wrote meanwhile: read again, recompute
    raise ApiError(409, "Conflict", f"status of {namespace}/{name} kept changing during "
                   f"{STATUS_CONFLICT_ATTEMPTS} read-modify-write attempts")


def render_options(settings: OperatorSettings, served: frozenset[str]) -> RenderOptions:
    """What the builders need from the settings and from discovery (the monitoring kinds served)."""
    return RenderOptions(twin_image=settings.twin_image, service_monitors="servicemonitors" in served,
                         prometheus_rules="prometheusrules" in served,
                         engine_run_as_user=settings.engine_run_as_user)


def image_refusal(rt: Runtime, engine: EngineSpec, field: str = "spec.engine.image") -> str | None:
    """Why the operator will not run this engine's image (the allowlist's message), or None.  Only
    vLLM images are the tenant's choice; the twin runs the operator's own --twin-image."""
    if engine.kind != "vllm" or rt.settings.allowed_images.allows(engine.image):
        return None
    return rt.settings.allowed_images.refusal(engine.image, field)


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
                compute = _degraded_only(REASON_APPLY_FAILED, str(exc), meta.get("generation"))
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
            raise RetryLater(f"writing the status failed: {exc}") from exc
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
        missing = [kind for plural, kind in _MONITORING_KINDS.items() if plural not in served]
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
        if not wants_pdb(isvc):
            removed = await ensure_absent(rt.client, build_pdb(isvc))
            if removed is not None:
                emit("Normal", "Deleted", f"Deleted PodDisruptionBudget {removed.name} (replicas <= 1)")
    except NotOwned as exc:
        emit("Warning", REASON_APPLY_FAILED, str(exc))
        return _degraded_only(REASON_APPLY_FAILED, str(exc), generation), "error", None
    except ApiError as exc:
        message = f"applying children failed: {exc}"
        emit("Warning", REASON_APPLY_FAILED, message)
        if exc.retriable:
            # The caller writes Degraded before kopf's retry, so the condition shows while we wait.
            raise RetryLater(message) from exc
        return _degraded_only(REASON_APPLY_FAILED, message, generation), "error", None

    rt.metrics.set_engine(str(meta.get("namespace")), str(meta.get("name")), engine_info(rollout_of(deployment)))
    return ((lambda fresh: desired_status(generation=generation, previous=fresh, deployment=deployment)),
            "success", deployment)


async def track_rollout(rt: Runtime, deployment: dict[str, Any], emit_on: Callable[[dict[str, Any], str, str, str], None],
                        logger: Logger) -> None:
    """Map a Deployment event to its InferenceService: status, lastGoodEngine, rollback."""
    meta = deployment.get("metadata", {})
    name = (meta.get("labels") or {}).get(LABEL_ISVC)
    namespace = meta.get("namespace")
    if not name or not namespace:
        return
    async with rt.lock_for(namespace, name):
        await _track_rollout(rt, namespace, name, deployment, emit_on, logger)


async def _track_rollout(rt: Runtime, namespace: str, name: str, deployment: dict[str, Any],
                         emit_on: Callable[[dict[str, Any], str, str, str], None], logger: Logger) -> None:
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

    rollout = rollout_of(deployment)
    degraded: tuple[str, str] | None = None
    last_good = previous.get("lastGoodEngine")
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
            served = await rt.discovery.served()
            options = render_options(rt.settings, served)
            restored = build_deployment(isvc, options, EngineSpec.model_validate(last_good))
            applied = await ensure(rt.client, restored)
            deployment = applied.live or deployment
            message = (f"rollout of configHash {rollout.config_hash} ({_engine_summary(rollout.engine, last_good)}) "
                       f"did not progress: {rollout.message or REASON_DEADLINE}; put lastGoodEngine back "
                       f"(configHash {restored['metadata']['annotations'][ANNOTATION_CONFIG_HASH]}); "
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
    rt.metrics.set_engine(namespace, name, engine_info(rollout_of(deployment)))

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return desired_status(generation=generation, previous=fresh, deployment=deployment, degraded=degraded)

    try:
        await update_status(rt, namespace, name, compute, parent=parent)
    except ApiError as exc:
        # The API kept failing through the retries: the next Deployment event or reconcile writes
        # the status again; a traceback would tell nobody more.
        logger.warning("status of %s/%s not written: %s", namespace, name, exc)
        return
    version = (deployment.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        rt.status_basis[key] = str(version)
