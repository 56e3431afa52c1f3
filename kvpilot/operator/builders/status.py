"""InferenceService status from its Deployment: conditions in Kubernetes style, replica counts,
the engine in force, and lastGoodEngine.  Pure functions: the handlers pass in what they read.

Conditions (type, status, reason, message, lastTransitionTime, observedGeneration):
- Ready: True when the rollout is complete (every desired replica runs the current config and is ready).
- Progressing: True while a rollout is under way; False with RolloutComplete or ProgressDeadlineExceeded.
- Degraded: True with InvalidSpec, ImageNotAllowed, RolledBack, RollbackFailed (the rollback's patch failed
  and is being tried again), ApplyFailed, or (nothing to roll back to) ProgressDeadlineExceeded,
  EngineStartupFailed or CrashLoopBackOff; else AsExpected.

status.lastFailure {reason, message, configHash, observedGeneration, pod, time} keeps the last failed
rollout in the engine's own words, for the tuner to grade the config it tried.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvpilot.api.conditions import find_condition, now_rfc3339, set_condition
from kvpilot.api.engine import format_value
from kvpilot.api.models import EngineSpec
from kvpilot.api.tuned import TUNED
from kvpilot.api.vocabulary import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_ENGINE,
    LABEL_INFERENCESERVICE,
    LABEL_TRACK,
    ConditionType,
    Reason,
)

READY, PROGRESSING, DEGRADED = ConditionType.READY.value, ConditionType.PROGRESSING.value, ConditionType.DEGRADED.value
# The condition types the operator writes. Every other type (the tuner's Tuning, SLOBurning) belongs
# to another writer: the functions below carry it over from the status they are given, untouched.
OWN_CONDITIONS = (READY, PROGRESSING, DEGRADED)
REASON_ROLLED_BACK = Reason.ROLLED_BACK.value
REASON_ROLLBACK_FAILED = Reason.ROLLBACK_FAILED.value
REASON_INVALID_SPEC = Reason.INVALID_SPEC.value
REASON_APPLY_FAILED = Reason.APPLY_FAILED.value
REASON_DEADLINE = Reason.PROGRESS_DEADLINE_EXCEEDED.value
REASON_COMPLETE = Reason.ROLLOUT_COMPLETE.value
# A pod of the new revision showed its engine cannot run (builders.pods).
ENGINE_FAILURE_REASONS = (Reason.ENGINE_STARTUP_FAILED.value, Reason.CRASH_LOOP_BACK_OFF.value)
REASON_IMAGE_NOT_ALLOWED = Reason.IMAGE_NOT_ALLOWED.value


@dataclass(frozen=True, slots=True)
class Rollout:
    """What a Deployment says about its rollout, read the way `kubectl rollout status` reads it."""

    exists: bool
    desired: int = 0
    replicas: int = 0
    updated: int = 0
    ready: int = 0
    available: int = 0
    observed: bool = False  # the Deployment controller has seen the current template
    complete: bool = False
    deadline_exceeded: bool = False
    message: str = ""
    config_hash: str | None = None
    engine: dict[str, Any] | None = None
    engine_args: tuple[str, ...] = ()
    selector: str | None = None  # of the pods its replicas count, as the scale subresource reports it

    def counts(self) -> str:
        return f"{self.updated}/{self.desired} updated, {self.ready}/{self.desired} ready"


def rollout_of(deployment: dict[str, Any] | None) -> Rollout:
    if not deployment:
        return Rollout(exists=False)
    meta = deployment.get("metadata", {})
    spec = deployment.get("spec", {})
    status = deployment.get("status") or {}
    desired = int(spec.get("replicas", 1))
    generation = meta.get("generation")
    observed_generation = status.get("observedGeneration")
    # Until the controller has observed the current generation, its counts describe the old template.
    observed = generation is None or (observed_generation is not None and observed_generation >= generation)
    replicas = int(status.get("replicas", 0))
    updated = int(status.get("updatedReplicas", 0)) if observed else 0
    ready = int(status.get("readyReplicas", 0))
    available = int(status.get("availableReplicas", ready))
    complete = observed and updated >= desired and ready >= desired and available >= desired and replicas <= desired
    deadline, message = False, ""
    for cond in status.get("conditions") or []:
        if cond.get("type") == PROGRESSING:
            message = str(cond.get("message", ""))
            deadline = observed and cond.get("status") == "False" and cond.get("reason") == REASON_DEADLINE
    annotations = meta.get("annotations") or {}
    engine = None
    if ANNOTATION_ENGINE in annotations:
        try:
            engine = json.loads(annotations[ANNOTATION_ENGINE])
        except ValueError:
            engine = None
    template = spec.get("template", {}) or {}
    containers = (template.get("spec", {}) or {}).get("containers") or [{}]
    args = tuple(containers[0].get("command", [])) + tuple(containers[0].get("args", []))
    return Rollout(
        exists=True, desired=desired, replicas=replicas, updated=updated, ready=ready, available=available,
        observed=observed, complete=complete and not deadline, deadline_exceeded=deadline, message=message,
        config_hash=annotations.get(ANNOTATION_CONFIG_HASH), engine=engine, engine_args=args,
        selector=scale_selector((template.get("metadata") or {}).get("labels") or {}),
    )


def scale_selector(pod_labels: dict[str, str]) -> str | None:
    """The label selector string of one track's pods (the InferenceService and track labels of its pod
    template), formatted as the API server formats a Deployment's scale selector: keys sorted."""
    wanted = {k: v for k, v in pod_labels.items() if k in (LABEL_INFERENCESERVICE, LABEL_TRACK)}
    if LABEL_INFERENCESERVICE not in wanted:
        return None
    return ",".join(f"{k}={wanted[k]}" for k in sorted(wanted))


