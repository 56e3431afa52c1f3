"""The kubernetes applier: change an InferenceService's tuned engine fields, wait on the operator.

`KubernetesApplier` (and `KubernetesCanaryApplier`): server-side apply under the field manager
`kvpilot-tuner`, then the operator's status says the rollout is complete or gave the config up. Details:
docs/architecture.md, "The tuner in a cluster".
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import uuid
from typing import Any, cast

from kvpilot.api.conditions import find_condition, now_rfc3339, set_condition
from kvpilot.api.models import EngineSpec
from kvpilot.api.tuned import TUNED
from kvpilot.api.vocabulary import (
    ANNOTATION_CANARY,
    ANNOTATION_TUNING_TRIAL,
    API_VERSION,
    FIELD_MANAGER_TUNER,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ConditionType,
    Reason,
    TuningPhase,
)
from kvpilot.tuner.core.fleetsize import Replicas
from kvpilot.tuner.core.gate import Closed
from kvpilot.tuner.core.loop import ApplyFailed, Observer
from kvpilot.tuner.core.objective import Outcome
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import Incumbent
from kvpilot.tuner.kubeapi import ApiError, KubeAPI, resource_path

log = logging.getLogger(__name__)

FIELD_MANAGER = FIELD_MANAGER_TUNER


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return {}


# Degraded reasons that end a rollout: the operator rolled the config back, or its engine cannot run.
_GAVE_UP = (Reason.ROLLED_BACK, Reason.ENGINE_STARTUP_FAILED, Reason.CRASH_LOOP_BACK_OFF)
# status.lastFailure reasons whose message is the engine's own (the others keep "RolloutFailed").
_ENGINE_FAILED = (Reason.ENGINE_STARTUP_FAILED, Reason.CRASH_LOOP_BACK_OFF)


def failure_of(obj: dict[str, Any], generation: int, message: str) -> ApplyFailed:
    """The failed rollout of `generation`, in the engine's words where status.lastFailure has them."""
    last = (obj.get("status") or {}).get("lastFailure") or {}
    if last.get("observedGeneration") == generation and last.get("reason") in _ENGINE_FAILED:
        return ApplyFailed(str(last["reason"]), str(last.get("message") or message))
    return ApplyFailed("RolloutFailed", message)


def rollout_state(obj: dict[str, Any], generation: int) -> tuple[str, str]:
    """('complete' | 'failed' | 'progressing', message) for the rollout of `generation`."""
    status = obj.get("status") or {}
    if int(status.get("observedGeneration") or 0) < generation:
        return "progressing", f"the operator has not seen generation {generation} yet"
    degraded = _condition(obj, ConditionType.DEGRADED)
    if degraded.get("status") == "True" and degraded.get("reason") in _GAVE_UP:
        return "failed", degraded.get("message", "rolled back")
    prog = _condition(obj, ConditionType.PROGRESSING)
    if prog.get("reason") == Reason.ROLLOUT_COMPLETE and prog.get("status") == "False":
        want = int((obj.get("spec") or {}).get("replicas") or 1)
        if (int(status.get("updatedReplicas") or 0) >= want and int(status.get("readyReplicas") or 0) >= want):
            return "complete", prog.get("message", "")
    if prog.get("reason") == Reason.PROGRESS_DEADLINE_EXCEEDED:
        return "failed", prog.get("message", "progress deadline exceeded")
    return "progressing", prog.get("message", "")


