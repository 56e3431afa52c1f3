"""KMock's InferenceService scale subresource, as the API server serves a CRD's: a Scale to read, a write
that changes only spec.replicas and records its field manager as the owner, with subresource scale."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.kmock_api import ApiError, KMockAPI

NS = "scale"


@pytest.fixture
def api() -> Iterator[KMockAPI]:
    with KMockAPI() as running:
        yield running


def test_scale_reads_and_writes_spec_replicas_under_the_writers_name(api: KMockAPI) -> None:
    api.create_isvc({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"name": "s", "namespace": NS},
                     "spec": {"model": "m", "replicas": 2, "engine": {"maxNumSeqs": 64}}})
    path = api.isvc_path(NS, "s") + "/scale"
    scale = api.get(path)
    assert (scale["apiVersion"], scale["kind"], scale["spec"]) == ("autoscaling/v1", "Scale", {"replicas": 2})
    first = api.get_isvc(NS, "s")

    answer = api.request("PATCH", path + "?fieldManager=kvpilot-planner", {"spec": {"replicas": 5}})
    assert answer["kind"] == "Scale" and answer["spec"] == {"replicas": 5}
    obj = api.get_isvc(NS, "s")
    assert obj["spec"] == {"model": "m", "replicas": 5, "engine": {"maxNumSeqs": 64}}
    assert obj["metadata"]["generation"] == first["metadata"]["generation"] + 1
    (entry,) = obj["metadata"]["managedFields"]
    assert (entry["manager"], entry["subresource"], entry["fieldsV1"]) == (
        "kvpilot-planner", "scale", {"f:spec": {"f:replicas": {}}})
    # Another writer takes spec.replicas over: one owner at a time.
    api.request("PATCH", path + "?fieldManager=kubectl", {"spec": {"replicas": 3}})
    owners = [f["manager"] for f in api.get_isvc(NS, "s")["metadata"]["managedFields"]]
    assert owners == ["kubectl"]

    with pytest.raises(ApiError) as refused:
        api.request("PATCH", path + "?fieldManager=x", {"spec": {"replicas": -1}})
    assert refused.value.status == 422 and "spec.replicas" in refused.value.body
