from __future__ import annotations

from kvpilot.operator.builders import build_deployment
from kvpilot.operator.builders.diff import drift, owned_fields
from tests.unit.operator.fixtures import isvc


def test_live_object_with_server_defaults_is_in_sync() -> None:
    desired = {"spec": {"replicas": 2, "ports": [{"name": "http", "port": 8000}],
                        "resources": {"limits": {"nvidia.com/gpu": 1}}}}
    live = {"metadata": {"uid": "u", "resourceVersion": "9"}, "status": {"x": 1},
            "spec": {"replicas": 2, "clusterIP": "10.0.0.1",
                     "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}}
    assert drift(desired, live) == []


def test_drift_names_the_paths_that_differ() -> None:
    desired = {"spec": {"replicas": 2, "args": ["a", "b"], "flag": True}}
    assert drift(desired, {"spec": {"replicas": 3, "args": ["a", "b"], "flag": True}}) == ["spec.replicas"]
    assert drift(desired, {"spec": {"replicas": 2, "args": ["a"], "flag": True}}) == ["spec.args"]
    assert drift(desired, {"spec": {"replicas": 2, "args": ["a", "c"], "flag": True}}) == ["spec.args[1]"]
    assert drift(desired, {"spec": {"replicas": 2, "args": ["a", "b"], "flag": "True"}}) == ["spec.flag"]
    assert drift(desired, {}) == ["spec"]


def test_owned_fields_of_a_deployment() -> None:
    dep = build_deployment(isvc())
    owned = owned_fields(dep)
    assert set(owned) == {"metadata", "spec"}
    assert set(owned["metadata"]) == {"labels", "annotations", "ownerReferences"}
    assert drift(owned, {**dep, "status": {"replicas": 2}}) == []
