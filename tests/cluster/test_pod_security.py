"""The chart's objects and the operator's twin pods against the API server's own admission:
schema validation of every rendered object, and the built-in Pod Security admission enforcing
"restricted" (tests/unit/ship/pss.py is a hand-written reading of that standard; this is the real one).
"""

from __future__ import annotations

from typing import Any

import pytest

from harness import chart
from harness.cluster import ApiError, ControlPlane, Operator, wait_for
from kvpilot.api.models import InferenceService
from kvpilot.operator.builders import RenderOptions
from kvpilot.operator.builders.deployment import pod_template

pytestmark = pytest.mark.cluster

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return {}


def replica_set_failures(cp: ControlPlane, namespace: str) -> list[str]:
    events = cp.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return [e["message"] for e in events if e.get("reason") == "FailedCreate"]


def test_the_chart_installs_and_its_pods_pass_restricted_pod_security(
        control_plane: ControlPlane, chart_identities: dict[str, str], crd: dict[str, Any]) -> None:
    ns = chart.NAMESPACE
    control_plane.merge_patch(f"/api/v1/namespaces/{ns}", {"metadata": {"labels": RESTRICTED}})
    # What `helm install` would create (default values; CRDs come from crds/, not templates), and the
    # pod `helm test` creates (the hook, templates/tests/): applied here, it is admitted or refused at once.
    objects = [r.obj for r in chart.render("default")]
    control_plane.apply_manifests(objects)
    deployments = [o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"]
    assert len(deployments) == 2  # operator and tuner
    (hook,) = [o["metadata"]["name"] for o in objects if o["kind"] == "Pod"]
    assert control_plane.get(f"/api/v1/namespaces/{ns}/pods/{hook}")

    def admitted() -> bool:
        pods = control_plane.get(f"/api/v1/namespaces/{ns}/pods")["items"]
        owners = {p["metadata"]["ownerReferences"][0]["name"].rsplit("-", 1)[0] for p in pods
                  if p["metadata"].get("ownerReferences")}
        return set(deployments) <= owners
    wait_for(admitted, timeout=60, what=f"a pod of each of {deployments} created (admitted)")
    assert replica_set_failures(control_plane, ns) == []
    operator_name = next(n for n in deployments if n.endswith("operator"))
    wait_for(lambda: condition(control_plane.get(f"/apis/apps/v1/namespaces/{ns}/deployments/{operator_name}"),
                               "Available").get("status") == "True", timeout=60, what="the operator Deployment Available")
    # Leave the chart's Deployments at zero: their pods would never run anything here anyway.
    for name in deployments:
        control_plane.merge_patch(f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", {"spec": {"replicas": 0}})
    # No operator answers the webhook now, and the chart's failurePolicy is Fail: the API server
    # refuses an InferenceService write rather than admit it unchecked.
    webhook = next(o for o in objects if o["kind"] == "ValidatingWebhookConfiguration")
    assert webhook["webhooks"][0]["failurePolicy"] == "Fail"
    isvcs = "/apis/kvpilot.dev/v1alpha1/namespaces/default/inferenceservices"
    probe = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
             "metadata": {"name": "unchecked", "namespace": "default"},
             "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}}
    with pytest.raises(ApiError) as refused:
        control_plane.create(isvcs, probe, params={"dryRun": "All"})
    assert 'failed calling webhook "validate.inferenceservices.kvpilot.dev"' in refused.value.message
    # The other tests run their operator as a local process, which the API server cannot call.
    control_plane.delete(f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
                         f"{webhook['metadata']['name']}")
    wait_for(lambda: _admitted(control_plane, isvcs, probe), timeout=30, what="writes admitted without the webhook")


def _admitted(cp: ControlPlane, path: str, obj: dict[str, Any]) -> bool:
    try:
        cp.create(path, obj, params={"dryRun": "All"})
    except ApiError:
        return False  # the API server's webhook cache has not dropped the configuration yet
    return True


def test_twin_engine_pods_are_admitted_where_restricted_is_enforced(
        control_plane: ControlPlane, operator: Operator) -> None:
    ns = "restricted"
    control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": ns, "labels": RESTRICTED}})
    wait_for(lambda: control_plane.get_or_none(f"/api/v1/namespaces/{ns}/serviceaccounts/default"),
             timeout=30, what="the default ServiceAccount")
    path = f"/apis/kvpilot.dev/v1alpha1/namespaces/{ns}/inferenceservices"
    control_plane.create(path, {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                "metadata": {"name": "twin", "namespace": ns},
                                "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct", "replicas": 1,
                                         "resources": {"gpus": 0, "memory": "512Mi", "shmSize": "64Mi"},
                                         "engine": {"kind": "twin", "twin": {"gpu": "H100-80GB"}}}})

    def ready() -> bool:
        obj = control_plane.get(f"{path}/twin")
        return condition(obj, "Ready").get("status") == "True"
    try:
        wait_for(ready, timeout=90, what="the twin InferenceService Ready")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; ReplicaSet failures: {replica_set_failures(control_plane, ns)}") from None
    assert replica_set_failures(control_plane, ns) == []
    # The control case: a vLLM engine pod (it needs more than "restricted" allows) is refused there.
    isvc = InferenceService.model_validate({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                            "metadata": {"name": "vllm", "namespace": ns},
                                            "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm", "namespace": ns},
           "spec": pod_template(isvc, RenderOptions())["spec"]}
    with pytest.raises(ApiError) as refused:
        control_plane.create(f"/api/v1/namespaces/{ns}/pods", pod, params={"dryRun": "All"})
    assert refused.value.status == 403
    assert 'violates PodSecurity "restricted:latest"' in refused.value.message
    control_plane.delete(f"{path}/twin")


BASELINE = {"pod-security.kubernetes.io/enforce": "baseline",
            "pod-security.kubernetes.io/enforce-version": "latest"}


def _namespace(cp: ControlPlane, name: str, labels: dict[str, str]) -> None:
    if cp.get_or_none(f"/api/v1/namespaces/{name}") is None:
        cp.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                         "metadata": {"name": name, "labels": labels}})
    # Pod admission looks the pod's ServiceAccount up, token or not.
    wait_for(lambda: cp.get_or_none(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
             timeout=30, what=f"the default ServiceAccount of {name}")


def _vllm_pod(namespace: str, options: RenderOptions) -> dict[str, Any]:
    isvc = InferenceService.model_validate({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                            "metadata": {"name": "vllm", "namespace": namespace},
                                            "spec": {"model": "Qwen/Qwen2.5-0.5B-Instruct"}})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm", "namespace": namespace},
            "spec": pod_template(isvc, options)["spec"]}


