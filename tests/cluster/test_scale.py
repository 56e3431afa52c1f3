"""The scale subresource on a real control plane: `kubectl scale kvis/NAME` (the real kubectl) writes
spec.replicas through it, the real operator scales the Deployment and says who did it in a Scaled Event
(from the API server's own managedFields), the real Deployment controller and kwok bring the pods, and the
subresource reports status.selector to an autoscaler, counting the stable track's pods and not a canary's.

A real HorizontalPodAutoscaler scaling through this subresource on kvpilot's metric is test_hpa.py's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.cluster import ControlPlane, Operator, wait_for
from tests.cluster.common import SERVING

pytestmark = pytest.mark.cluster

NS = SERVING
ISVCS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
NAME = "scaled"
SELECTOR = f"kvpilot.dev/inferenceservice={NAME},kvpilot.dev/track=stable"


def ready_at(cp: ControlPlane, generation: int, replicas: int) -> dict[str, Any] | None:
    obj = cp.get(f"{ISVCS}/{NAME}")
    st = obj.get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
    ok = st.get("observedGeneration") == generation and ready and st.get("readyReplicas") == replicas
    return dict(obj) if ok else None


def running_pods(cp: ControlPlane, selector: str) -> list[str]:
    pods = cp.get(PODS, params={"labelSelector": selector})["items"]
    return sorted(p["metadata"]["name"] for p in pods
                  if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp"))


def scaled_events(cp: ControlPlane) -> list[str]:
    return [e["message"] for e in cp.get(f"/api/v1/namespaces/{NS}/events")["items"]
            if e["involvedObject"].get("kind") == "InferenceService" and e["involvedObject"].get("name") == NAME
            and e.get("reason") == "Scaled"]


def test_kubectl_scale_scales_the_deployment_and_the_subresource_reports_the_stable_selector(
        control_plane: ControlPlane, operator: Operator) -> None:
    control_plane.create(ISVCS, {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                 "metadata": {"name": NAME, "namespace": NS},
                                 "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2,
                                          "autoscaling": {"actor": "external", "maxReplicas": 4}}})
    wait_for(lambda: ready_at(control_plane, 1, 2), timeout=90, what=f"{NAME} Ready with 2 replicas")

    out = control_plane.kubectl("scale", f"kvis/{NAME}", "-n", NS, "--replicas", "3").stdout
    assert out.strip() == f"inferenceservice.kvpilot.dev/{NAME} scaled"
    wait_for(lambda: control_plane.get(f"{DEPLOYMENTS}/{NAME}")["spec"]["replicas"] == 3, timeout=30,
             what="the Deployment at 3 replicas")
    obj = wait_for(lambda: ready_at(control_plane, 2, 3), timeout=90, what=f"{NAME} Ready with 3 replicas")
    assert (obj["spec"]["replicas"], obj["status"]["replicas"], obj["status"]["selector"]) == (3, 3, SELECTOR)
    (message,) = wait_for(lambda: scaled_events(control_plane), timeout=30, what="the Scaled event")
    assert message == "Scaled from 2 to 3 replicas (spec.replicas written by kubectl through the scale subresource)"

    # What an HPA reads: the subresource's replicas and selector, which select the 3 stable pods ...
    scale = control_plane.get(f"{ISVCS}/{NAME}/scale")
    assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
    assert (scale["spec"]["replicas"], scale["status"]["replicas"], scale["status"]["selector"]) == (3, 3, SELECTOR)
    assert len(running_pods(control_plane, scale["status"]["selector"])) == 3

    # ... and not a canary's pod beside them (an HPA would size spec.replicas for one pod too many).
    canary = {"trial": 1, "engine": {"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256}}
    control_plane.merge_patch(f"{ISVCS}/{NAME}", {"metadata": {"annotations": {
        "kvpilot.dev/canary": json.dumps(canary)}}})
    wait_for(lambda: len(running_pods(control_plane, f"kvpilot.dev/inferenceservice={NAME}")) == 4, timeout=60,
             what="the canary's pod running beside the 3 stable ones")
    assert len(running_pods(control_plane, control_plane.get(f"{ISVCS}/{NAME}/scale")["status"]["selector"])) == 3

    # kubectl's columns: the desired and ready counts, and with -o wide what `get deployments` shows besides.
    lines = control_plane.kubectl("get", "kvis", NAME, "-n", NS, "-o", "wide").stdout.splitlines()
    assert lines[0].split()[:5] == ["NAME", "DESIRED", "READY", "UP-TO-DATE", "AVAILABLE"]
    assert lines[1].split()[:5] == [NAME, "3", "3", "3", "3"]
    assert len(scaled_events(control_plane)) == 1
    control_plane.delete(f"{ISVCS}/{NAME}")


def test_a_scale_write_meets_the_crds_rules(control_plane: ControlPlane, operator: Operator) -> None:
    """The subresource writes spec.replicas of the whole object, which the API server validates as any write:
    a count the CRD's CEL rules refuse is refused to `kubectl scale` (and an HPA) too."""
    control_plane.create(ISVCS, {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                 "metadata": {"name": "no-surge", "namespace": NS},
                                 "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2,
                                          "rollout": {"maxSurge": 0}}})
    refused = control_plane.kubectl("scale", "kvis/no-surge", "-n", NS, "--replicas", "1", check=False)
    assert refused.returncode != 0
    assert "with replicas 1, rollout.maxSurge 0 takes the service down" in refused.stderr
    assert control_plane.get(f"{ISVCS}/no-surge")["spec"]["replicas"] == 2
    control_plane.delete(f"{ISVCS}/no-surge")
