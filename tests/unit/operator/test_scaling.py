"""The scale subresource's selector (status.selector) and the Scaled Event's words (builders.scaling)."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.builders.canary import CanaryRequest, build_canary_deployment
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.scaling import Writer, deployment_replicas, replicas_writer, scaled_message
from kvpilot.operator.builders.status import desired_status
from tests.unit.operator.fixtures import isvc


def matches(selector: str, labels: dict[str, str]) -> bool:
    """An equality-based selector string (`a=b,c=d`) applied as the API server applies it."""
    return all(labels.get(key) == value for key, value in (term.split("=", 1) for term in selector.split(",")))


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return dict(deployment["spec"]["template"]["metadata"]["labels"])


def test_the_selector_counts_the_stable_pods_and_not_the_canarys() -> None:
    service = isvc(replicas=3)
    stable = build_deployment(service)
    canary = build_canary_deployment(service, CanaryRequest(1, {"maxNumBatchedTokens": 4096}))
    selector = desired_status(generation=1, previous={}, deployment=stable)["selector"]
    # Formatted as the API server formats a Deployment's scale selector: sorted keys.
    assert selector == f"kvpilot.dev/inferenceservice={service.metadata.name},kvpilot.dev/track=stable"
    assert matches(selector, pod_labels(stable))
    assert not matches(selector, pod_labels(canary))


def test_no_selector_before_the_deployment_exists() -> None:
    assert "selector" not in desired_status(generation=1, previous={}, deployment=None)


def test_available_replicas_come_from_the_deployment() -> None:
    dep = build_deployment(isvc(replicas=3))
    dep["status"] = {"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3, "availableReplicas": 2}
    status = desired_status(generation=1, previous={}, deployment=dep)
    assert (status["replicas"], status["readyReplicas"], status["availableReplicas"]) == (3, 3, 2)


def entry(manager: str, time: str, fields: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"manager": manager, "operation": "Update", "apiVersion": "kvpilot.dev/v1alpha1",
                           "time": time, "fieldsType": "FieldsV1", "fieldsV1": fields}
    if subresource:
        out["subresource"] = subresource
    return out


REPLICAS = {"f:spec": {"f:replicas": {}}}
ENGINE = {"f:spec": {"f:engine": {"f:maxNumBatchedTokens": {}}}}


def test_the_writer_is_the_manager_holding_spec_replicas() -> None:
    meta = {"managedFields": [
        entry("kubectl-client-side-apply", "2026-12-07T10:00:00Z", {"f:spec": {"f:model": {}}}),
        entry("kvpilot-tuner", "2026-12-07T12:00:00Z", ENGINE),
        entry("kubectl", "2026-12-07T11:00:00Z", REPLICAS, subresource="scale"),
        entry("kvpilot", "2026-12-07T12:30:00Z", {"f:status": {"f:replicas": {}}}, subresource="status"),
    ]}
    assert replicas_writer(meta) == Writer("kubectl", "scale")


def test_of_managers_sharing_spec_replicas_the_latest_wrote_it() -> None:
    meta = {"managedFields": [entry("kube-controller-manager", "2026-12-07T11:00:05Z", REPLICAS, "scale"),
                              entry("argocd-controller", "2026-12-07T11:00:00Z", REPLICAS)]}
    assert replicas_writer(meta) == Writer("kube-controller-manager", "scale")


def test_an_object_that_does_not_tell_has_no_writer() -> None:
    assert replicas_writer({}) is None
    assert replicas_writer({"managedFields": [entry("kubectl", "T", ENGINE), {"manager": 3}, "junk"]}) is None


def test_the_scaled_message_says_from_to_and_who() -> None:
    assert scaled_message(2, 3, Writer("kubectl", "scale")) == \
        "Scaled from 2 to 3 replicas (spec.replicas written by kubectl through the scale subresource)"
    assert scaled_message(3, 1, Writer("argocd-controller")) == \
        "Scaled from 3 to 1 replicas (spec.replicas written by argocd-controller)"
    assert scaled_message(1, 0, None) == "Scaled from 1 to 0 replicas"


def test_deployment_replicas_reads_spec_replicas() -> None:
    assert deployment_replicas({"spec": {"replicas": 4}}) == 4
    assert deployment_replicas(None) is None and deployment_replicas({"spec": {}}) is None
