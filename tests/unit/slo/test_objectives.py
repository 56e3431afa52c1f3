"""Burn-rate factors and SLO targets."""

from __future__ import annotations

import pytest

from kvpilot.api import InferenceService
from kvpilot.slo.objectives import BURN_ALERTS, SloTarget


def test_thirty_day_factors_are_the_sre_workbook_ones() -> None:
    got = [(a.severity, a.long_window, a.short_window, a.factor("30d")) for a in BURN_ALERTS]
    assert got == [
        ("page", "1h", "5m", 14.4),
        ("page", "6h", "30m", 6.0),
        ("ticket", "1d", "2h", 3.0),
        ("ticket", "3d", "6h", 1.0),
    ]


def test_factors_scale_with_the_period() -> None:
    # The same share of a 4-week budget in the same time: 28/30 of the 30-day factors.
    assert [a.factor("4w") for a in BURN_ALERTS] == [13.44, 5.6, 2.8, 0.933333]


def test_target_from_an_inference_service() -> None:
    isvc = InferenceService.model_validate(
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "prod"},
            "spec": {"model": "meta/llama", "replicas": 3, "slo": {"ttftSeconds": 1.0, "itlSeconds": 0.1, "objective": 0.995}},
        }
    )
    t = SloTarget.from_isvc(isvc)
    assert (t.namespace, t.name, t.ttft_seconds, t.itl_seconds, t.objective, t.replicas) == ("prod", "llama", 1.0, 0.1, 0.995, 3)
    assert t.budget == 0.005
    assert str(t.pods) == '{namespace="prod",kvpilot_dev_inferenceservice="llama"}'
    assert t.model_name == "meta/llama"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ttft_seconds": 0.3}, "not a bucket edge"),
        ({"itl_seconds": 0.06}, "not a bucket edge"),
        ({"objective": 1.0}, "strictly between"),
        ({"period": "a month"}, "not a Prometheus duration"),
        ({"name": ""}, "non-empty"),
    ],
)
def test_bad_targets_say_what_is_wrong(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SloTarget(**{"namespace": "ns", "name": "n", **kwargs})
