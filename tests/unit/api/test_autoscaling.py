"""spec.autoscaling: HPA v2's shape and defaults, its bounds rule, and the warning for spec.replicas outside them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from kvpilot.api import InferenceService, validate_object
from kvpilot.api.validation import validate_text
from tests.unit.api.corpus import BASE


def doc(replicas: int = 2, **autoscaling: Any) -> dict[str, Any]:
    out = copy.deepcopy(BASE)
    out["spec"]["replicas"] = replicas
    if autoscaling:
        out["spec"]["autoscaling"] = autoscaling
    return out


def test_absent_autoscaling_is_none_and_changes_nothing() -> None:
    assert InferenceService.model_validate(BASE).spec.autoscaling is None
    assert "autoscaling" not in InferenceService.model_validate(BASE).to_wire()["spec"]


def test_only_max_replicas_is_required_and_the_rest_are_hpas_defaults() -> None:
    scaling = InferenceService.model_validate(doc(maxReplicas=6)).spec.autoscaling
    assert scaling is not None
    assert (scaling.actor, scaling.min_replicas, scaling.max_replicas) == ("kvpilot", 1, 6)
    up, down = scaling.behavior.scale_up, scaling.behavior.scale_down
    assert (up.stabilization_window_seconds, up.select_policy) == (0, "Max")
    assert [(p.type, p.value, p.period_seconds) for p in up.policies] == [("Percent", 100, 15), ("Pods", 4, 15)]
    assert (down.stabilization_window_seconds, down.select_policy) == (300, "Max")
    assert [(p.type, p.value, p.period_seconds) for p in down.policies] == [("Percent", 100, 15)]


def test_default_policy_lists_are_not_shared_between_objects() -> None:
    a = InferenceService.model_validate(doc(maxReplicas=6)).spec.autoscaling
    b = InferenceService.model_validate(doc(maxReplicas=6)).spec.autoscaling
    assert a is not None and b is not None
    a.behavior.scale_up.policies.pop()
    assert len(b.behavior.scale_up.policies) == 2


def test_equal_bounds_are_a_fixed_count_and_valid() -> None:
    assert validate_object(doc(replicas=3, minReplicas=3, maxReplicas=3)) == []


def test_max_below_min_names_max_replicas_with_both_values() -> None:
    (issue,) = validate_object(doc(minReplicas=5, maxReplicas=3))
    assert issue.path == "spec.autoscaling.maxReplicas"
    assert issue.message == "must be at least minReplicas (5); got 3"


@pytest.mark.parametrize(("replicas", "warned"), [(1, True), (2, False), (8, False), (9, True), (0, True)])
def test_replicas_outside_the_bounds_is_a_warning_not_an_error(replicas: int, warned: bool) -> None:
    (result,) = validate_text(yaml.safe_dump(doc(replicas=replicas, minReplicas=2, maxReplicas=8)))
    assert result.valid
    warnings = [str(w) for w in result.warnings]
    if warned:
        assert warnings == [f"spec.replicas: {replicas} is outside autoscaling [minReplicas 2, maxReplicas 8]; "
                            "kvpilot's planner (actor: kvpilot) moves it inside at its next decision"]
    else:
        assert warnings == []


def test_the_warning_names_an_external_actor() -> None:
    (result,) = validate_text(yaml.safe_dump(doc(replicas=9, actor="external", maxReplicas=4)))
    assert "the external autoscaler moves it inside" in str(result.warnings[0])


def test_no_warning_without_autoscaling() -> None:
    (result,) = validate_text(yaml.safe_dump(doc(replicas=40)))
    assert result.valid and result.warnings == []
