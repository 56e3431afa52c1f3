"""The InferenceService's status as the operator writes it: `update_status` (read-modify-write with
the resourceVersion), and the pieces of status a rollback decides (`decision`, `last_failure`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpilot.api.vocabulary import GROUP, PLURAL, VERSION
from kvpilot.operator.builders.status import (
    DEGRADED,
    PROGRESSING,
    REASON_APPLY_FAILED,
    now_rfc3339,
    rolled_back_at,
    set_condition,
    status_patch,
)
from kvpilot.operator.kube import ApiError, resource_path
from kvpilot.operator.reconcile.runtime import Runtime

# new status (the keys the operator owns) from the status as last read; the conditions it returns
# keep every condition type of the one it was given that the operator does not own.
ComputeStatus = Callable[[dict[str, Any]], dict[str, Any]]

# Reads and recomputations of one status write when others keep writing in between.
STATUS_CONFLICT_ATTEMPTS = 5


def isvc_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return resource_path(f"{GROUP}/{VERSION}", PLURAL, namespace, name, subresource)


def engine_summary(engine: dict[str, Any] | None, against: dict[str, Any] | None) -> str:
    """The engine fields that differ, e.g. 'maxNumBatchedTokens=8192 (was 2048)'."""
    engine, against = engine or {}, against or {}
    parts = [f"{k}={engine.get(k)!r} (was {against.get(k)!r})"
             for k in sorted(set(engine) | set(against)) if engine.get(k) != against.get(k)]
    return ", ".join(parts) or "an unchanged engine"


def degraded_only(reason: str, message: str, generation: int | None) -> ComputeStatus:
    return decision(reason, message, generation, None)


def apply_failed(message: str, generation: int | None) -> ComputeStatus:
    """Degraded ApplyFailed; in a generation rolled back, Progressing False ApplyFailed instead: its
    Degraded RolledBack/RollbackFailed is what keeps the next reconcile on lastGoodEngine (and the tuner
    reading the trial as failed), so no failure of the same generation may replace it."""
    def compute(previous: dict[str, Any]) -> dict[str, Any]:
        if not rolled_back_at(previous, generation):
            return degraded_only(REASON_APPLY_FAILED, message, generation)(previous)
        return {"conditions": set_condition(previous.get("conditions"), PROGRESSING, "False", REASON_APPLY_FAILED,
                                            message, generation, now_rfc3339())}
    return compute


def decision(reason: str, message: str, generation: int | None, last_failure: dict[str, Any] | None) -> ComputeStatus:
    """A rollback's decision alone (Degraded with its reason for the generation, and lastFailure), written
    before the rollback's patch (docs/architecture.md, "The reconcile and its status writes")."""
    def compute(previous: dict[str, Any]) -> dict[str, Any]:
        status: dict[str, Any] = {"conditions": set_condition(previous.get("conditions"), DEGRADED, "True", reason,
                                                              message, generation, now_rfc3339())}
        if last_failure is not None:
            status["lastFailure"] = last_failure
        return status
    return compute


def failure_record(reason: str, message: str, config_hash: str | None, generation: int | None,
                 pod: str | None = None) -> dict[str, Any]:
    failure: dict[str, Any] = {"reason": reason, "message": message, "configHash": config_hash,
                               "observedGeneration": generation, "time": now_rfc3339()}
    if pod is not None:
        failure["pod"] = pod
    return failure


async def update_status(rt: Runtime, namespace: str, name: str, compute: ComputeStatus, *,
                        parent: dict[str, Any] | None = None) -> None:
    """Read-modify-write of an InferenceService's status: `compute` gets the status as read and
    returns the keys the operator owns; only what changed is written, with the resourceVersion it
    was computed from, so a concurrent writer's change is read and kept, never overwritten.
    `parent` is the object as the caller last read it (saves a read; a conflict reads it anew)."""
    # NOTE: not kopf's `patch`: kopf applies it after the handler returns, outside the lock, with no resourceVersion.
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