def engine_info(rollout: Rollout) -> dict[str, str] | None:
    """kvpilot_engine_info's labels for the engine a Deployment runs (its pod template), with the values
    as they appear on the engine's command line; None when the Deployment carries no readable engine."""
    if rollout.engine is None or rollout.config_hash is None:
        return None
    try:
        engine = EngineSpec.model_validate(rollout.engine)
    except ValidationError:
        return None
    # Empty (no label) for a tuned field another overrides: gpuMemoryUtilization under kvCacheMemoryBytes.
    labels = {f.attr: "" if (value := engine.in_force(f)) is None else format_value(value) for f in TUNED}
    return {**labels, "config_hash": rollout.config_hash}


def rolled_back_at(previous: dict[str, Any] | None, generation: int | None) -> bool:
    """Whether this generation's engine was given up (so the operator keeps lastGoodEngine): rolled
    back, or being rolled back (RollbackFailed: the patch failed and is tried again)."""
    cond = find_condition((previous or {}).get("conditions"), DEGRADED)
    return bool(cond and cond.get("status") == "True"
                and cond.get("reason") in (REASON_ROLLED_BACK, REASON_ROLLBACK_FAILED)
                and cond.get("observedGeneration") == generation)


def _kept_degraded(previous: dict[str, Any], generation: int | None, rollout: Rollout) -> tuple[str, str] | None:
    """A Degraded this generation keeps until the spec changes: RolledBack (and RollbackFailed until
    the rollback holds); and an engine that could
    not start with nothing to roll back to (EngineStartupFailed, CrashLoopBackOff), until its
    rollout completes after all.  Only the pod watch sees these, so a Deployment event must not clear them."""
    kept = find_condition(previous.get("conditions"), DEGRADED) or {}
    if kept.get("status") != "True" or kept.get("observedGeneration") != generation:
        return None
    reason = kept.get("reason")
    if reason == REASON_ROLLBACK_FAILED:
        good = previous.get("lastGoodEngine")
        if good is not None and rollout.engine == good:
            # A failed rollback patch that has since held (a later reconcile rendered lastGoodEngine).
            return (REASON_ROLLED_BACK, f"put lastGoodEngine back (configHash {rollout.config_hash}) after "
                    "a failed attempt; a new spec generation tries again")
        return str(reason), str(kept.get("message", ""))
    if reason == REASON_ROLLED_BACK or (reason in ENGINE_FAILURE_REASONS and not rollout.complete):
        return str(reason), str(kept.get("message", ""))
    return None


