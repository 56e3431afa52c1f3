"""A new revision whose vLLM cannot start is rolled back at once, in vLLM's words: a real
`kvpilot operator` process (kopf) against KMock.

KMock has no controllers and no kubelet: the test plays them, creating the pods of the Deployment's
current template and writing their container statuses as a kubelet does for vLLM failing at
start-up (the tail of its log as the termination message, FallbackToLogsOnError; the whole log via
`pods/NAME/log`).  The Deployment's own status never passes its progress deadline here: every
rollback below happens before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from harness.kmock_api import Fault, KMockAPI, OperatorProcess, wait_for
from kvpilot.operator import rbac
from tests.support.vllm_text import KV_SHORT, startup_failure_log, termination_message

pytestmark = pytest.mark.integration

NS = "serving"
CRASH_LOOP_RESTARTS = 2


@pytest.fixture(scope="module")
def operator_args() -> tuple[str, ...]:
    return ("--crash-loop-restarts", str(CRASH_LOOP_RESTARTS))


@pytest.fixture(scope="module")
def operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    yield operator
    operator.assert_alive()
    operator.assert_stops_cleanly()


def dep_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((dict(c) for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def engine_of(dep: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(dep["metadata"]["annotations"]["kvpilot.dev/engine"]))


def config_hash(dep: dict[str, Any]) -> str:
    return str(dep["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/config-hash"])


def events_for(api: KMockAPI, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.events(NS) if e.get("involvedObject", {}).get("name") == name
            and e.get("involvedObject", {}).get("kind") == "InferenceService" and e.get("reason") == reason]


def isvc(api: KMockAPI, name: str) -> dict[str, Any]:
    return dict(api.get_isvc(NS, name))


def ready_service(api: KMockAPI, name: str) -> dict[str, Any]:
    """An InferenceService whose first rollout completed: it has a lastGoodEngine."""
    api.create_isvc({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"name": name, "namespace": NS},
                     "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "replicas": 1,
                              "engine": {"gpuMemoryUtilization": 0.9, "maxModelLen": 131072}}})
    dep = wait_for(lambda: api.get_or_none(dep_path(name)), what="the Deployment")
    api.patch(dep_path(name) + "/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1,
        "readyReplicas": 1, "availableReplicas": 1}})
    return dict(wait_for(lambda: (o := isvc(api, name)).get("status", {}).get("lastGoodEngine") and o,
                         what="lastGoodEngine"))


def roll_out(api: KMockAPI, name: str, engine: dict[str, Any]) -> dict[str, Any]:
    """Change the engine; the Deployment with the new template."""
    before = config_hash(api.get(dep_path(name)))
    api.patch(api.isvc_path(NS, name), {"spec": {"engine": engine}})
    return dict(wait_for(lambda: (d := api.get(dep_path(name))) and config_hash(d) != before and d,
                         what="the new template"))


def crash_looping(message: str, *, restarts: int = 1, exit_code: int = 1, reason: str = "Error") -> dict[str, Any]:
    return {"restartCount": restarts, "ready": False, "started": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": "back-off 10s restarting failed container=engine"}},
            "lastState": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}}


def test_vllms_start_up_failure_rolls_back_at_once_in_its_own_words(api: KMockAPI,
                                                                     operator: OperatorProcess) -> None:
    good = ready_service(api, "llama")
    good_dep = api.get(dep_path("llama"))
    # A pod of the OLD revision failing says nothing about the new one (and comes first, so the
    # rollback below shows it was passed over).
    api.create_engine_pod(good_dep, "llama-old-1", crash_looping("Segmentation fault", restarts=5, exit_code=139))
    bad_dep = roll_out(api, "llama", {"gpuMemoryUtilization": 0.5})
    log = startup_failure_log(KV_SHORT)
    # The kubelet's termination message is the log's last 2048 bytes: vLLM's API-server traceback.
    api.create_engine_pod(bad_dep, "llama-new-1", crash_looping(termination_message(log)), previous_log=log)

    dep = wait_for(lambda: (d := api.get(dep_path("llama"))) and config_hash(d) == config_hash(good_dep) and d,
                   what="lastGoodEngine back")
    assert engine_of(dep) == good["status"]["lastGoodEngine"]
    assert engine_of(dep)["gpuMemoryUtilization"] == 0.9
    assert "conditions" not in (dep.get("status") or {})  # the Deployment never said a word about a deadline

    obj = wait_for(lambda: condition(o := isvc(api, "llama"), "Degraded").get("reason") == "RolledBack" and o,
                   what="Degraded/RolledBack")
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "True" and degraded["observedGeneration"] == obj["metadata"]["generation"]
    assert KV_SHORT in degraded["message"]  # vLLM's root cause, read from the dead container's log
    assert "pod llama-new-1" in degraded["message"] and "gpuMemoryUtilization=0.5 (was 0.9)" in degraded["message"]
    failure = obj["status"]["lastFailure"]
    assert failure["reason"] == "EngineStartupFailed" and failure["pod"] == "llama-new-1"
    assert failure["configHash"] == config_hash(bad_dep)
    assert failure["observedGeneration"] == obj["metadata"]["generation"]
    assert KV_SHORT in failure["message"]
    assert obj["spec"]["engine"]["gpuMemoryUtilization"] == 0.5  # the user's spec stays as written

    events = wait_for(lambda: events_for(api, "llama", "RolledBack"), what="the RolledBack Event")
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert "KV cache is needed" in events[0]["message"]
    # The operator read the previous instance's log, as `kubectl logs --previous` does.
    assert ("GET", f"/api/v1/namespaces/{NS}/pods/llama-new-1/log") in api.calls
    assert rbac.allows("", "pods/log", "get") and rbac.allows("", "pods", "watch")


def test_a_crash_loop_without_vllms_words_rolls_back_at_the_restart_threshold(api: KMockAPI,
                                                                              operator: OperatorProcess) -> None:
    good = ready_service(api, "mistral")
    bad_dep = roll_out(api, "mistral", {"maxNumSeqs": 128})
    api.create_engine_pod(bad_dep, "mistral-new-1",
                          crash_looping("", restarts=CRASH_LOOP_RESTARTS, exit_code=137, reason="OOMKilled"))
    obj = wait_for(lambda: condition(o := isvc(api, "mistral"), "Degraded").get("reason") == "RolledBack" and o,
                   what="Degraded/RolledBack")
    assert obj["status"]["lastFailure"]["reason"] == "CrashLoopBackOff"
    assert "restarted 2 times (CrashLoopBackOff), last exit code 137: OOMKilled" in condition(obj, "Degraded")["message"]
    # The decision is written before the Deployment is patched: the template follows a moment later.
    wait_for(lambda: engine_of(api.get(dep_path("mistral"))) == good["status"]["lastGoodEngine"],
             what="mistral's template rolled back")


def test_a_first_rollout_that_cannot_start_says_why_and_keeps_its_deployment(api: KMockAPI,
                                                                             operator: OperatorProcess) -> None:
    api.create_isvc({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"name": "fresh", "namespace": NS},
                     "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "replicas": 1}})
    wait_for(lambda: isvc(api, "fresh").get("status", {}).get("observedGeneration") == 1, what="fresh's status")
    dep = api.get(dep_path("fresh"))
    # A short log (the twin's, or a vLLM failing early) fits in the termination message whole.
    short = ("ERROR 12-01 06:10:41 [core.py] EngineCore failed to start.\n"
             f"ERROR 12-01 06:10:41 [core.py] {KV_SHORT}\n"
             "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    api.create_engine_pod(dep, "fresh-1", {"restartCount": 0, "ready": False,
                                           "state": {"terminated": {"exitCode": 1, "reason": "Error",
                                                                    "message": short}}})
    obj = wait_for(lambda: condition(o := isvc(api, "fresh"), "Degraded").get("status") == "True" and o,
                   what="Degraded/EngineStartupFailed")
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "EngineStartupFailed"
    assert KV_SHORT in degraded["message"] and "no lastGoodEngine to roll back to" in degraded["message"]
    assert wait_for(lambda: events_for(api, "fresh", "EngineStartupFailed"), what="the Event")
    assert api.get(dep_path("fresh"))["spec"] == dep["spec"]
    # A Deployment event of the same generation keeps what the pod said.
    api.patch(dep_path("fresh") + "/status", {"status": {"observedGeneration": dep["metadata"]["generation"],
                                                         "replicas": 1, "updatedReplicas": 1}})
    wait_for(lambda: isvc(api, "fresh")["status"].get("updatedReplicas") == 1, what="the Deployment event handled")
    assert condition(isvc(api, "fresh"), "Degraded")["reason"] == "EngineStartupFailed"
    # The log was not needed: the message held the root cause.
    assert ("GET", f"/api/v1/namespaces/{NS}/pods/fresh-1/log") not in api.calls


def test_a_failing_change_outside_the_engine_has_no_other_engine_to_go_back_to(api: KMockAPI,
                                                                              operator: OperatorProcess) -> None:
    """lastGoodEngine is spec.engine: when what changed is elsewhere (here the memory limit), the
    failing revision already runs lastGoodEngine, so the operator says so rather than 'rolling back'."""
    ready_service(api, "phi")
    before = config_hash(api.get(dep_path("phi")))
    api.patch(api.isvc_path(NS, "phi"), {"spec": {"resources": {"memory": "1Gi"}}})
    dep = wait_for(lambda: (d := api.get(dep_path("phi"))) and config_hash(d) != before and d, what="the new template")
    api.create_engine_pod(dep, "phi-new-1", crash_looping("", restarts=CRASH_LOOP_RESTARTS, exit_code=137,
                                                          reason="OOMKilled"))
    obj = wait_for(lambda: condition(o := isvc(api, "phi"), "Degraded").get("status") == "True" and o,
                   what="Degraded/CrashLoopBackOff")
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "CrashLoopBackOff"
    assert "its engine is lastGoodEngine" in degraded["message"]
    assert config_hash(api.get(dep_path("phi"))) == config_hash(dep)  # nothing applied
    assert events_for(api, "phi", "RolledBack") == []


def test_the_fast_rollback_writes_its_decision_before_the_patch_and_completes_a_failed_patch(
        api: KMockAPI, operator: OperatorProcess) -> None:
    """The rollback's patch refused (a 422 no retry can help): the status already says the generation
    is given up (Degraded RolledBack with lastFailure), so a restarted operator would not render the
    failed engine again; the failed pod's next restart completes the patch, with one RolledBack Event."""
    good = ready_service(api, "gemma")
    good_dep = api.get(dep_path("gemma"))
    bad_dep = roll_out(api, "gemma", {"gpuMemoryUtilization": 0.5})
    refused = api.fail("PATCH", f"^{dep_path('gemma')}$", Fault(422))
    log = startup_failure_log(KV_SHORT)
    api.create_engine_pod(bad_dep, "gemma-new-1", crash_looping(termination_message(log)), previous_log=log)

    obj = wait_for(lambda: condition(o := isvc(api, "gemma"), "Degraded").get("reason") == "RolledBack" and o,
                   what="the rollback's decision")
    wait_for(lambda: refused.served, what="the refused patch")
    assert obj["status"]["lastFailure"]["configHash"] == config_hash(bad_dep)
    assert KV_SHORT in obj["status"]["lastFailure"]["message"]
    assert condition(obj, "Degraded")["observedGeneration"] == obj["metadata"]["generation"]
    assert config_hash(api.get(dep_path("gemma"))) == config_hash(bad_dep)  # the patch did not hold
    assert events_for(api, "gemma", "RolledBack") == []  # nothing is said done before it is

    # The kubelet restarts the failed engine: its next status change completes the rollback.
    api.set_engine_status(NS, "gemma-new-1", {"name": "engine", **crash_looping(termination_message(log),
                                                                                 restarts=2)})
    dep = wait_for(lambda: (d := api.get(dep_path("gemma"))) and config_hash(d) == config_hash(good_dep) and d,
                   what="lastGoodEngine back after the failed patch")
    assert engine_of(dep) == good["status"]["lastGoodEngine"]
    events = wait_for(lambda: events_for(api, "gemma", "RolledBack"), what="the RolledBack Event")
    assert len(events) == 1 and "put lastGoodEngine back" in events[0]["message"]
    obj = isvc(api, "gemma")
    assert condition(obj, "Degraded")["reason"] == "RolledBack"
    assert "put lastGoodEngine back (configHash" in condition(obj, "Degraded")["message"]