def test_vllm_engine_pods_pass_baseline_and_with_an_engine_uid_restricted(control_plane: ControlPlane) -> None:
    """The default vLLM pod (the image's root user, no capabilities) is admitted where "baseline"
    is enforced; with the operator's --engine-run-as-user, where "restricted" is."""
    _namespace(control_plane, "baseline", BASELINE)
    _namespace(control_plane, "restricted-vllm", RESTRICTED)
    for namespace, options in (("baseline", RenderOptions()),
                               ("restricted-vllm", RenderOptions(engine_run_as_user=1001))):
        created = control_plane.create(f"/api/v1/namespaces/{namespace}/pods", _vllm_pod(namespace, options),
                                       params={"dryRun": "All"})
        assert created["spec"]["automountServiceAccountToken"] is False
        # No token volume was injected: the ServiceAccount admission honours the pod's opt-out.
        assert not [v for v in created["spec"].get("volumes", []) if v["name"].startswith("kube-api-access")]


def test_the_charts_network_policies_are_accepted_by_the_api_server(control_plane: ControlPlane) -> None:
    objects = [r.obj for r in chart.render("multi-tenant") if r.kind == "NetworkPolicy"]
    assert {o["metadata"]["namespace"] for o in objects} == {chart.NAMESPACE, "team-a"}
    for namespace in {o["metadata"]["namespace"] for o in objects}:
        _namespace(control_plane, namespace, {})
    for obj in objects:
        ns = obj["metadata"]["namespace"]
        created = control_plane.create(f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", obj,
                                       params={"dryRun": "All"})
        assert created["spec"]["podSelector"] == obj["spec"]["podSelector"]
