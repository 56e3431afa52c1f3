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


def test_an_engine_that_cannot_start_with_nothing_to_roll_back_to_is_failed() -> None:
    for reason in ("EngineStartupFailed", "CrashLoopBackOff"):
        assert rollout_state(obj(5, 5, progressing=("True", "RollingOut"), degraded=("True", reason)), 5)[0] == "failed"


def test_the_failure_is_told_in_the_engines_words_for_its_own_generation_only() -> None:
    from kvpilot.tuner.adapters.kubernetes import failure_of

    o = obj(5, 5, degraded=("True", "RolledBack"))
    words = "pod p: container engine could not start (exit code 1): ValueError: ... KV cache is needed ..."
    o["status"]["lastFailure"] = {"reason": "EngineStartupFailed", "message": words, "observedGeneration": 5}
    failed = failure_of(o, 5, "rolled back: oom")
    assert (failed.reason, failed.message) == ("EngineStartupFailed", words)
    # An older generation's failure is not this one's; a deadline's keeps the operator's sentence.
    assert failure_of(o, 6, "rolled back: oom").reason == "RolloutFailed"
    o["status"]["lastFailure"] = {"reason": "ProgressDeadlineExceeded", "message": "timed out", "observedGeneration": 5}
    assert (failure_of(o, 5, "rolled back: oom").reason, failure_of(o, 5, "rolled back: oom").message) == (
        "RolloutFailed", "rolled back: oom")
