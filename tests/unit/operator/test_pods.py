"""The pure decision: an engine pod's status -> whether its engine failed, why, and in whose words."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.api.vocabulary import ANNOTATION_CONFIG_HASH
from kvpilot.operator.builders.pods import engine_failure
from tests.support.vllm_text import KV_SHORT, startup_failure_log, termination_message


def pod(*, state: dict[str, Any] | None = None, last: dict[str, Any] | None = None, restarts: int = 0,
        container: str = "engine") -> dict[str, Any]:
    cs: dict[str, Any] = {"name": container, "restartCount": restarts, "ready": False,
                          "state": state or {"running": {"startedAt": "2026-12-01T06:00:00Z"}}}
    if last is not None:
        cs["lastState"] = last
    return {"metadata": {"name": "llama-7d9f-x2", "annotations": {ANNOTATION_CONFIG_HASH: "abc123"}},
            "status": {"phase": "Running", "containerStatuses": [cs]}}


def terminated(message: str, exit_code: int = 1, reason: str = "Error") -> dict[str, Any]:
    return {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}


CRASH_LOOP = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}}


def test_a_first_exit_with_vllms_start_up_text_is_a_start_up_failure() -> None:
    short = ("ERROR [core.py] EngineCore failed to start.\n"
             f"ERROR [core.py] {KV_SHORT}\nRuntimeError: Engine core initialization failed. See root cause above.")
    failure = engine_failure(pod(state=terminated(short)), crash_loop_restarts=3)
    assert failure is not None
    assert (failure.reason, failure.pod, failure.config_hash, failure.exit_code) == (
        "EngineStartupFailed", "llama-7d9f-x2", "abc123", 1)
    assert failure.cause.endswith(KV_SHORT) and not failure.cause_above
    assert not failure.previous  # the dead instance is the current one: `kubectl logs` without --previous
    assert KV_SHORT in failure.describe() and "exit code 1" in failure.describe()


def test_vllms_text_cut_to_the_kubelets_2048_bytes_still_says_it_could_not_start() -> None:
    message = termination_message(startup_failure_log(KV_SHORT))
    failure = engine_failure(pod(state=CRASH_LOOP, last=terminated(message), restarts=1), crash_loop_restarts=3)
    assert failure is not None and failure.reason == "EngineStartupFailed"
    assert failure.cause_above and failure.previous  # read the previous instance's log for the root cause
    found = failure.with_log(startup_failure_log(KV_SHORT))
    assert found.cause.endswith(KV_SHORT) and not found.cause_above
    # A log that says no more leaves the failure as it was.
    assert failure.with_log(message) == failure


def test_a_crash_without_vllms_words_waits_for_the_restart_threshold() -> None:
    oom = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    assert engine_failure(pod(state=CRASH_LOOP, last=oom, restarts=2), crash_loop_restarts=3) is None
    failure = engine_failure(pod(state=CRASH_LOOP, last=oom, restarts=3), crash_loop_restarts=3)
    assert failure is not None and failure.reason == "CrashLoopBackOff"
    assert (failure.restarts, failure.exit_code, failure.cause) == (3, 137, "OOMKilled")
    assert "restarted 3 times (CrashLoopBackOff), last exit code 137" in failure.describe()
    assert failure.cause_above  # the message said nothing: the log may


@pytest.mark.parametrize("p", [
    pod(),  # running, never died
    pod(state={"waiting": {"reason": "ContainerCreating"}}),
    pod(state=terminated("", exit_code=0, reason="Completed")),  # a clean exit once
    pod(state=terminated(f"ERROR {KV_SHORT}"), container="sidecar"),  # not the engine container
    {"metadata": {"name": "pending"}, "status": {"phase": "Pending"}},
])
def test_no_failure_while_the_engine_has_shown_none(p: dict[str, Any]) -> None:
    assert engine_failure(p, crash_loop_restarts=3) is None


def test_a_restart_count_is_read_only_with_a_dead_instance() -> None:
    # Restarted 5 times but the kubelet has not recorded a terminated state: nothing to say why.
    assert engine_failure(pod(restarts=5), crash_loop_restarts=3) is None
    restarted = engine_failure(pod(last=terminated("Segmentation fault", exit_code=139), restarts=5),
                               crash_loop_restarts=3)
    assert restarted is not None and restarted.reason == "CrashLoopBackOff"
    assert restarted.cause == "Segmentation fault" and not restarted.cause_above
