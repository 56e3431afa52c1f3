"""Reading the operator's status: when is a rollout of a generation complete, or failed."""

from __future__ import annotations

from typing import Any

from kvpilot.tuner.adapters.kubernetes import rollout_state


def obj(generation: int, observed: int, replicas: int = 2, updated: int = 2, ready: int = 2,
        progressing: tuple[str, str] = ("False", "RolloutComplete"),
        degraded: tuple[str, str] = ("False", "AsExpected")) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation}, "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated, "readyReplicas": ready,
            "conditions": [
                {"type": "Progressing", "status": progressing[0], "reason": progressing[1], "message": "m"},
                {"type": "Degraded", "status": degraded[0], "reason": degraded[1], "message": "rolled back: oom"},
            ],
        },
    }


def test_complete_needs_the_new_generation_observed_and_every_replica_updated_and_ready() -> None:
    assert rollout_state(obj(5, 5), 5)[0] == "complete"
    assert rollout_state(obj(5, 4), 5)[0] == "progressing"  # a stale "complete" from before the patch
    assert rollout_state(obj(5, 5, ready=1), 5)[0] == "progressing"
    assert rollout_state(obj(5, 5, progressing=("True", "RollingOut")), 5)[0] == "progressing"


def test_rolled_back_or_past_the_deadline_is_failed() -> None:
    state, message = rollout_state(obj(5, 5, degraded=("True", "RolledBack")), 5)
    assert state == "failed" and "oom" in message
    assert rollout_state(obj(5, 5, progressing=("False", "ProgressDeadlineExceeded")), 5)[0] == "failed"
