"""The reconcile of a created, changed or resumed InferenceService (`reconcile_service`): the ordered
steps of `STEPS` (validate, render, create or patch the children), then its status write."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.api.vocabulary import Reason
from kvpilot.operator.apply import NotOwned, ensure, ensure_absent
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.monitoring import MONITOR_PLURALS
from kvpilot.operator.builders.render import render_manifests, unwanted_monitors, wanted_monitor
from kvpilot.operator.builders.scaling import deployment_replicas, replicas_writer, scaled_message
from kvpilot.operator.builders.service import build_pdb, wants_pdb
from kvpilot.operator.builders.status import (
    DEGRADED,
    READY,
    REASON_APPLY_FAILED,
    REASON_IMAGE_NOT_ALLOWED,
    REASON_INVALID_SPEC,
    REASON_ROLLED_BACK,
    desired_status,
    engine_info,
    find_condition,
    invalid_status,
    rolled_back_at,
    rollout_of,
)
from kvpilot.operator.kube import ApiError
from kvpilot.operator.reconcile.canary import CanaryView, reconcile_canary, with_canary
from kvpilot.operator.reconcile.common import image_refusal, render_options
from kvpilot.operator.reconcile.runtime import Emit, Logger, Runtime
from kvpilot.operator.reconcile.status import ComputeStatus, apply_failed, update_status


@dataclass
class Pass:
    """One reconcile of one InferenceService: what its steps read, what they found so far, and the
    outcome (the status to write and the result for the metrics) once a step ends the pass."""

    rt: Runtime
    body: dict[str, Any]
    emit: Emit
    logger: Logger
    previous: dict[str, Any] = field(init=False)
    isvc: InferenceService | None = None  # the spec, once valid
    # lastGoodEngine while this generation stays rolled back; None renders spec.engine.
    engine: EngineSpec | None = None
    served: frozenset[str] = frozenset()
    options: RenderOptions | None = None
    deployment: dict[str, Any] | None = None  # the Deployment as applied
    restored: bool = False  # this pass put lastGoodEngine back: it completed a rollback
    canary: CanaryView = field(default_factory=lambda: CanaryView(asked=False))
    compute: ComputeStatus | None = None
    result: str = "error"

    def __post_init__(self) -> None:
        self.previous = dict(self.body.get("status") or {})

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.body.get("metadata", {}))

    @property
    def namespace(self) -> str:
        return str(self.meta.get("namespace"))

    @property
    def name(self) -> str:
        return str(self.meta.get("name"))

    @property
    def generation(self) -> int | None:
        return self.meta.get("generation")

    @property
    def new_object(self) -> bool:
        """Never reconciled (no status yet): its children almost surely do not exist."""
        return self.previous.get("observedGeneration") is None

    @property
    def spec(self) -> InferenceService:
        if self.isvc is None:
            raise RuntimeError("a reconcile step ran before validate")
        return self.isvc

    @property
    def render(self) -> RenderOptions:
        if self.options is None:
            raise RuntimeError("a reconcile step ran before discover")
        return self.options

    def end(self, compute: ComputeStatus, result: str) -> bool:
        """End the pass with this status to write: False, for the step to return."""
        self.compute, self.result = compute, result
        return False


# A step does one thing and returns whether the pass goes on (False: it set the outcome).
Step = Callable[[Pass], Awaitable[bool]]


async def validate(p: Pass) -> bool:
    """An invalid spec is said (Degraded InvalidSpec, a Warning Event once) and nothing is changed."""
    issues = validate_object({k: v for k, v in p.body.items() if k != "status"})
    if not issues:
        p.isvc = InferenceService.model_validate({k: v for k, v in p.body.items() if k != "status"})
        return True
    message = "; ".join(str(issue) for issue in issues)
    if not _refusal_said(p.previous, REASON_INVALID_SPEC, message):
        p.emit("Warning", REASON_INVALID_SPEC, message)
    p.logger.warning("invalid spec, nothing deployed or changed: %s", message)
    generation = p.generation
    return p.end(lambda fresh: invalid_status(generation=generation, previous=fresh, message=message), "invalid")


async def keep_last_good(p: Pass) -> bool:
    """This generation already failed its rollout: keep the last good engine until the spec changes."""
    if rolled_back_at(p.previous, p.generation) and p.previous.get("lastGoodEngine"):
        p.engine = EngineSpec.model_validate(p.previous["lastGoodEngine"])
    return True


async def check_image(p: Pass) -> bool:
    """An engine image outside the allowlist is said (Degraded ImageNotAllowed) and nothing is changed."""
    refusal = (image_refusal(p.rt, p.spec.spec.engine) if p.engine is None
               else image_refusal(p.rt, p.engine, "status.lastGoodEngine.image"))
    if refusal is None:
        return True
    if not _refusal_said(p.previous, REASON_IMAGE_NOT_ALLOWED, refusal):
        p.emit("Warning", REASON_IMAGE_NOT_ALLOWED, refusal)
    p.logger.warning("image not allowed, nothing deployed or changed: %s", refusal)
    generation = p.generation
    return p.end(lambda fresh: invalid_status(generation=generation, previous=fresh, message=refusal,
                                              reason=REASON_IMAGE_NOT_ALLOWED), "invalid")


async def discover(p: Pass) -> bool:
    """The monitoring kinds the cluster serves (the render options); an Event, once, for those it does not."""
    p.served = await p.rt.discovery.served()
    p.options = render_options(p.rt.settings, p.served)
    missing = _unserved_kinds(p.spec, p.served)
    if missing and p.spec.metadata.uid not in p.rt.skip_noted:
        p.rt.skip_noted.add(str(p.spec.metadata.uid))
        p.emit("Normal", "MonitoringSkipped",
               f"the cluster does not serve monitoring.coreos.com/v1 {', '.join(missing)}; "
               f"not creating {' or '.join(missing)} (install the Prometheus Operator CRDs to get them)")
    return True


async def apply_children(p: Pass) -> bool:
    """Create or patch each rendered child; the Deployment as applied is kept for the status."""
    # One Created Event naming every child created in this pass (a new object's three or four
    # Events would be the bulk of its API calls), posted even if a later child fails.
    created: list[str] = []
    try:
        for manifest in render_manifests(p.spec, p.render, p.engine):
            applied = await ensure(p.rt.client, manifest, likely_absent=p.new_object)
            what = f"{applied.kind} {applied.name}"
            if applied.action == "created":
                created.append(what)
                p.logger.info("created %s", what)
            elif applied.action == "updated":
                changed = ", ".join(applied.changed[:6]) + (" ..." if len(applied.changed) > 6 else "")
                p.emit("Normal", "Updated", f"Updated {what}: {changed}")
                p.logger.info("updated %s: %s", what, changed)
            if manifest["kind"] == "Deployment":
                p.deployment = applied.live
                if applied.action == "updated":
                    _say_scaled(p, applied.before, applied.live)
                # A rollback decided (its status written) whose own patch never held: the operator
                # stopped in between, or the patch failed (RollbackFailed) and this pass came first.
                p.restored = (p.engine is not None and applied.action == "updated"
                              and rollout_of(applied.before).engine != rollout_of(applied.live).engine)
    finally:
        if created:
            p.emit("Normal", "Created", f"Created {', '.join(created)}")
    return True


async def apply_canary(p: Pass) -> bool:
    """The canary Deployment as the kvpilot.dev/canary annotation asks (canary.py)."""
    p.canary = await reconcile_canary(p.rt, p.spec, p.previous, p.render, p.new_object, p.emit, p.logger)
    return True


async def remove_pdb(p: Pass) -> bool:
    """No PodDisruptionBudget at replicas <= 1."""
    if not wants_pdb(p.spec):
        removed = await ensure_absent(p.rt.client, build_pdb(p.spec))
        if removed is not None:
            p.emit("Normal", "Deleted", f"Deleted PodDisruptionBudget {removed.name} (replicas <= 1)")
    return True


async def remove_stale_monitors(p: Pass) -> bool:
    """A monitor of another kind than spec.observability.monitor asks for is deleted."""
    # One exists only after spec.observability.monitor changed: look for one when the spec
    # generation moved on, not on every resync.
    if p.new_object or p.previous.get("observedGeneration") == p.generation:
        return True
    for stale in unwanted_monitors(p.spec, p.render):
        removed = await ensure_absent(p.rt.client, stale)
        if removed is not None:
            p.emit("Normal", "Deleted", f"Deleted {removed.kind} {removed.name} "
                   f"(spec.observability.monitor is {p.spec.spec.observability.monitor})")
    return True


async def say_applied(p: Pass) -> bool:
    """The status from the Deployment and the canary as applied; the engine in force in the metrics."""
    p.rt.metrics.set_engine(p.namespace, p.name, engine_info(rollout_of(p.deployment)))
    generation, deployment, canary = p.generation, p.deployment, p.canary
    degraded = _put_back(p) if p.restored else None

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return with_canary(desired_status(generation=generation, previous=fresh, deployment=deployment,
                                          degraded=degraded), fresh, canary, generation)

    return p.end(compute, "success")


def _say_scaled(p: Pass, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
    """A Scaled Event when the Deployment's replicas followed a new spec.replicas: from, to, and who
    wrote it (kubectl, an HPA, KEDA), so `kubectl describe` tells why the count changed."""
    was, now = deployment_replicas(before), deployment_replicas(after)
    if was is None or now is None or was == now:
        return
    message = scaled_message(was, now, replicas_writer(p.meta))
    p.emit("Normal", Reason.SCALED.value, message)
    p.logger.info("%s", message)


def _put_back(p: Pass) -> tuple[str, str]:
    """This pass completed a rollback: counted, said (a RolledBack Event) and Degraded RolledBack, as
    when the rollback's own patch holds; lastFailure, written with the decision, stays."""
    failure = p.previous.get("lastFailure") or {}
    what = (f"rollout of configHash {failure.get('configHash')} failed ({failure.get('reason')}: "
            f"{failure.get('message')})"
            if failure.get("observedGeneration") == p.generation else f"generation {p.generation} was given up")
    message = (f"{what}; put lastGoodEngine back (configHash {rollout_of(p.deployment).config_hash}) after the "
               "rollback's own patch did not hold; a new spec generation tries again")
    p.rt.metrics.rollbacks.inc()
    p.emit("Warning", REASON_ROLLED_BACK, message)
    p.logger.warning("rolled back %s/%s: %s", p.namespace, p.name, message)
    return REASON_ROLLED_BACK, message


