"""Canary trials, operator side: a real `kvpilot operator` process (kopf) against KMock.

The tuner's side of the contract is played by the test: it sets the InferenceService annotation
kvpilot.dev/canary to a trial's tuned fields and removes it to end the trial (promotion: the tuned
fields written to spec.engine and the annotation removed, in one patch).  KMock has no controllers
and no kubelet: the test writes the canary Deployment's status and its pod's status as they would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kmock_api import KMockAPI, OperatorProcess, kopf_operator, wait_for
from kvpilot.operator import rbac
from tests.support.vllm_text import KV_SHORT, startup_failure_log, termination_message

pytestmark = pytest.mark.integration

NS = "serving"
CANARY = "kvpilot.dev/canary"
TRACK = "kvpilot.dev/track"
TUNED = {"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128}


@pytest.fixture(scope="module")
def operator_args() -> tuple[str, ...]:
    return ("--crash-loop-restarts", "2")


@pytest.fixture(scope="module")
def operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    yield operator
    operator.assert_alive()
    operator.assert_no_errors_logged()
    operator.assert_stops_cleanly()


def dep_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def ask(trial: int, engine: dict[str, Any] | None = None) -> str:
    """The annotation as the tuner writes it: compact JSON."""
    return json.dumps({"trial": trial, "engine": engine or TUNED}, separators=(",", ":"))


def make(api: KMockAPI, name: str, *, canary: str | None = None, replicas: int = 2) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS}
    if canary is not None:
        meta["annotations"] = {CANARY: canary}
    return dict(api.create_isvc({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": meta,
                                 "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "replicas": replicas,
                                          "engine": {"gpuMemoryUtilization": 0.9}}}))


def annotate(api: KMockAPI, name: str, value: str | None) -> None:
    api.patch(api.isvc_path(NS, name), {"metadata": {"annotations": {CANARY: value}}})


def isvc(api: KMockAPI, name: str) -> dict[str, Any]:
    return dict(api.get_isvc(NS, name))


def canary_of(api: KMockAPI, name: str) -> dict[str, Any]:
    return dict((isvc(api, name).get("status") or {}).get("canary") or {})


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((dict(c) for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def events_for(api: KMockAPI, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.events(NS) if e.get("involvedObject", {}).get("name") == name
            and e.get("involvedObject", {}).get("kind") == "InferenceService" and e.get("reason") == reason]


def config_hash(dep: dict[str, Any]) -> str:
    return str(dep["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/config-hash"])


def arg(dep: dict[str, Any], flag: str) -> str:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index(flag) + 1])


def stable_ready(api: KMockAPI, name: str) -> dict[str, Any]:
    """Play the Deployment controller: the stable rollout completed."""
    dep = wait_for(lambda: api.get_or_none(dep_path(name)), what="the stable Deployment")
    api.patch(dep_path(name) + "/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 2, "updatedReplicas": 2,
        "readyReplicas": 2, "availableReplicas": 2}})
    wait_for(lambda: isvc(api, name).get("status", {}).get("lastGoodEngine"), what="lastGoodEngine")
    return dict(api.get(dep_path(name)))


def test_a_canary_runs_beside_the_stable_track_and_promotion_removes_it(api: KMockAPI,
                                                                        operator: OperatorProcess) -> None:
    make(api, "chat")
    stable = stable_ready(api, "chat")
    assert api.get_or_none(dep_path("chat-canary")) is None
    annotate(api, "chat", ask(4))

    canary = wait_for(lambda: api.get_or_none(dep_path("chat-canary")), what="the canary Deployment")
    parent = isvc(api, "chat")
    [ref] = canary["metadata"]["ownerReferences"]
    assert ref["uid"] == parent["metadata"]["uid"] and ref["controller"] is True and ref["kind"] == "InferenceService"
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["template"]["metadata"]["labels"][TRACK] == "canary"
    assert canary["spec"]["selector"]["matchLabels"] == {"kvpilot.dev/inferenceservice": "chat", TRACK: "canary"}
    assert arg(canary, "--max-num-batched-tokens") == "4096" and arg(canary, "--max-num-seqs") == "128"
    assert arg(canary, "--gpu-memory-utilization") == "0.85"
    # The stable track is as it was: its selector, its template, its engine.
    now = api.get(dep_path("chat"))
    assert config_hash(now) == config_hash(stable) and now["spec"]["selector"] == stable["spec"]["selector"]
    assert now["spec"]["template"]["metadata"]["labels"][TRACK] == "stable"
    told = wait_for(lambda: (c := canary_of(api, "chat")).get("trial") == 4 and c, what="status.canary")
    assert told["phase"] == "Progressing" and told["configHash"] == config_hash(canary)
    assert condition(isvc(api, "chat"), "Canary")["status"] == "False"
    created = wait_for(lambda: events_for(api, "chat", "Created") and
                       [e for e in events_for(api, "chat", "Created") if "chat-canary" in e["message"]],
                       what="the canary's Created Event")
    assert "one replica's resources" in created[0]["message"]

    # Deleted by hand while still asked for: made again.
    api.delete(dep_path("chat-canary"))
    canary = wait_for(lambda: api.get_or_none(dep_path("chat-canary")), what="the canary made again")
    assert canary["spec"]["template"]["metadata"]["labels"][TRACK] == "canary"

    # Play the Deployment controller: the canary pod is ready.
    api.patch(dep_path("chat-canary") + "/status", {"status": {
        "observedGeneration": canary["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1,
        "readyReplicas": 1, "availableReplicas": 1}})
    ready = wait_for(lambda: (c := canary_of(api, "chat")).get("phase") == "Ready" and c, what="canary Ready")
    assert ready["readyReplicas"] == 1 and ready["trial"] == 4
    assert condition(isvc(api, "chat"), "Canary")["status"] == "True"

    # Promotion: the tuned fields to spec.engine and the annotation removed, in one patch.
    api.patch(api.isvc_path(NS, "chat"), {"metadata": {"annotations": {CANARY: None}},
                                          "spec": {"engine": TUNED}})
    wait_for(lambda: api.get_or_none(dep_path("chat-canary")) is None, what="the canary deleted")
    promoted = wait_for(lambda: (d := api.get(dep_path("chat"))) and arg(d, "--max-num-batched-tokens") == "4096"
                        and d, what="the stable track on the promoted engine")
    assert promoted["spec"]["template"]["metadata"]["labels"][TRACK] == "stable"
    wait_for(lambda: "canary" not in isvc(api, "chat")["status"], what="status.canary gone")
    assert condition(isvc(api, "chat"), "Canary") == {}
    # The operator deleted it so the garbage collector takes its ReplicaSet and pods too.
    assert ("DELETE", f"/apis/apps/v1/namespaces/{NS}/deployments/chat-canary") in api.calls
    assert rbac.allows("apps", "deployments", "delete")
    assert [e for e in events_for(api, "chat", "Deleted") if "chat-canary" in e["message"]]


def test_a_malformed_annotation_runs_no_canary_and_says_why(api: KMockAPI, operator: OperatorProcess) -> None:
    make(api, "typo")
    stable_ready(api, "typo")
    annotate(api, "typo", json.dumps({"trial": 2, "engine": {**TUNED, "image": "evil/vllm:latest"}}))
    [event] = wait_for(lambda: events_for(api, "typo", "InvalidCanary"), what="the InvalidCanary Event")
    assert event["type"] == "Warning" and "engine.image is not a tuned field" in event["message"]
    told = wait_for(lambda: (c := canary_of(api, "typo")).get("reason") == "InvalidCanary" and c,
                    what="status.canary InvalidCanary")
    assert told["phase"] == "Failed" and told["trial"] == 2
    assert api.get_or_none(dep_path("typo-canary")) is None
    obj = isvc(api, "typo")
    assert condition(obj, "Degraded")["status"] == "False"  # the service itself is fine
    assert condition(obj, "Ready")["status"] == "True"
    # A canary that makes no valid engine (vLLM's rule: tokens >= seqs) is refused the same way.
    annotate(api, "typo", ask(3, {**TUNED, "maxNumBatchedTokens": 64}))
    wait_for(lambda: "trial 3 makes no valid engine" in canary_of(api, "typo").get("message", ""),
             what="the invalid engine said")
    assert api.get_or_none(dep_path("typo-canary")) is None
    # Fixed: the canary runs.
    annotate(api, "typo", ask(3))
    wait_for(lambda: api.get_or_none(dep_path("typo-canary")), what="the canary after the fix")
    assert len(events_for(api, "typo", "InvalidCanary")) == 2


def test_a_canary_that_cannot_start_fails_in_vllms_words_and_leaves_the_stable_track(api: KMockAPI,
                                                                                     operator: OperatorProcess) -> None:
    make(api, "bold")
    stable = stable_ready(api, "bold")
    annotate(api, "bold", ask(9, {**TUNED, "gpuMemoryUtilization": 0.5}))
    canary = wait_for(lambda: api.get_or_none(dep_path("bold-canary")), what="the canary Deployment")
    log = startup_failure_log(KV_SHORT)
    api.create_engine_pod(canary, "bold-canary-1", {
        "restartCount": 1, "ready": False, "started": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": termination_message(log)}}},
        previous_log=log)
    told = wait_for(lambda: (c := canary_of(api, "bold")).get("phase") == "Failed" and c, what="canary Failed")
    assert told["reason"] == "EngineStartupFailed" and KV_SHORT in told["message"]
    assert "bold-canary-1" in told["message"] and told["trial"] == 9
    [event] = wait_for(lambda: events_for(api, "bold", "EngineStartupFailed"), what="the Warning Event")
    assert event["type"] == "Warning" and KV_SHORT in event["message"]
    cond = condition(isvc(api, "bold"), "Canary")
    assert cond["status"] == "False" and cond["reason"] == "EngineStartupFailed"
    # The stable track is untouched: no rollback, no Degraded.
    assert config_hash(api.get(dep_path("bold"))) == config_hash(stable)
    assert condition(isvc(api, "bold"), "Degraded")["status"] == "False"
    assert events_for(api, "bold", "RolledBack") == []
    # A later event of the canary Deployment keeps the failure.
    api.patch(dep_path("bold-canary") + "/status", {"status": {
        "observedGeneration": canary["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1,
        "readyReplicas": 0, "unavailableReplicas": 1}})
    wait_for(lambda: (api.get(dep_path("bold-canary")).get("status") or {}).get("unavailableReplicas") == 1,
             what="the status written")
    assert canary_of(api, "bold")["phase"] == "Failed"


def test_an_unschedulable_canary_says_it_needs_one_more_replicas_resources(api: KMockAPI,
                                                                           operator: OperatorProcess) -> None:
    make(api, "full")
    stable_ready(api, "full")
    annotate(api, "full", ask(1))
    canary = wait_for(lambda: api.get_or_none(dep_path("full-canary")), what="the canary Deployment")
    template = canary["spec"]["template"]
    pods = f"/api/v1/namespaces/{NS}/pods"
    api.create(pods, {"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": "full-canary-1", "namespace": NS, "labels": dict(template["metadata"]["labels"]),
                                   "annotations": dict(template["metadata"]["annotations"])},
                      "spec": template["spec"]})
    scheduler_says = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    api.patch(f"{pods}/full-canary-1/status", {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": scheduler_says}]}})
    told = wait_for(lambda: (c := canary_of(api, "full")).get("reason") == "Unschedulable" and c,
                    what="canary Unschedulable")
    assert told["phase"] == "Progressing" and scheduler_says in told["message"]
    assert "one replica's resources beyond the stable replicas" in told["message"]
    [event] = wait_for(lambda: events_for(api, "full", "Unschedulable"), what="the Unschedulable Event")
    assert event["type"] == "Warning"
    assert condition(isvc(api, "full"), "Canary")["reason"] == "Unschedulable"
    # Capacity found: the pod is scheduled, Unschedulable is cleared.
    api.patch(f"{pods}/full-canary-1/status", {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}})
    wait_for(lambda: canary_of(api, "full").get("reason") == "CanaryProgressing", what="Unschedulable cleared")


def test_a_restarted_operator_recomputes_the_canary_from_the_annotation(tmp_path: Path) -> None:
    for run in "abc":
        (tmp_path / run).mkdir()
    with KMockAPI() as api2:
        with kopf_operator(api2, tmp_path / "a"):
            make(api2, "phoenix", canary=ask(5))
            wait_for(lambda: api2.get_or_none(dep_path("phoenix-canary")), what="the canary Deployment")
        # Down mid-trial: the tuner ended the trial meanwhile; a leftover canary must go.
        annotate(api2, "phoenix", None)
        with kopf_operator(api2, tmp_path / "b"):
            wait_for(lambda: api2.get_or_none(dep_path("phoenix-canary")) is None, what="the leftover canary deleted")
            wait_for(lambda: "canary" not in isvc(api2, "phoenix")["status"], what="status.canary gone")
        # Down again; a new trial was asked for and its Deployment lost meanwhile: it is made again.
        annotate(api2, "phoenix", ask(6))
        with kopf_operator(api2, tmp_path / "c"):
            canary = wait_for(lambda: api2.get_or_none(dep_path("phoenix-canary")), what="the canary recreated")
            assert canary["metadata"]["annotations"]["kvpilot.dev/tuning-trial"] == "6"
            wait_for(lambda: canary_of(api2, "phoenix").get("trial") == 6, what="status.canary of trial 6")
