"""What the handlers do, kept out of kopf's decorators so each step reads (and tests) plainly.

`reconcile_service` (a created, changed or resumed InferenceService), `track_rollout` (each event of a
managed Deployment) and `track_pod` (each engine pod whose engine failed).  Locks, retries and
status writes: docs/architecture.md, "The reconcile and its status writes".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.api.vocabulary import (
    ANNOTATION_CANARY,
    ANNOTATION_TUNING_TRIAL,
    CANARY_SUFFIX,
    GROUP,
    PLURAL,
    VERSION,
)
from kvpilot.operator.apply import MonitoringDiscovery, NotOwned, ensure, ensure_absent
from kvpilot.operator.builders.canary import (
    CAPACITY_NOTE,
    REASON_INVALID_CANARY,
    REASON_UNSCHEDULABLE,
    CanaryRequest,
    InvalidCanary,
    build_canary_deployment,
    canary_condition,
    canary_ref,
    canary_status,
    parse_canary,
    unschedulable,
)
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, LABEL_ISVC, RenderOptions
from kvpilot.operator.builders.deployment import CONTAINER_NAME, build_deployment
from kvpilot.operator.builders.monitoring import MONITOR_PLURALS
from kvpilot.operator.builders.pods import EngineFailure, engine_failure, pod_config_hash
from kvpilot.operator.builders.render import render_manifests, unwanted_monitors, wanted_monitor
from kvpilot.operator.builders.service import build_pdb, wants_pdb
from kvpilot.operator.builders.status import (
    DEGRADED,
    ENGINE_FAILURE_REASONS,
    REASON_APPLY_FAILED,
    REASON_DEADLINE,
    REASON_IMAGE_NOT_ALLOWED,
    REASON_INVALID_SPEC,
    REASON_ROLLBACK_FAILED,
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


def _unserved_kinds(isvc: InferenceService, served: frozenset[str]) -> list[str]:
    """The monitoring kinds this InferenceService asks for that the cluster does not serve."""
    wanted = {"prometheusrules": "PrometheusRule"}
    monitor = wanted_monitor(isvc)
    if monitor is not None:
        wanted = {MONITOR_PLURALS[monitor]: monitor.value, **wanted}
    return [kind for plural, kind in wanted.items() if plural not in served]


# new status (the keys the operator owns) from the status as last read; the conditions it returns
# keep every condition type of the one it was given that the operator does not own.
ComputeStatus = Callable[[dict[str, Any]], dict[str, Any]]

# Reads and recomputations of one status write when others keep writing in between.
STATUS_CONFLICT_ATTEMPTS = 5


class RetryLater(Exception):
    """A transient failure outlasted the client's retries; kopf should run the handler again later,
    not sooner than `retry_after` seconds where the API server asked for that."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class HandleAgain(Exception):
    """Handling a Deployment event failed; it is to be handled again in `delay` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(f"handle again in {delay:.1f}s")
        self.delay = delay


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
    # same object never interleave (docs/architecture.md, "The reconcile and its status writes").
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # namespace/name -> resourceVersion of the Deployment its status was last computed from: an
    # event for that same version (our own create or patch coming back) has nothing new to say.
    status_basis: dict[str, str] = field(default_factory=dict)
    # namespace/name -> the pending second try of a Deployment event whose handling failed, and the
    # failed tries so far (the delay grows with them; a success resets them).
    event_retries: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    event_retry_attempts: dict[str, int] = field(default_factory=dict)

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
        self.cancel_event_retry(key)
        self.event_retry_attempts.pop(key, None)
        self.metrics.forget_engine(namespace, name)

    def next_event_retry_delay(self, key: str, retry_after: float | None) -> float:
        """The delay before the next try of a failed Deployment event: handler_retry_delay_seconds,
        doubling per failed try up to event_retry_cap_seconds, with jitter; at least a Retry-After."""
        attempt = self.event_retry_attempts.get(key, 0)
        self.event_retry_attempts[key] = attempt + 1
        return self.client.backoff.escalating(attempt, self.client.rng, base=self.settings.handler_retry_delay_seconds,
                                              cap=self.settings.event_retry_cap_seconds, retry_after=retry_after)

    def handle_again(self, key: str, delay: float, job: Callable[[], Awaitable[None]], logger: Logger) -> None:
        """Run `job` in `delay` seconds, replacing a try already pending for `key`."""
        self.cancel_event_retry(key)

        async def later() -> None:
            await asyncio.sleep(delay)
            if self.event_retries.get(key) is asyncio.current_task():
                del self.event_retries[key]
            try:
                await job()
            except Exception:  # a bug, not the API: the log says so; nothing else would
                logger.exception("handling %s again failed", key)

        self.event_retries[key] = asyncio.create_task(later(), name=f"kvpilot handle-again {key}")

    def cancel_event_retry(self, key: str) -> None:
        task = self.event_retries.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def close(self) -> None:
        """Stop the pending tries (at shutdown: a restarted operator lists every Deployment anew)."""
        tasks = list(self.event_retries.values())
        self.event_retries.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def isvc_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return resource_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name, subresource)


def _engine_summary(engine: dict[str, Any] | None, against: dict[str, Any] | None) -> str:
    """The engine fields that differ, e.g. 'maxNumBatchedTokens=8192 (was 2048)'."""
    engine, against = engine or {}, against or {}
    parts = [f"{k}={engine.get(k)!r} (was {against.get(k)!r})"
             for k in sorted(set(engine) | set(against)) if engine.get(k) != against.get(k)]
    return ", ".join(parts) or "an unchanged engine"


def _degraded_only(reason: str, message: str, generation: int | None) -> ComputeStatus:
    return _decision(reason, message, generation, None)


def _decision(reason: str, message: str, generation: int | None, last_failure: dict[str, Any] | None) -> ComputeStatus:
    """A rollback's decision alone (Degraded with its reason for the generation, and lastFailure), written
    before the rollback's patch (docs/architecture.md, "The reconcile and its status writes")."""
    def compute(previous: dict[str, Any]) -> dict[str, Any]:
        status: dict[str, Any] = {"conditions": set_condition(previous.get("conditions"), DEGRADED, "True", reason,
                                                              message, generation, now_rfc3339())}
        if last_failure is not None:
            status["lastFailure"] = last_failure
        return status
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
                         pod_monitors="podmonitors" in served, prometheus_rules="prometheusrules" in served,
                         engine_run_as_user=settings.engine_run_as_user)