def desired_status(*, generation: int | None, previous: dict[str, Any] | None, deployment: dict[str, Any] | None,
                   degraded: tuple[str, str] | None = None, last_failure: dict[str, Any] | None = None,
                   now: str | None = None) -> dict[str, Any]:
    """The status an InferenceService should show, given its Deployment as it is now.  `previous` is
    the status as last read; its conditions of types the operator does not own are kept as they are.
    `last_failure` (a failed rollout just handled) replaces status.lastFailure; else it stays as it is."""
    now = now or now_rfc3339()
    previous = previous or {}
    rollout = rollout_of(deployment)
    conditions = [dict(c) for c in previous.get("conditions") or [] if isinstance(c, dict)]

    if not rollout.exists:
        ready = ("False", "DeploymentMissing", "the engine Deployment does not exist yet")
        progressing = ("True", "Creating", "creating the engine Deployment")
    elif rollout.complete:
        what = "scaled to zero" if rollout.desired == 0 else f"all {rollout.desired} replicas updated and ready"
        ready = ("True", REASON_COMPLETE, f"{what} (configHash {rollout.config_hash})")
        progressing = ("False", REASON_COMPLETE, f"{what} (configHash {rollout.config_hash})")
    elif rollout.deadline_exceeded:
        ready = ("False", REASON_DEADLINE, rollout.counts())
        progressing = ("False", REASON_DEADLINE, rollout.message or "the rollout passed its progress deadline")
    else:
        ready = ("False", "RollingOut", rollout.counts())
        progressing = ("True", "RollingOut", f"rolling out configHash {rollout.config_hash}: {rollout.counts()}")

    if degraded is None:
        degraded = _kept_degraded(previous, generation, rollout)
    conditions = set_condition(conditions, READY, *ready, generation, now)
    conditions = set_condition(conditions, PROGRESSING, *progressing, generation, now)
    if degraded is not None:
        conditions = set_condition(conditions, DEGRADED, "True", degraded[0], degraded[1], generation, now)
    else:
        conditions = set_condition(conditions, DEGRADED, "False", Reason.AS_EXPECTED.value, "", generation, now)

    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": conditions,
        "replicas": rollout.replicas,
        "readyReplicas": rollout.ready,
        "updatedReplicas": rollout.updated,
        "availableReplicas": rollout.available,
    }
    if rollout.selector is not None:
        status["selector"] = rollout.selector
    if rollout.exists:
        status["engineArgs"] = list(rollout.engine_args)
        status["configHash"] = rollout.config_hash
    if last_failure is not None:
        status["lastFailure"] = last_failure
    if rollout.complete and rollout.engine is not None:
        status["lastGoodEngine"] = rollout.engine
    elif previous.get("lastGoodEngine") is not None:
        status["lastGoodEngine"] = previous["lastGoodEngine"]
    return status


def invalid_status(*, generation: int | None, previous: dict[str, Any] | None, message: str,
                   now: str | None = None, reason: str = REASON_INVALID_SPEC) -> dict[str, Any]:
    """Status for an object the operator refuses (failed validation: InvalidSpec; an image outside the
    allowlist: ImageNotAllowed): nothing deployed or changed, Degraded with the reason (Ready and
    Progressing only, in a generation rolled back)."""
    now = now or now_rfc3339()
    conditions = [dict(c) for c in (previous or {}).get("conditions") or [] if isinstance(c, dict)]
    conditions = set_condition(conditions, READY, "False", reason, message, generation, now)
    conditions = set_condition(conditions, PROGRESSING, "False", reason,
                               "nothing deployed or changed until the spec is fixed", generation, now)
    if not rolled_back_at(previous, generation):
        # A generation given up keeps its Degraded RolledBack/RollbackFailed: the next reconcile renders
        # lastGoodEngine only while it stands, and the tuner reads the trial as failed from it.
        conditions = set_condition(conditions, DEGRADED, "True", reason, message, generation, now)
    return {"observedGeneration": generation, "conditions": conditions}


def status_patch(previous: dict[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any]:
    """Top-level status keys whose value changes (a merge patch); empty when nothing changes."""
    previous = previous or {}
    return {k: v for k, v in desired.items() if previous.get(k) != v}
