"""A real `kvpilot operator` process against a real control plane, as the chart's ServiceAccount.

Every call the operator makes goes through kube-apiserver's RBAC authorizer with exactly the
(Cluster)Roles the Helm chart renders; the real Deployment and ReplicaSet controllers roll the
pods out, kube-scheduler binds them to a kwok node and kwok reports them Running and Ready; the
real garbage collector removes the children when the InferenceService goes.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.cluster import ControlPlane, Operator, Watch, wait_for
from tests.cluster.common import (
    HELD_IMAGE,
    NEVER_READY_IMAGE,
    RELEASE_ANNOTATION,
    SERVING,
    START_UP_FAILS_IMAGE,
)
from tests.support.vllm_text import KV_SHORT

pytestmark = pytest.mark.cluster

NS = SERVING
ISVCS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS = f"/api/v1/namespaces/{NS}/pods"


def make(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", **spec}}


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return {}


def engine_arg(template: dict[str, Any], flag: str) -> str:
    args = template["spec"]["containers"][0]["args"]
    return str(args[args.index(flag) + 1])


def ready_for_generation(cp: ControlPlane, name: str, generation: int) -> dict[str, Any] | None:
    obj = cp.get(f"{ISVCS}/{name}")
    ok = (obj.get("status", {}).get("observedGeneration") == generation
          and condition(obj, "Ready").get("status") == "True")
    return dict(obj) if ok else None


def pods_of(cp: ControlPlane, name: str) -> list[dict[str, Any]]:
    return list(cp.get(PODS, params={"labelSelector": f"app.kubernetes.io/instance={name}"})["items"])


def test_create_rolls_out_children_with_owner_references_to_ready(control_plane: ControlPlane,
                                                                  operator: Operator) -> None:
    created = control_plane.create(ISVCS, make("alpha", replicas=2))
    uid = created["metadata"]["uid"]
    obj = wait_for(lambda: ready_for_generation(control_plane, "alpha", 1), timeout=90,
                   what="alpha Ready for generation 1")
    expected_ref = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "name": "alpha",
                    "uid": uid, "controller": True, "blockOwnerDeletion": True}
    for path in (f"{DEPLOYMENTS}/alpha", f"/api/v1/namespaces/{NS}/services/alpha",
                 f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/alpha"):
        assert control_plane.get(path)["metadata"]["ownerReferences"] == [expected_ref], path
    dep = control_plane.get(f"{DEPLOYMENTS}/alpha")
    # The real Deployment controller's view, not a status a test wrote.
    assert dep["status"]["readyReplicas"] == 2 and dep["status"]["updatedReplicas"] == 2
    assert condition(dep, "Available")["status"] == "True"
    pods = pods_of(control_plane, "alpha")
    assert len(pods) == 2
    assert {p["spec"]["nodeName"] for p in pods} == {"kwok-gpu-0"}  # bound by kube-scheduler
    assert all(p["status"]["phase"] == "Running" for p in pods)
    st = obj["status"]
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (2, 2, 2)
    assert st["lastGoodEngine"]["maxNumBatchedTokens"] == 2048
    assert condition(obj, "Progressing")["reason"] == "RolloutComplete"


def test_an_engine_change_surges_without_losing_a_ready_pod(control_plane: ControlPlane,
                                                            operator: Operator) -> None:
    before = control_plane.get(f"{DEPLOYMENTS}/alpha")
    assert before["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    listing = control_plane.get(PODS)
    watch = Watch(control_plane, PODS, resource_version=listing["metadata"]["resourceVersion"],
                  label_selector="app.kubernetes.io/instance=alpha")
    try:
        control_plane.merge_patch(f"{ISVCS}/alpha", {"spec": {"engine": {"maxNumBatchedTokens": 4096}}})
        obj = wait_for(lambda: ready_for_generation(control_plane, "alpha", 2), timeout=90,
                       what="alpha Ready for generation 2")
        wait_for(lambda: all(engine_arg(p, "--max-num-batched-tokens") == "4096"
                             for p in pods_of(control_plane, "alpha")) and len(pods_of(control_plane, "alpha")) == 2,
                 timeout=60, what="only 4096 pods left")
    finally:
        events = watch.stop()
    assert obj["status"]["lastGoodEngine"]["maxNumBatchedTokens"] == 4096
    # One write, of the Deployment only: what the API server defaulted into the children (Service
    # clusterIP and ipFamilies, probe and container defaults, ...) is not drift.
    (updated,) = [e["message"] for e in events_for(control_plane, "alpha", "Updated")]
    assert updated.startswith("Updated Deployment alpha: ") and "spec.template" in updated
    assert control_plane.get(f"{DEPLOYMENTS}/alpha")["metadata"]["generation"] == 2
    # Replay the pods' history in the order the API server wrote it.
    live: dict[str, dict[str, Any]] = {p["metadata"]["name"]: p for p in listing["items"]
                                      if p["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == "alpha"}
    most, fewest_ready = len(live), 2
    for type_, pod in events:
        name = pod["metadata"]["name"]
        if type_ == "DELETED" or pod["metadata"].get("deletionTimestamp"):
            live.pop(name, None)
        else:
            live[name] = pod
        most = max(most, len(live))
        ready = [p for p in live.values() if any(c["type"] == "Ready" and c["status"] == "True"
                                                 for c in p.get("status", {}).get("conditions", []))]
        fewest_ready = min(fewest_ready, len(ready))
    assert most == 3, "maxSurge 1: one extra pod while rolling"
    assert fewest_ready == 2, "maxUnavailable 0: never fewer ready pods than replicas"
    new = [p for p in events if p[0] == "ADDED"]
    assert len(new) == 2 and all(engine_arg(p, "--max-num-batched-tokens") == "4096" for _, p in new)


def test_delete_lets_the_garbage_collector_remove_the_children(control_plane: ControlPlane,
                                                               operator: Operator) -> None:
    control_plane.delete(f"{ISVCS}/alpha")
    children = (f"{DEPLOYMENTS}/alpha", f"/api/v1/namespaces/{NS}/services/alpha",
                f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/alpha")
    wait_for(lambda: all(control_plane.get_or_none(p) is None for p in children), timeout=60,
             what="the garbage collector to delete Deployment, Service and PDB")
    wait_for(lambda: not pods_of(control_plane, "alpha"), timeout=60, what="the pods gone")
    replicasets = control_plane.get(f"/apis/apps/v1/namespaces/{NS}/replicasets",
                                    params={"labelSelector": "app.kubernetes.io/instance=alpha"})
    assert replicasets["items"] == []


def events_for(cp: ControlPlane, name: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in cp.get(f"/api/v1/namespaces/{NS}/events")["items"]
            if e["involvedObject"].get("kind") == "InferenceService" and e["involvedObject"].get("name") == name
            and e.get("reason") == reason]


def test_a_never_ready_engine_is_rolled_back_at_the_real_progress_deadline_across_a_restart(
        control_plane: ControlPlane, operator: Operator) -> None:
    """The Deployment controller itself marks the rollout ProgressDeadlineExceeded; the operator
    puts lastGoodEngine back. The bad engine is an image kwok's stages keep not-ready. The operator
    is restarted mid-rollout: the new process finishes the job, and nothing is applied twice."""
    rollout = {"progressDeadlineSeconds": 30, "startupTimeoutSeconds": 10}
    control_plane.create(ISVCS, make("beta", replicas=1, rollout=rollout))
    good = wait_for(lambda: ready_for_generation(control_plane, "beta", 1), timeout=90, what="beta Ready")
    good_image = good["status"]["lastGoodEngine"]["image"]
    assert control_plane.get(f"{DEPLOYMENTS}/beta")["metadata"]["generation"] == 1
    deployments = control_plane.get(DEPLOYMENTS)
    watch = Watch(control_plane, DEPLOYMENTS, resource_version=deployments["metadata"]["resourceVersion"],
                  label_selector="app.kubernetes.io/instance=beta")
    control_plane.merge_patch(f"{ISVCS}/beta", {"spec": {"engine": {"image": NEVER_READY_IMAGE}}})
    # Mid-rollout: the bad template is applied and its surge pod is up but not ready.
    wait_for(lambda: any(p["spec"]["containers"][0]["image"] == NEVER_READY_IMAGE and p["status"].get("podIP")
                         for p in pods_of(control_plane, "beta")), timeout=60, what="the never-ready pod")
    operator.restart()

    obj = wait_for(lambda: condition(o := control_plane.get(f"{ISVCS}/beta"), "Degraded").get("reason")
                   == "RolledBack" and o, timeout=120, what="beta Degraded/RolledBack")
    # Only the Deployment controller writes this condition (no test, no operator does); the
    # rollback replaces it soon, so it is looked for in the Deployment's history.
    history = watch.stop()
    stuck = [condition(dep, "Progressing") for _, dep in history
             if condition(dep, "Progressing").get("reason") == "ProgressDeadlineExceeded"]
    assert stuck, "the Deployment controller never reported ProgressDeadlineExceeded"
    assert stuck[0]["message"] in condition(obj, "Degraded")["message"]
    assert f"image={NEVER_READY_IMAGE}" in condition(obj, "Degraded")["message"].replace("'", "")
    assert obj["spec"]["engine"]["image"] == NEVER_READY_IMAGE  # the user's spec stays as written
    # The decision is written before the Deployment is patched: the template follows a moment later.
    wait_for(lambda: control_plane.get(f"{DEPLOYMENTS}/beta")["spec"]["template"]["spec"]["containers"][0]["image"]
             == good_image, timeout=30, what="beta's template rolled back")
    # The rollback rolls back for real: the never-ready pod goes, one good pod serves.
    wait_for(lambda: [p["spec"]["containers"][0]["image"] for p in pods_of(control_plane, "beta")] == [good_image],
             timeout=60, what="only the good pod left")
    wait_for(lambda: ready_for_generation(control_plane, "beta", 2), timeout=60, what="beta Ready again")
    # Applied once each: the first template, the bad one, the rollback; one Created, one RolledBack.
    assert control_plane.get(f"{DEPLOYMENTS}/beta")["metadata"]["generation"] == 3
    assert len(events_for(control_plane, "beta", "Created")) == 1
    assert len(events_for(control_plane, "beta", "RolledBack")) == 1
    control_plane.delete(f"{ISVCS}/beta")


def test_an_engine_that_cannot_start_is_rolled_back_at_once_in_vllms_words(control_plane: ControlPlane,
                                                                           operator: Operator) -> None:
    """kwok shows the new revision's engine container as a kubelet shows vLLM refusing to start (its
    log's tail as the termination message); the operator, watching pods through the chart's RBAC with
    a server-side label selector, puts lastGoodEngine back at once: the Deployment controller's
    progress deadline (the default hour) is never reached."""
    control_plane.create(ISVCS, make("delta", replicas=1))
    good = wait_for(lambda: ready_for_generation(control_plane, "delta", 1), timeout=90, what="delta Ready")
    good_image = good["status"]["lastGoodEngine"]["image"]
    control_plane.merge_patch(f"{ISVCS}/delta", {"spec": {"engine": {"image": START_UP_FAILS_IMAGE}}})

    obj = wait_for(lambda: condition(o := control_plane.get(f"{ISVCS}/delta"), "Degraded").get("reason")
                   == "RolledBack" and o, timeout=90, what="delta Degraded/RolledBack")
    degraded = condition(obj, "Degraded")
    assert KV_SHORT in degraded["message"], degraded["message"]
    failure = obj["status"]["lastFailure"]
    assert failure["reason"] == "EngineStartupFailed" and failure["pod"].startswith("delta-")
    assert failure["observedGeneration"] == obj["metadata"]["generation"] == 2
    assert obj["spec"]["engine"]["image"] == START_UP_FAILS_IMAGE  # the user's spec stays as written
    # The operator writes its decision before it patches the Deployment (so a failed patch is finished
    # later, not forgotten): the Deployment follows the status, a moment after it.
    dep = wait_for(lambda: (d := control_plane.get(f"{DEPLOYMENTS}/delta"))["spec"]["template"]["spec"]
                   ["containers"][0]["image"] == good_image and d, timeout=30, what="delta's template rolled back")
    assert condition(dep, "Progressing").get("reason") != "ProgressDeadlineExceeded"
    # The rollback rolls back for real: the failing pod goes, one good pod serves.
    wait_for(lambda: [p["spec"]["containers"][0]["image"] for p in pods_of(control_plane, "delta")] == [good_image],
             timeout=60, what="only the good pod left")
    wait_for(lambda: ready_for_generation(control_plane, "delta", 2), timeout=60, what="delta Ready again")
    assert len(events_for(control_plane, "delta", "RolledBack")) == 1
    assert KV_SHORT in events_for(control_plane, "delta", "RolledBack")[0]["message"]


def test_an_operator_killed_mid_rollout_finishes_it_after_a_restart_writing_nothing_twice(
        control_plane: ControlPlane, operator: Operator) -> None:
    """SIGKILL (no clean shutdown) while the new ReplicaSet is surging; the new process must take
    the rollout over from what the API server holds: the Deployment's template is written once for
    the change (its metadata.generation advances once), lastGoodEngine moves once, to the new engine."""
    control_plane.create(ISVCS, make("gamma", replicas=1))
    good = wait_for(lambda: ready_for_generation(control_plane, "gamma", 1), timeout=90, what="gamma Ready")
    assert control_plane.get(f"{DEPLOYMENTS}/gamma")["metadata"]["generation"] == 1
    listing = control_plane.get(ISVCS)
    history = Watch(control_plane, ISVCS, resource_version=listing["metadata"]["resourceVersion"])
    try:
        control_plane.merge_patch(f"{ISVCS}/gamma", {"spec": {"engine": {"image": HELD_IMAGE}}})
        # Mid-rollout: the new ReplicaSet's pod exists (held Pending by kwok), the old one still serves.
        held = wait_for(lambda: [p for p in pods_of(control_plane, "gamma")
                                 if p["spec"]["containers"][0]["image"] == HELD_IMAGE], timeout=60,
                        what="the new ReplicaSet's surge pod")
        assert len(pods_of(control_plane, "gamma")) == 2
        assert control_plane.get(f"{DEPLOYMENTS}/gamma")["metadata"]["generation"] == 2
        operator.kill_and_restart()
        # The new process has looked at gamma (kopf resumes every object it finds) before the
        # rollout can finish; it must see nothing to write.
        wait_for(lambda: '"gamma"' in operator.current.log(), timeout=60, what="the new operator to take up gamma")
        held_up = control_plane.get(f"{ISVCS}/gamma")
        assert held_up["status"]["lastGoodEngine"] == good["status"]["lastGoodEngine"], "not good before it is Ready"
        assert control_plane.get(f"{DEPLOYMENTS}/gamma")["metadata"]["generation"] == 2
        for pod in held:
            control_plane.merge_patch(f"{PODS}/{pod['metadata']['name']}",
                                      {"metadata": {"annotations": {RELEASE_ANNOTATION: "true"}}})
        obj = wait_for(lambda: ready_for_generation(control_plane, "gamma", 2), timeout=90,
                       what="gamma Ready for generation 2")
        wait_for(lambda: [p["spec"]["containers"][0]["image"] for p in pods_of(control_plane, "gamma")] == [HELD_IMAGE],
                 timeout=60, what="only the new pod left")
    finally:
        events = history.stop()
    assert obj["status"]["lastGoodEngine"]["image"] == HELD_IMAGE
    dep = control_plane.get(f"{DEPLOYMENTS}/gamma")
    assert dep["metadata"]["generation"] == 2, "the Deployment's template was written more than once"
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == HELD_IMAGE
    assert len(events_for(control_plane, "gamma", "Updated")) == 1
    # lastGoodEngine, as the API server stored it write by write: the old engine, then the new, once.
    images = [(o.get("status") or {}).get("lastGoodEngine", {}).get("image") for _, o in events
              if o["metadata"]["name"] == "gamma"]
    changes = [b for a, b in zip(images, images[1:], strict=False) if a != b]
    assert changes == [HELD_IMAGE], f"lastGoodEngine went {images}"
    assert not [e for e in events_for(control_plane, "gamma", "RolledBack")]
    control_plane.delete(f"{ISVCS}/gamma")