# The reconcile, in order (KubeRay's reconcileFuncs): each step runs only if the one before went on.
STEPS: tuple[Step, ...] = (
    validate,
    keep_last_good,
    check_image,
    discover,
    apply_children,
    apply_canary,
    remove_pdb,
    remove_stale_monitors,
    say_applied,
)


async def run_steps(p: Pass, steps: tuple[Step, ...] = STEPS) -> ComputeStatus:
    """Run the steps until one ends the pass: the status to write (p.result says how it went).  A child
    not ours, or the API failing, ends it Degraded ApplyFailed; a transient failure raises kopf.TemporaryError."""
    try:
        for step in steps:
            if not await step(p):
                break
    except NotOwned as exc:
        p.emit("Warning", REASON_APPLY_FAILED, str(exc))
        p.deployment = None
        p.end(apply_failed(str(exc), p.generation), "error")
    except ApiError as exc:
        message = f"applying children failed: {exc}"
        p.emit("Warning", REASON_APPLY_FAILED, message)
        # A 403 is retried too: kube-apiserver answers it for a few seconds after it restarts, before its
        # RBAC caches fill (a chaos run lost an engine change so); one that lasts stays in Degraded.
        if exc.retriable or exc.status == 403:
            # The caller writes Degraded before kopf's retry, so the condition shows while we wait.
            raise p.rt.retry_later(message, exc.retry_after) from exc
        p.deployment = None
        p.end(apply_failed(message, p.generation), "error")
    if p.compute is None:
        raise RuntimeError("the reconcile's last step ends the pass")
    return p.compute