def usable_last_good(previous: dict[str, Any], logger: Logger) -> dict[str, Any] | None:
    """status.lastGoodEngine if this operator can still render it (one stored by an older operator may
    carry an extraArgs entry refused since): else None, nothing to roll back to."""
    last_good = previous.get("lastGoodEngine")
    if not last_good:
        return None
    try:
        EngineSpec.model_validate(last_good)
    except ValueError as exc:  # pydantic's ValidationError
        logger.warning("status.lastGoodEngine is no longer a valid engine, not rolled back to: %s", exc)
        return None
    return dict(last_good)


def _refused_in_force(rt: Runtime, parent: dict[str, Any], previous: dict[str, Any], generation: int) -> bool:
    """The engine a reconcile of this generation renders (lastGoodEngine once rolled back, else
    spec.engine) is outside the image allowlist: the reconcile refused it (Degraded/ImageNotAllowed)
    and a Deployment or pod event must not write over that with the Deployment it left running."""
    if not rt.settings.allowed_images.enforced:
        return False  # the common case: every Deployment event passes here, so no validation
    engine = parent.get("spec", {}).get("engine") or {}
    if rolled_back_at(previous, generation) and previous.get("lastGoodEngine"):
        engine = previous["lastGoodEngine"]
    try:
        return image_refusal(rt, EngineSpec.model_validate(engine)) is not None
    except ValueError:
        return False


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
        canary = await _reconcile_canary(rt, isvc, previous, options, new_object, emit, logger)
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
        return _degraded_only(REASON_APPLY_FAILED, str(exc), generation), "error", None
    except ApiError as exc:
        message = f"applying children failed: {exc}"
        emit("Warning", REASON_APPLY_FAILED, message)
        if exc.retriable:
            # The caller writes Degraded before kopf's retry, so the condition shows while we wait.
            raise RetryLater(message, retry_after=exc.retry_after) from exc
        return _degraded_only(REASON_APPLY_FAILED, message, generation), "error", None

    rt.metrics.set_engine(str(meta.get("namespace")), str(meta.get("name")), engine_info(rollout_of(deployment)))

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return with_canary(desired_status(generation=generation, previous=fresh, deployment=deployment), fresh,
                           canary, generation)

    return compute, "success", deployment


