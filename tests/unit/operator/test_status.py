from __future__ import annotations

import json
from typing import Any

from kvpilot.operator.builders import ANNOTATION_CONFIG_HASH, ANNOTATION_ENGINE
from kvpilot.operator.builders.status import (
    OWN_CONDITIONS,
    desired_status,
    find_condition,
    invalid_status,
    rolled_back_at,
    rollout_of,
    set_condition,
    status_patch,
)

ENGINE = {"kind": "vllm", "maxNumBatchedTokens": 4096}


def deployment(*, generation: int = 2, observed: int | None = 2, replicas: int = 2, updated: int = 2,
               ready: int = 2, available: int | None = None, status_replicas: int | None = None,
               progressing: dict[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"replicas": replicas if status_replicas is None else status_replicas,
                              "updatedReplicas": updated, "readyReplicas": ready,
                              "availableReplicas": ready if available is None else available}
    if observed is not None:
        status["observedGeneration"] = observed
    if progressing:
        status["conditions"] = [{"type": "Progressing", **progressing}]
    return {
        "metadata": {"generation": generation,
                     "annotations": {ANNOTATION_CONFIG_HASH: "abc123", ANNOTATION_ENGINE: json.dumps(ENGINE)}},
        "spec": {"replicas": replicas,
                 "template": {"spec": {"containers": [{"command": ["vllm", "serve"], "args": ["m", "--port", "8000"]}]}}},
        "status": status,
    }


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found = find_condition(status["conditions"], type_)
    assert found is not None
    return found


def test_complete_rollout_is_ready_and_records_last_good_engine() -> None:
    st = desired_status(generation=3, previous={}, deployment=deployment(), now="T1")
    assert cond(st, "Ready")["status"] == "True"
    assert cond(st, "Progressing")["status"] == "False"
    assert cond(st, "Progressing")["reason"] == "RolloutComplete"
    assert cond(st, "Degraded") == {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": "",
                                    "lastTransitionTime": "T1", "observedGeneration": 3}
    assert st["lastGoodEngine"] == ENGINE
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (2, 2, 2)
    assert st["engineArgs"] == ["vllm", "serve", "m", "--port", "8000"]
    assert st["configHash"] == "abc123"
    assert st["observedGeneration"] == 3


def test_counts_from_before_the_controller_saw_the_template_do_not_count() -> None:
    rollout = rollout_of(deployment(generation=3, observed=2))
    assert not rollout.observed and not rollout.complete and rollout.updated == 0
    st = desired_status(generation=4, previous={"lastGoodEngine": {"old": 1}},
                        deployment=deployment(generation=3, observed=2))
    assert cond(st, "Ready")["status"] == "False"
    assert cond(st, "Progressing")["status"] == "True"
    assert st["lastGoodEngine"] == {"old": 1}


def test_rollout_in_progress_with_old_pods_left() -> None:
    assert not rollout_of(deployment(status_replicas=3)).complete  # a surge pod of the old template is still there
    assert not rollout_of(deployment(ready=1)).complete
    assert not rollout_of(deployment(available=1)).complete
    assert rollout_of(deployment(generation=1, observed=None)).complete is False


def test_deadline_exceeded_is_read_only_for_the_current_generation() -> None:
    pde = {"status": "False", "reason": "ProgressDeadlineExceeded", "message": "ReplicaSet x has timed out"}
    assert rollout_of(deployment(updated=1, ready=1, progressing=pde)).deadline_exceeded
    assert not rollout_of(deployment(generation=3, observed=2, progressing=pde)).deadline_exceeded
    st = desired_status(generation=1, previous={}, deployment=deployment(updated=1, ready=1, progressing=pde))
    assert cond(st, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert cond(st, "Progressing")["message"] == "ReplicaSet x has timed out"


def test_last_transition_time_moves_only_when_status_flips() -> None:
    first = set_condition([], "Ready", "False", "RollingOut", "0/2", 1, "T1")
    same = set_condition(first, "Ready", "False", "RollingOut", "1/2", 2, "T2")
    assert same[0]["lastTransitionTime"] == "T1"
    assert same[0]["message"] == "1/2"
    flipped = set_condition(same, "Ready", "True", "RolloutComplete", "2/2", 2, "T3")
    assert flipped[0]["lastTransitionTime"] == "T3"


def test_rolled_back_is_kept_for_its_generation_only() -> None:
    prev = desired_status(generation=5, previous={}, deployment=deployment(),
                          degraded=("RolledBack", "rollout failed"), now="T1")
    assert rolled_back_at(prev, 5) and not rolled_back_at(prev, 6)
    again = desired_status(generation=5, previous=prev, deployment=deployment(), now="T2")
    assert cond(again, "Degraded")["reason"] == "RolledBack"
    assert cond(again, "Degraded")["lastTransitionTime"] == "T1"
    newer = desired_status(generation=6, previous=prev, deployment=deployment(), now="T3")
    assert cond(newer, "Degraded")["status"] == "False"


def test_a_pending_rollback_keeps_the_last_good_engine_and_turns_rolled_back_once_it_holds() -> None:
    good = {"kind": "vllm", "maxNumBatchedTokens": 2048}
    stuck = deployment(updated=1, ready=1)  # the failed engine's rollout, not progressing
    prev = desired_status(generation=5, previous={"lastGoodEngine": good}, deployment=stuck,
                          degraded=("RollbackFailed", "putting lastGoodEngine back failed: 503"), now="T1")
    assert rolled_back_at(prev, 5) and not rolled_back_at(prev, 6)  # the generation's engine is given up
    still = desired_status(generation=5, previous=prev, deployment=stuck, now="T2")
    assert cond(still, "Degraded")["reason"] == "RollbackFailed"  # the failed engine is still in force
    assert still["lastGoodEngine"] == good
    restored = deployment(updated=1, ready=1)
    restored["metadata"]["annotations"][ANNOTATION_ENGINE] = json.dumps(good)
    held = desired_status(generation=5, previous=still, deployment=restored, now="T3")
    assert cond(held, "Degraded")["reason"] == "RolledBack"
    assert cond(held, "Degraded")["message"].startswith("put lastGoodEngine back")


def test_invalid_spec_status() -> None:
    st = invalid_status(generation=2, previous={}, message="spec.engine.maxNumSeqs: must be >= 1", now="T")
    assert cond(st, "Degraded")["reason"] == "InvalidSpec"
    assert cond(st, "Degraded")["message"] == "spec.engine.maxNumSeqs: must be >= 1"
    assert cond(st, "Ready")["status"] == "False"
    assert "engineArgs" not in st


def test_status_patch_is_empty_when_nothing_changes() -> None:
    st = desired_status(generation=1, previous={}, deployment=deployment(), now="T1")
    assert status_patch(st, desired_status(generation=1, previous=st, deployment=deployment(), now="T9")) == {}
    changed = desired_status(generation=1, previous=st, deployment=deployment(ready=1), now="T9")
    assert set(status_patch(st, changed)) == {"conditions", "readyReplicas", "availableReplicas"}


def test_no_deployment_yet() -> None:
    st = desired_status(generation=1, previous={}, deployment=None)
    assert cond(st, "Ready")["reason"] == "DeploymentMissing"
    assert "lastGoodEngine" not in st


def test_conditions_of_other_writers_are_kept_as_they_are() -> None:
    tuning = {"type": "Tuning", "status": "True", "reason": "TrialRunning", "message": "trial 3",
              "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 1}
    burning = {"type": "SLOBurning", "status": "False", "reason": "WithinBudget", "message": "",
               "lastTransitionTime": "2026-01-02T00:00:00Z"}
    previous = {"conditions": [tuning, {"type": "Ready", "status": "False", "reason": "RollingOut",
                                        "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}, burning]}
    for status in (desired_status(generation=2, previous=previous, deployment=deployment()),
                   invalid_status(generation=2, previous=previous, message="spec.model: required")):
        types = [c["type"] for c in status["conditions"]]
        assert types == [*OWN_CONDITIONS, "SLOBurning", "Tuning"]
        assert cond(status, "Tuning") == tuning and cond(status, "SLOBurning") == burning
        assert cond(status, "Ready")["observedGeneration"] == 2


def test_an_engine_failure_with_nothing_to_roll_back_to_is_kept_until_its_rollout_completes() -> None:
    """Only the pod watch sees an engine that cannot start: a Deployment event (or a reconcile) of
    the same generation must not clear what it said, and must keep status.lastFailure."""
    failing = deployment(updated=1, ready=0, replicas=1)
    failure = {"reason": "EngineStartupFailed", "message": "pod p: ... KV cache is needed ...",
               "configHash": "abc123", "observedGeneration": 5}
    prev = desired_status(generation=5, previous={}, deployment=failing,
                          degraded=("EngineStartupFailed", "engine failed"), last_failure=failure, now="T1")
    assert prev["lastFailure"] == failure
    again = desired_status(generation=5, previous=prev, deployment=failing, now="T2")
    assert (cond(again, "Degraded")["status"], cond(again, "Degraded")["reason"]) == ("True", "EngineStartupFailed")
    assert "lastFailure" not in status_patch(prev, again)
    done = desired_status(generation=5, previous=prev, deployment=deployment(), now="T3")
    assert cond(done, "Degraded")["status"] == "False"
    newer = desired_status(generation=6, previous=prev, deployment=failing, now="T4")
    assert cond(newer, "Degraded")["status"] == "False"
