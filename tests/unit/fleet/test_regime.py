"""GPUs a config needs for a load, and the rule for switching configs when the load's regime changes."""

from __future__ import annotations

import math

import pytest

from kvpilot.fleet.planner import Planner, Policy
from kvpilot.fleet.regime import (
    KEEP_NONE,
    KEEP_RATIO,
    KEEP_SMALL,
    KEEP_UNKNOWN,
    SWITCH,
    RegimeRule,
    gpus_needed,
    regime_change,
    whole_gpus,
)


def test_gpus_are_the_load_over_one_replicas_capacity_at_the_target_times_its_gpus() -> None:
    # fleet_cost's night: 6 req/s of long prompts; a 1,024-token chunk sustains 6.8 req/s per replica,
    # 8,192 tokens 2.4.
    assert gpus_needed(6.0, 6.8) == pytest.approx(6.0 / (6.8 * 0.8))
    assert gpus_needed(6.0, 2.4) == pytest.approx(3.125)
    assert gpus_needed(6.0, 2.4, tensor_parallel_size=2) == pytest.approx(6.25)
    assert gpus_needed(6.0, 2.4, target_utilization=1.0) == pytest.approx(2.5)
    assert gpus_needed(0.0, 2.4) == 0.0
    assert gpus_needed(6.0, 0.0) == math.inf  # a config that sustains nothing within the SLO


def test_whole_gpus_round_up_to_replicas_as_the_planner_does() -> None:
    policy = Policy(max_replicas=100)
    planner = Planner(policy, startup_s=120.0)
    for rate, cap in [(6.0, 2.4), (6.0, 6.8), (48.0, 6.0), (0.5, 30.0)]:
        assert whole_gpus(gpus_needed(rate, cap)) == planner.needed(rate, cap)
    assert whole_gpus(3.125, tensor_parallel_size=2) == 4  # 1.56 replicas of 2 GPUs: 2 replicas
    with pytest.raises(ValueError, match="no whole count"):
        whole_gpus(math.inf)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"rate": -1.0, "per_replica_rps": 2.0}, "request rate must be a finite number >= 0, got -1"),
        ({"rate": math.nan, "per_replica_rps": 2.0}, "request rate must be a finite number >= 0"),
        ({"rate": 1.0, "per_replica_rps": 2.0, "tensor_parallel_size": 0}, "tensorParallelSize must be >= 1, got 0"),
        ({"rate": 1.0, "per_replica_rps": 2.0, "target_utilization": 1.5}, "targetUtilization must be in (0, 1]"),
    ],
)
def test_bad_inputs_name_the_field(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError) as exc:
        gpus_needed(**kwargs)  # type: ignore[arg-type]
    assert needle in str(exc.value)


def test_a_regime_change_switches_only_for_a_gpu_and_ten_percent() -> None:
    night = regime_change(gpus_needed(6.0, 2.4), gpus_needed(6.0, 6.8))  # 3.1 -> 1.1 GPUs
    assert night.switch and night.reason == SWITCH and night.saving_gpus == pytest.approx(2.022, abs=1e-3)
    assert "worth a rolling update" in night.message
    # fleet_cost's morning: 33 req/s of chat, 29.2 against 35.5 req/s per replica: 18% fewer GPUs,
    # but 0.3 of one: not worth rolling the fleet.
    morning = regime_change(gpus_needed(33.0, 29.24), gpus_needed(33.0, 35.48))
    assert not morning.switch and morning.reason == KEEP_SMALL
    assert morning.message.endswith("under 1 GPU")
    # 100 GPUs to 95: five GPUs, but 5%: the model's error is of that size.
    big = regime_change(100.0, 95.0)
    assert not big.switch and big.reason == KEEP_RATIO and "saves 5.0%, under 10%" in big.message
    assert regime_change(10.0, 9.0).switch  # exactly 1 GPU and 10%
    assert regime_change(4.0, 4.5).reason == KEEP_NONE
    assert regime_change(4.0, math.inf).reason == KEEP_UNKNOWN
    assert regime_change(math.inf, 4.0).switch  # the config in force sustains nothing at this mix


def test_the_thresholds_are_the_rules() -> None:
    assert regime_change(2.0, 1.6, RegimeRule(min_saving_gpus=0.25)).switch
    assert not regime_change(20.0, 17.0, RegimeRule(min_saving_ratio=0.2)).switch
    with pytest.raises(ValueError, match="minSavingRatio must be in \\[0, 1\\), got 1"):
        RegimeRule(min_saving_ratio=1.0)
    with pytest.raises(ValueError, match="minSavingGPUs must be a finite number >= 0, got -1"):
        RegimeRule(min_saving_gpus=-1.0)
    with pytest.raises(ValueError, match="candidate GPUs must be >= 0"):
        regime_change(2.0, -1.0)