# --- the canary track (builders.canary) -----------------------------------------------------------------


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


async def _reconcile_canary(rt: Runtime, isvc: InferenceService, previous: dict[str, Any], options: RenderOptions,
                            new_object: bool, emit: Emit, logger: Logger) -> CanaryView:
    """Create or patch `<name>-canary` while the kvpilot.dev/canary annotation asks for one; delete
    it otherwise (level-triggered: a restarted operator resumes or cleans up from the annotation)."""
    request: CanaryRequest | None = None
    try:
        request = parse_canary(isvc.metadata.annotations)
        manifest = build_canary_deployment(isvc, request, options) if request is not None else None
    except InvalidCanary as exc:
        told = previous.get("canary") or {}
        if told.get("reason") != REASON_INVALID_CANARY or told.get("message") != str(exc):
            emit("Warning", REASON_INVALID_CANARY, f"{exc}; no canary runs")
        logger.warning("invalid canary annotation, no canary: %s", exc)
        view = CanaryView(asked=True, trial=exc.trial, invalid=str(exc))
        manifest = None
    else:
        view = CanaryView(asked=request is not None)
    if manifest is None or request is None:
        if not new_object:
            removed = await ensure_absent(rt.client, canary_ref(isvc))
            if removed is not None:
                why = "its annotation is not valid" if view.asked else f"the {ANNOTATION_CANARY} annotation is gone"
                emit("Normal", "Deleted", f"Deleted Deployment {removed.name} (canary: {why})")
                logger.info("deleted canary %s", removed.name)
        return view
    applied = await ensure(rt.client, manifest, likely_absent=new_object)
    if applied.action == "created":
        emit("Normal", "Created", f"Created Deployment {applied.name} (canary of trial {request.trial}; "
             f"it takes one replica's resources beyond spec.replicas)")
        logger.info("created canary %s of trial %d", applied.name, request.trial)
    elif applied.action == "updated":
        emit("Normal", "Updated", f"Updated Deployment {applied.name} (canary of trial {request.trial})")
    return CanaryView(asked=True, trial=request.trial, deployment=applied.live)


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
    owners = {ref.get("uid") for ref in deployment.get("metadata", {}).get("ownerReferences") or []
              if ref.get("controller")}
    request = _parent_canary(parent)
    if parent.get("metadata", {}).get("uid") not in owners or request is None or _trial_of(deployment) != request.trial:
        return False  # not ours, or a trial the reconcile is replacing or removing
    generation = (parent.get("status") or {}).get("observedGeneration")
    view = CanaryView(asked=True, trial=request.trial, deployment=deployment, problem=problem)

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return with_canary({}, fresh, view, generation)

    await update_status(rt, namespace, name, compute, parent=parent)
    return True


async def canary_deleted(rt: Runtime, deployment: dict[str, Any],
                         emit_on: Callable[[dict[str, Any], str, str, str], None], logger: Logger) -> None:
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
    except (ApiError, RetryLater) as exc:  # the next change of the object (or a restart) makes it
        logger.warning("canary of %s/%s not made again: %s", namespace, name, exc)


