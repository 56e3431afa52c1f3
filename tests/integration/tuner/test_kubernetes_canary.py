"""The tuner's canary applier against KMock with the real operator (`kopf run`) reconciling.

The tuner asks for a canary through the kvpilot.dev/canary annotation and waits for status.canary;
the operator runs `<name>-canary`.  KMock has no controllers and no kubelet: the test plays them
(the canary Deployment's status; a canary pod whose vLLM cannot start).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from harness.kmock_api import KMockAPI, OperatorProcess, wait_for
from kvpilot.api.vocabulary import ANNOTATION_CANARY
from kvpilot.tuner.adapters.kubernetes import KubernetesCanaryApplier
from kvpilot.tuner.core.loop import ApplyFailed
from kvpilot.tuner.core.space import EngineParams
from tests.support.vllm_text import KV_SHORT, startup_failure_log, termination_message

pytestmark = pytest.mark.integration

NS = "tuning"


def dep_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def arg(dep: dict[str, Any], flag: str) -> str:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index(flag) + 1])


def serve(api: KMockAPI, name: str, replicas: int) -> None:
    """Play the Deployment controller: the Deployment's rollout completed."""
    dep = wait_for(lambda: api.get_or_none(dep_path(name)), what=f"Deployment {name}")
    api.patch(dep_path(name) + "/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": replicas, "updatedReplicas": replicas,
        "readyReplicas": replicas, "availableReplicas": replicas}})


def service(api: KMockAPI, name: str) -> str:
    api.create_isvc({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2,
                 "engine": {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256},
                 "tuning": {"enabled": True, "trialStrategy": "canary"}}})
    serve(api, name, 2)
    wait_for(lambda: api.get_isvc(NS, name).get("status", {}).get("lastGoodEngine"), what="lastGoodEngine")
    return name


def in_thread(fn: Any) -> tuple[threading.Event, list[BaseException]]:
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, errors


def test_start_canary_waits_for_the_operators_canary_to_serve_and_stop_removes_it(
        api: KMockAPI, operator: OperatorProcess, client: Any) -> None:
    name = service(api, "chat")
    applier = KubernetesCanaryApplier(client, NS, name, timeout_s=60, poll_s=0.1)
    trial = EngineParams(4096, 0.85, 128)
    done, errors = in_thread(lambda: applier.start_canary(trial, 3))

    canary = wait_for(lambda: api.get_or_none(dep_path(f"{name}-canary")), what="the canary Deployment")
    assert arg(canary, "--max-num-batched-tokens") == "4096" and arg(canary, "--max-num-seqs") == "128"
    asked = json.loads(api.get_isvc(NS, name)["metadata"]["annotations"][ANNOTATION_CANARY])
    assert asked == {"trial": 3, "engine": {"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85,
                                            "maxNumSeqs": 128}}
    # Until the canary's pod serves, the tuner does not measure it.
    assert not done.wait(1.0), "start_canary returned before the canary was ready"
    serve(api, f"{name}-canary", 1)
    assert done.wait(30), "start_canary did not return once the canary served"
    assert not errors, errors
    obj = api.get_isvc(NS, name)
    assert obj["status"]["canary"]["phase"] == "Ready" and obj["status"]["canary"]["trial"] == 3
    # The stable track is untouched: the tuned fields are the user's, the stable template as it was.
    assert obj["spec"]["engine"]["maxNumBatchedTokens"] == 2048
    assert arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048"

    applier.stop_canary()
    wait_for(lambda: api.get_or_none(dep_path(f"{name}-canary")) is None, what="the canary deleted")
    assert ANNOTATION_CANARY not in (api.get_isvc(NS, name)["metadata"].get("annotations") or {})
    applier.stop_canary()  # idempotent: no canary is no error


def test_a_canary_vllm_refuses_to_start_fails_the_trial_in_vllms_words_and_is_removed(
        api: KMockAPI, operator: OperatorProcess, client: Any) -> None:
    name = service(api, "code")
    applier = KubernetesCanaryApplier(client, NS, name, timeout_s=60, poll_s=0.1)
    done, errors = in_thread(lambda: applier.start_canary(EngineParams(2048, 0.5, 256), 5))
    canary = wait_for(lambda: api.get_or_none(dep_path(f"{name}-canary")), what="the canary Deployment")
    log = startup_failure_log(KV_SHORT)
    api.create_engine_pod(canary, f"{name}-canary-1", {
        "restartCount": 1, "ready": False, "started": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": termination_message(log)}}},
        previous_log=log)
    assert done.wait(30), "start_canary did not return on the canary's failure"
    [exc] = errors
    assert isinstance(exc, ApplyFailed) and exc.reason == "EngineStartupFailed", exc
    assert "KV cache" in exc.message
    wait_for(lambda: api.get_or_none(dep_path(f"{name}-canary")) is None, what="the failed canary deleted")
    obj = api.get_isvc(NS, name)
    assert ANNOTATION_CANARY not in (obj["metadata"].get("annotations") or {})
    # The stable track was never rolled back or touched for the canary's failure.
    assert obj["spec"]["engine"]["gpuMemoryUtilization"] == 0.9
    degraded = next((c for c in obj["status"]["conditions"] if c["type"] == "Degraded"), {})
    assert degraded.get("status") == "False"


def test_a_promotion_writes_the_tuned_fields_rolls_the_stable_track_and_ends_the_canary(
        api: KMockAPI, operator: OperatorProcess, client: Any) -> None:
    """What the loop does with a winner: apply (the tuned fields, server-side applied under the tuner's
    field manager; the stable track rolls) and then stop_canary."""
    name = service(api, "rank")
    applier = KubernetesCanaryApplier(client, NS, name, timeout_s=60, poll_s=0.1)
    winner = EngineParams(8192, 0.92, 384)
    done, errors = in_thread(lambda: applier.start_canary(winner, 9))
    wait_for(lambda: api.get_or_none(dep_path(f"{name}-canary")), what="the canary Deployment")
    serve(api, f"{name}-canary", 1)
    assert done.wait(30) and not errors, errors

    before = api.get_isvc(NS, name)
    done, errors = in_thread(lambda: applier.apply(winner, 9))
    wait_for(lambda: arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "8192",
             what="the stable track rolling to the winner")
    serve(api, name, 2)
    assert done.wait(30) and not errors, errors
    applier.stop_canary()
    wait_for(lambda: api.get_or_none(dep_path(f"{name}-canary")) is None, what="the canary deleted")
    after = api.get_isvc(NS, name)
    assert after["spec"]["engine"] == {**before["spec"]["engine"], "maxNumBatchedTokens": 8192,
                                       "gpuMemoryUtilization": 0.92, "maxNumSeqs": 384}
    assert {k: v for k, v in after["spec"].items() if k != "engine"} == \
        {k: v for k, v in before["spec"].items() if k != "engine"}
    assert after["metadata"]["annotations"]["kvpilot.dev/tuning-trial"] == "9"
    assert "canary" not in (after.get("status") or {})