class KubernetesApplier:
    def __init__(self, api: KubeAPI, namespace: str, name: str, *, timeout_s: float = 3600.0,
                 poll_s: float = 2.0) -> None:
        self.api = api
        self.namespace, self.name = namespace, name
        self.path = resource_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name)
        self.timeout_s, self.poll_s = timeout_s, poll_s

    def get(self) -> dict[str, Any]:
        return cast(dict[str, Any], self.api.get(self.path))

    def current(self) -> EngineParams:
        """The tuned fields in force: the spec's, with the API's defaults for those it leaves out."""
        engine = EngineSpec.model_validate((self.get().get("spec") or {}).get("engine") or {})
        # A field another overrides (gpuMemoryUtilization under kvCacheMemoryBytes) reads 0.
        return EngineParams.from_spec({f.name: engine.in_force(f) or 0 for f in TUNED})

    def replicas(self) -> Replicas | None:
        """FleetSize: spec.replicas and the stable Deployment's ready replicas (status.readyReplicas, as
        the operator copies them); None when the object cannot be read (a window is never left out on
        a reading that failed)."""
        try:
            obj = self.get()
        except Exception as exc:
            log.warning("reading the replica count of %s/%s failed: %s", self.namespace, self.name, exc)
            return None
        desired = (obj.get("spec") or {}).get("replicas")
        ready = (obj.get("status") or {}).get("readyReplicas")
        return Replicas(int(desired if desired is not None else 1), int(ready or 0))

    def body(self, params: EngineParams, trial: int | None) -> dict[str, Any]:
        """The server-side apply body: the tuned fields and the trial annotation, nothing else."""
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        meta["annotations"] = {ANNOTATION_TUNING_TRIAL: "restore" if trial is None else str(trial)}
        return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                "spec": {"engine": params.as_spec()}}

    def apply(self, params: EngineParams, trial: int | None) -> None:
        try:
            obj = cast(dict[str, Any], self.api.apply(self.path, self.body(params, trial),
                                                      field_manager=FIELD_MANAGER, force=True))
        except ApiError as exc:
            if exc.status == 422:  # the API (or its admission) refused the config
                raise ApplyFailed("Invalid", f"{exc.reason}: {exc.message}"[:300]) from None
            raise
        generation = int(obj["metadata"].get("generation") or 0)
        deadline = time.monotonic() + self.timeout_s
        while True:
            obj = self.get()
            state, message = rollout_state(obj, generation)
            if state == "complete":
                return
            if state == "failed":
                raise failure_of(obj, generation, message)
            if time.monotonic() >= deadline:
                raise ApplyFailed("RolloutTimeout", f"not complete after {self.timeout_s:g}s: {message}")
            time.sleep(self.poll_s)


class KubernetesCanaryApplier(KubernetesApplier):
    """Canary trials through the operator: the `kvpilot.dev/canary` annotation asks it for `<name>-canary`,
    a one-replica Deployment of the trial engine beside the stable one, in the same Service; removing
    the annotation ends it.  status.canary says when its pod serves (Ready) or why it cannot
    (Failed, in vLLM's words where the engine gave them).  Promotion is `apply` (the tuned fields on
    spec.engine, a rolling update of the stable track), then `stop_canary`."""

    def _annotate(self, value: str | None) -> None:
        # A merge patch of the one annotation: the tuner's server-side apply body keeps its fields.
        self.api.merge_patch(self.path, {"metadata": {"annotations": {ANNOTATION_CANARY: value}}},
                             field_manager=FIELD_MANAGER)

    def start_canary(self, params: EngineParams, trial: int) -> None:
        request = {"trial": trial, "engine": params.as_spec()}
        self._annotate(json.dumps(request, separators=(",", ":"), sort_keys=True))
        deadline = time.monotonic() + self.timeout_s
        while True:
            canary = (self.get().get("status") or {}).get("canary") or {}
            if canary.get("trial") == trial:
                if canary.get("phase") == "Ready":
                    return
                if canary.get("phase") == "Failed":
                    self.stop_canary()
                    raise ApplyFailed(str(canary.get("reason") or "CanaryFailed"),
                                      str(canary.get("message") or "the canary could not start")[:1000])
            if time.monotonic() >= deadline:
                self.stop_canary()
                raise ApplyFailed("CanaryTimeout", f"the canary of trial {trial} did not serve within "
                                  f"{self.timeout_s:g}s: {canary.get('message') or 'no status yet'}")
            time.sleep(self.poll_s)

    def stop_canary(self) -> None:
        """Remove the annotation (idempotent); the operator deletes `<name>-canary`, whose pods drain as
        any engine pod does (preStop, then vLLM's shutdown timeout)."""
        annotations = (self.get().get("metadata") or {}).get("annotations") or {}
        if ANNOTATION_CANARY in annotations:
            self._annotate(None)


# Phases in which no trial is under way: the Tuning condition is False in them.
_AT_REST = frozenset({TuningPhase.PAUSED, TuningPhase.DONE, TuningPhase.FAILED, TuningPhase.IDLE})