async def track_canary_pod(rt: Runtime, pod: dict[str, Any], emit_on: Callable[[dict[str, Any], str, str, str], None],
                           logger: Logger) -> None:
    """A canary pod changed: its engine failed (vLLM's start-up failure, a crash loop) or it cannot be
    scheduled -> a Warning Event and status.canary say so, in vLLM's words; the stable track is left
    alone.  A pod scheduled after all clears Unschedulable."""
    failure = engine_failure(pod, crash_loop_restarts=rt.settings.crash_loop_restarts)
    pending = unschedulable(pod) if failure is None else None
    conditions = {c.get("type"): c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    # Scheduled but not ready yet: the one time a pod event clears Unschedulable (once it is ready, the
    # canary Deployment's own event says Ready).
    scheduled = conditions.get("PodScheduled") == "True" and conditions.get("Ready") != "True"
    if failure is None and pending is None and not scheduled:
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


async def _track_canary_pod(rt: Runtime, namespace: str, name: str, pod: dict[str, Any], failure: EngineFailure | None,
                            pending: str | None, emit_on: Callable[[dict[str, Any], str, str, str], None],
                            logger: Logger) -> None:
    deployment = await rt.client.get_or_none(resource_path("apps/v1", "deployments", namespace, f"{name}{CANARY_SUFFIX}"))
    if deployment is None or pod_config_hash(pod) != rollout_of(deployment).config_hash:
        return  # a pod of a canary template already replaced
    parent = await rt.client.get_or_none(isvc_path(namespace, name))
    if parent is None:
        return
    told = (parent.get("status") or {}).get("canary") or {}
    trial = _trial_of(deployment)
    pod_name = str(pod.get("metadata", {}).get("name", ""))
    if failure is not None:
        if failure.cause_above:
            failure = await _with_log(rt, namespace, failure, logger)
        problem = (failure.reason, f"canary of trial {trial} failed: {failure.describe()}; "
                   "the stable track is left as it is")
    elif pending is not None:
        problem = (REASON_UNSCHEDULABLE, f"canary pod {pod_name} of trial {trial} cannot be scheduled: {pending}; "
                   f"{CAPACITY_NOTE}")
    else:
        if told.get("reason") != REASON_UNSCHEDULABLE:
            return  # scheduled, and nothing to clear
        problem = None
        parent = {**parent, "status": {**parent["status"], "canary": {**told, "reason": None}}}
    same = (told.get("reason") == (problem or ("",))[0] and told.get("trial") == trial
            and told.get("configHash") == rollout_of(deployment).config_hash)
    if not await _update_canary(rt, namespace, name, deployment, problem, logger, parent=parent):
        return
    if problem is not None and not same:
        emit_on(parent, "Warning", problem[0], problem[1])
        logger.warning("canary of %s/%s: %s", namespace, name, problem[1])


async def track_rollout(rt: Runtime, deployment: dict[str, Any], emit_on: Callable[[dict[str, Any], str, str, str], None],
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

    if _refused_in_force(rt, parent, previous, generation):
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
            failed = (f"rollout of configHash {rollout.config_hash} ({_engine_summary(rollout.engine, last_good)}) "
                      f"did not progress: {rollout.message or REASON_DEADLINE}")
            restored_hash = restored["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
            message = (f"{failed}; put lastGoodEngine back (configHash {restored_hash}); "
                       f"a new spec generation tries again")
            last_failure = _last_failure(REASON_DEADLINE, rollout.message or REASON_DEADLINE, rollout.config_hash,
                                         generation)
            if not rolled_back_at(previous, generation):
                # NOTE: the decision first, then the patch: an operator stopped between the two would
                # otherwise, restarted, render the failed engine again, since nothing in the status would
                # say this generation failed.  The write after the patch completes it.
                await update_status(rt, namespace, name,
                                    _decision(REASON_ROLLED_BACK, message, generation, last_failure), parent=parent)
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
        elif not last_good and not _engine_failure_said(previous, generation):
            degraded = (REASON_DEADLINE, f"rollout of configHash {rollout.config_hash} did not progress: "
                        f"{rollout.message or REASON_DEADLINE}; no lastGoodEngine to roll back to")
            old = find_condition(previous.get("conditions"), DEGRADED) or {}
            if old.get("reason") != REASON_DEADLINE:
                emit_on(parent, "Warning", REASON_DEADLINE, degraded[1])
                last_failure = _last_failure(REASON_DEADLINE, rollout.message or REASON_DEADLINE,
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
                           deployment: dict[str, Any], emit_on: Callable[[dict[str, Any], str, str, str], None],
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


# --- a new revision's engine failed: roll back at once ----------------------------------------------

# How much of a dead engine's log to read when its termination message names no root cause: vLLM V1's
# API-server traceback after the engine core's root cause is a few KiB (builders.pods).
LOG_TAIL_LINES = 400
LOG_LIMIT_BYTES = 256 * 1024


def _last_failure(reason: str, message: str, config_hash: str | None, generation: int | None,
                  pod: str | None = None) -> dict[str, Any]:
    failure: dict[str, Any] = {"reason": reason, "message": message, "configHash": config_hash,
                               "observedGeneration": generation, "time": now_rfc3339()}
    if pod is not None:
        failure["pod"] = pod
    return failure


async def _restore_last_good(rt: Runtime, parent: dict[str, Any],
                             last_good: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """Put the Deployment back on `last_good`: the Deployment as applied, and its config hash."""
    isvc = InferenceService.model_validate({k: v for k, v in parent.items() if k != "status"})
    options = render_options(rt.settings, await rt.discovery.served())
    restored = build_deployment(isvc, options, EngineSpec.model_validate(last_good))
    applied = await ensure(rt.client, restored)
    return applied.live, str(restored["metadata"]["annotations"][ANNOTATION_CONFIG_HASH])


async def _with_log(rt: Runtime, namespace: str, failure: EngineFailure, logger: Logger) -> EngineFailure:
    """The failure with its root cause read from the dead instance's log (as `kubectl logs [--previous]`)."""
    params = {"container": CONTAINER_NAME, "tailLines": str(LOG_TAIL_LINES), "limitBytes": str(LOG_LIMIT_BYTES)}
    if failure.previous:
        params["previous"] = "true"
    try:
        log = await rt.client.get_text(resource_path("v1", "pods", namespace, failure.pod, "log"), params)
    except ApiError as exc:  # the message's own line still says that it could not start
        logger.info("log of pod %s/%s not read: %s", namespace, failure.pod, exc)
        return failure
    return failure.with_log(log)


async def track_pod(rt: Runtime, pod: dict[str, Any], emit_on: Callable[[dict[str, Any], str, str, str], None],
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


def _engine_failure_said(previous: dict[str, Any], generation: int) -> bool:
    """Degraded already says, for this generation, why its engine cannot run (in the engine's words,
    which a later progress deadline would only replace with less)."""
    cond = find_condition(previous.get("conditions"), DEGRADED) or {}
    return (cond.get("status") == "True" and cond.get("reason") in ENGINE_FAILURE_REASONS
            and cond.get("observedGeneration") == generation)


def _already_told(previous: dict[str, Any], generation: int, config_hash: str | None) -> bool:
    """This generation was rolled back already, or its engine failure is on the status already."""
    if rolled_back_at(previous, generation):
        return True
    told = previous.get("lastFailure") or {}
    return _engine_failure_said(previous, generation) and told.get("configHash") == config_hash


async def _track_pod(rt: Runtime, namespace: str, name: str, failure: EngineFailure,
                     emit_on: Callable[[dict[str, Any], str, str, str], None], logger: Logger) -> None:
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
            or _refused_in_force(rt, parent, previous, generation):
        return
    if failure.cause_above:
        failure = await _with_log(rt, namespace, failure, logger)
    described = failure.describe()
    last_failure = _last_failure(failure.reason, described, failure.config_hash, generation, failure.pod)
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
        failed = f"rollout of configHash {rollout.config_hash} ({_engine_summary(rollout.engine, last_good)}) failed"
        if not pending:
            # The decision first, as at the progress deadline: an operator stopped (or an API failing)
            # between it and the patch leaves a status that says this generation is given up, so the
            # next reconcile renders lastGoodEngine, and the next event of this pod completes the patch.
            await update_status(rt, namespace, name, _decision(
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