async def reconcile_service(rt: Runtime, body: dict[str, Any], emit: Emit, logger: Logger) -> None:
    """Reconcile one InferenceService and write its status (raises kopf.TemporaryError on transient failures)."""
    started = time.perf_counter()
    p = Pass(rt, body, emit, logger)
    try:
        async with rt.lock_for(p.namespace, p.name):
            rt.status_basis.pop(f"{p.namespace}/{p.name}", None)
            await _reconcile_and_write(p)
    except kopf.TemporaryError:
        p.result = "retry"
        raise
    finally:
        rt.metrics.duration.observe(time.perf_counter() - started)
        rt.metrics.reconciles.labels(result=p.result).inc()


async def _reconcile_and_write(p: Pass) -> None:
    """The steps, then the status write; the Deployment the status was computed from is its basis."""
    try:
        compute = await run_steps(p)
    except kopf.TemporaryError as exc:
        p.result = "retry"
        await _write_status(p, apply_failed(str(exc), p.generation))
        raise
    if await _write_status(p, compute) and p.deployment is not None:
        version = p.deployment.get("metadata", {}).get("resourceVersion")
        if version is not None:
            p.rt.status_basis[f"{p.namespace}/{p.name}"] = str(version)


async def _write_status(p: Pass, compute: ComputeStatus) -> bool:
    """True once the status is written (or already was as computed)."""
    try:
        await update_status(p.rt, p.namespace, p.name, compute, parent=p.body)
        return True
    except ApiError as exc:
        # A 403 past the client's tries too (RBAC not yet synced after a restart): dropped, the status
        # would keep the old observedGeneration until some later change (a chaos run saw it for 240 s).
        if exc.retriable or exc.status == 403:
            raise p.rt.retry_later(f"writing the status failed: {exc}", exc.retry_after) from exc
        p.logger.warning("status of %s/%s not written: %s", p.namespace, p.name, exc)
        return False


def _refusal_said(previous: dict[str, Any], reason: str, message: str) -> bool:
    """The status says this refusal already (its Event was posted): on Degraded, or on Ready where a
    generation rolled back keeps its Degraded (invalid_status)."""
    return any((cond := find_condition(previous.get("conditions"), type_) or {}).get("reason") == reason
               and cond.get("message") == message for type_ in (DEGRADED, READY))


def _unserved_kinds(isvc: InferenceService, served: frozenset[str]) -> list[str]:
    """The monitoring kinds this InferenceService asks for that the cluster does not serve."""
    wanted = {"prometheusrules": "PrometheusRule"}
    monitor = wanted_monitor(isvc)
    if monitor is not None:
        wanted = {MONITOR_PLURALS[monitor]: monitor.value, **wanted}
    return [kind for plural, kind in wanted.items() if plural not in served]