class KubeStatusObserver(Observer):
    """status.tuning on the InferenceService, and one Event per trial."""

    def __init__(self, api: KubeAPI, namespace: str, name: str, study: str) -> None:
        self.api = api
        self.path = resource_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name)
        self.namespace, self.name, self.study = namespace, name, study
        self.trial: int | None = None

    def _status(self, patch: dict[str, Any]) -> None:
        try:
            self.api.merge_patch(self.path + "/status", {"status": {"tuning": {"study": self.study, **patch}}},
                                 field_manager=FIELD_MANAGER)
        except Exception as exc:  # status is best effort: never stop tuning for it
            log.warning("could not write status.tuning of %s/%s: %s", self.namespace, self.name, exc)

    def event(self, type_: str, reason: str, message: str) -> None:
        try:
            obj = cast(dict[str, Any], self.api.get(self.path))
        except ApiError as exc:
            log.warning("could not post an Event for %s/%s: %s", self.namespace, self.name, exc)
            return
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{self.name}.{uuid.uuid4().hex[:12]}", "namespace": self.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": self.name,
                               "namespace": self.namespace, "uid": obj["metadata"].get("uid")},
            "reason": reason, "message": message[:1024], "type": type_, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "reportingComponent": FIELD_MANAGER,
            "source": {"component": FIELD_MANAGER},
        }
        try:
            self.api.create(resource_path("v1", "events", self.namespace), ev, field_manager=FIELD_MANAGER)
        except Exception as exc:
            log.warning("could not post an Event for %s/%s: %s", self.namespace, self.name, exc)

    def phase(self, phase: TuningPhase, reason: str, message: str) -> None:
        patch: dict[str, Any] = {"tuning": {"study": self.study, "phase": phase.value, "reason": reason,
                                            "trial": self.trial, "message": f"{reason}: {message}"}}
        conditions = self._tuning_condition(phase, reason, message)
        if conditions is not None:
            patch["conditions"] = conditions
        try:
            self.api.merge_patch(self.path + "/status", {"status": patch}, field_manager=FIELD_MANAGER)
        except Exception as exc:  # status is best effort: never stop tuning for it
            log.warning("could not write status.tuning of %s/%s: %s", self.namespace, self.name, exc)

    def _tuning_condition(self, phase: TuningPhase, reason: str, message: str) -> list[dict[str, Any]] | None:
        """status.conditions with the Tuning condition as `phase` says (True while trials run, False
        while paused, done, failed or stopped), or None when it already says so.  The list is read
        just before: the operator's Ready/Progressing/Degraded entries are carried over as they are."""
        status = "False" if phase in _AT_REST else "True"
        try:
            obj = cast(dict[str, Any], self.api.get(self.path))
        except Exception as exc:
            log.warning("could not read %s/%s for its Tuning condition: %s", self.namespace, self.name, exc)
            return None
        current = list((obj.get("status") or {}).get("conditions") or [])
        old = find_condition(current, ConditionType.TUNING.value) or {}
        text = message[:1024]
        if (old.get("status"), old.get("reason"), old.get("message")) == (status, reason, text):
            return None
        return set_condition(current, ConditionType.TUNING.value, status, reason, text,
                             (obj.get("metadata") or {}).get("generation"), now_rfc3339())

    def gate_changed(self, closed: Closed | None) -> None:
        if closed is None:
            self.event("Normal", "TuningResumed", "the budget gate is open again: trials resume")
        else:
            self.event("Normal", closed.reason, f"trials held back: {closed.message}")

    def trial_started(self, number: int, params: EngineParams, kind: str) -> None:
        self.trial = number
        self.event("Normal", "TrialStarted", f"trial {number} ({kind}): {params.label()}")

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None:
        detail = f": {outcome.reason}, value {outcome.value:.4g}" if outcome else ""
        type_ = "Normal" if state == "complete" else "Warning"
        reason = {"complete": "TrialComplete", "pruned": "TrialPruned", "infeasible": "TrialInfeasible"}.get(
            state, "TrialFinished")
        self.event(type_, reason, f"trial {number} {state}{detail} ({params.label()})")

    def best_changed(self, incumbent: Incumbent) -> None:
        self._status({"best": {"trial": incumbent.trial, "value": incumbent.value,
                               "params": incumbent.params.as_spec()}})
