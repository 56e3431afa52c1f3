"""spec.replicas changed (as `kubectl scale` or an HPA changes it): a real `kvpilot operator` process
against KMock scales the Deployment, says so in a Scaled Event (from, to, who) and reports the scale
subresource's selector in status.

KMock keeps no managedFields of its own: the test writes the entry a real API server records for a
`kubectl scale` (manager kubectl, subresource scale) with the change, as tests/cluster does for real."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from harness.kmock_api import KMockAPI, OperatorProcess, wait_for

pytestmark = pytest.mark.integration

NS = "scaling"
SCALE_ENTRY = {"manager": "kubectl", "operation": "Update", "apiVersion": "kvpilot.dev/v1alpha1",
               "time": "2026-12-07T12:00:00Z", "fieldsType": "FieldsV1",
               "fieldsV1": {"f:spec": {"f:replicas": {}}}, "subresource": "scale"}


@pytest.fixture(scope="module")
def operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    yield operator
    operator.assert_alive()
    operator.assert_no_errors_logged()
    operator.assert_stops_cleanly()


def dep_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def scaled_events(api: KMockAPI, name: str) -> list[str]:
    return [e["message"] for e in api.events(NS) if e.get("reason") == "Scaled"
            and e.get("involvedObject", {}).get("name") == name]


def replicas_of(api: KMockAPI, name: str) -> int | None:
    dep = api.get_or_none(dep_path(name))
    return None if dep is None else int(dep["spec"]["replicas"])


def first_status(api: KMockAPI, name: str, **spec: Any) -> dict[str, Any]:
    api.create_isvc({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"name": name, "namespace": NS},
                     "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", **spec}})
    return dict(wait_for(lambda: (o := api.get_isvc(NS, name)).get("status", {}).get("observedGeneration") == 1
                         and o, what=f"{name}'s first status"))


def test_a_new_replica_count_scales_the_deployment_and_says_who_scaled_it(api: KMockAPI,
                                                                          operator: OperatorProcess) -> None:
    obj = first_status(api, "scaled", replicas=2, autoscaling={"actor": "external", "maxReplicas": 4})
    assert obj["status"]["selector"] == "kvpilot.dev/inferenceservice=scaled,kvpilot.dev/track=stable"
    assert replicas_of(api, "scaled") == 2 and scaled_events(api, "scaled") == []

    api.patch(api.isvc_path(NS, "scaled"), {"metadata": {"managedFields": [SCALE_ENTRY]}, "spec": {"replicas": 3}})
    wait_for(lambda: replicas_of(api, "scaled") == 3, what="the Deployment at 3 replicas")
    (message,) = wait_for(lambda: scaled_events(api, "scaled"), what="the Scaled event")
    assert message == "Scaled from 2 to 3 replicas (spec.replicas written by kubectl through the scale subresource)"
    obj = wait_for(lambda: (o := api.get_isvc(NS, "scaled"))["status"].get("observedGeneration") == 2 and o,
                   what="observedGeneration 2")
    assert obj["status"]["selector"] == "kvpilot.dev/inferenceservice=scaled,kvpilot.dev/track=stable"


def test_an_engine_change_alone_posts_no_scaled_event(api: KMockAPI, operator: OperatorProcess) -> None:
    first_status(api, "steady", replicas=2)
    api.patch(api.isvc_path(NS, "steady"), {"spec": {"engine": {"maxNumBatchedTokens": 4096}}})
    wait_for(lambda: any(e.get("reason") == "Updated" and e["involvedObject"]["name"] == "steady"
                         for e in api.events(NS)), what="the Updated event of the engine change")
    # Then a scale down with no managedFields (an API server that keeps none): from and to, no writer.
    api.patch(api.isvc_path(NS, "steady"), {"spec": {"replicas": 1}})
    wait_for(lambda: replicas_of(api, "steady") == 1, what="the Deployment at 1 replica")
    assert wait_for(lambda: scaled_events(api, "steady"), what="the Scaled event") == ["Scaled from 2 to 1 replicas"]
