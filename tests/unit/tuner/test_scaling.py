"""The planner in the tuner, its pure parts: the PromQL it asks, what the answers mean, spec.autoscaling as
the planner's policy, and which writes a decision makes (only on change; Events throttled)."""

from __future__ import annotations

import math

import pytest

from kvpilot.api.models import AutoscalingSpec
from kvpilot.fleet import planner
from kvpilot.fleet.planner import Decision
from kvpilot.slo.objectives import SloTarget
from kvpilot.tuner.capacity import DEFAULT_MIX, mix_spec
from kvpilot.tuner.scaling import (
    EVENT_MIN_INTERVAL_S,
    REASONS,
    Readings,
    Reporter,
    ScalingQueries,
    demand_window_s,
    mix_bucket,
    policy_from_spec,
    startup_seconds,
)

SEL = 'namespace="prod",kvpilot_dev_inferenceservice="llama"'


def test_queries_select_the_service_series_over_four_reads() -> None:
    q = ScalingQueries.for_target(SloTarget("prod", "llama"), demand_window_s(30.0))
    assert q.rate == (f"sum(rate(vllm:time_to_first_token_seconds_count{{{SEL}}}[120s]))")
    assert q.prompt_tokens == (f"sum(rate(vllm:request_prompt_tokens_sum{{{SEL}}}[120s])) / "
                               f"sum(rate(vllm:request_prompt_tokens_count{{{SEL}}}[120s]))")
    assert "vllm:request_generation_tokens_sum" in q.output_tokens
    assert q.ttft_p99.startswith("histogram_quantile(0.99, ") and "[120s]" in q.ttft_p99
    assert "vllm:inter_token_latency_seconds_bucket" in q.itl_p99


def test_burn_queries_are_the_alerts_conditions_on_the_recordings() -> None:
    q = ScalingQueries.for_target(SloTarget("prod", "llama"), 120.0)
    ident = '{namespace="prod",inferenceservice="llama"}'
    # Fast: the page alert on 1h and 5m at 14.4x, for either SLI.
    for sli in ("ttft", "itl"):
        assert f"kvpilot:slo_{sli}_error_ratio:rate1h{ident} / 0.01 > 14.4" in q.fast_burn
        assert f"kvpilot:slo_{sli}_error_ratio:rate5m{ident} / 0.01 > 14.4" in q.fast_burn
    assert "rate6h" not in q.fast_burn and "\n" not in q.fast_burn
    assert f"kvpilot:slo_ttft_error_ratio:rate6h{ident} / 0.01 > 6" in q.slow_burn
    assert "rate3d" in q.slow_burn and "rate1h" not in q.slow_burn
    assert "kvpilot:slo_ttft_error_budget_remaining:ratio" in q.budget_left and 'inferenceservice="llama"' in q.budget_left


@pytest.mark.parametrize("rate", [None, math.nan, -1.0])
def test_no_rate_is_no_demand_not_zero_demand(rate: float | None) -> None:
    assert Readings(at=5.0, rate=rate, prompt_tokens=100.0).demand() is None


def test_demand_and_burn_from_readings() -> None:
    r = Readings(at=5.0, rate=12.5, prompt_tokens=800.0, output_tokens=math.nan, fast_burn=True,
                 budget_left=math.nan)
    d = r.demand()
    assert d is not None and (d.at, d.rate, d.prompt_tokens, d.output_tokens) == (5.0, 12.5, 800.0, 0.0)
    assert Readings(at=0.0, rate=0.0).demand() is not None  # no traffic, measured: a demand of 0
    b = r.burn()
    assert (b.fast, b.slow, b.budget_left) == (True, False, None)


def test_the_requests_in_flight_give_the_rate_now_by_littles_law() -> None:
    q = ScalingQueries.for_target(SloTarget("prod", "llama"), 120.0)
    assert q.in_flight == (f"sum(vllm:num_requests_running{{{SEL}}}) + sum(vllm:num_requests_waiting{{{SEL}}})")
    assert q.e2e_mean == (f"sum(rate(vllm:e2e_request_latency_seconds_sum{{{SEL}}}[120s])) / "
                          f"sum(rate(vllm:e2e_request_latency_seconds_count{{{SEL}}}[120s]))")
    d = Readings(at=5.0, rate=20.0, in_flight=160.0, e2e_mean_s=4.0).demand()
    assert d is not None and d.in_flight_rate == 40.0
    for in_flight, e2e in ((None, 4.0), (160.0, None), (160.0, 0.0), (math.nan, 4.0)):
        d = Readings(at=5.0, rate=20.0, in_flight=in_flight, e2e_mean_s=e2e).demand()
        assert d is not None and d.in_flight_rate is None


def test_the_forecast_horizon_is_the_twins_start_up_of_the_model() -> None:
    from kvpilot.api import InferenceService
    from kvpilot.twin.coldstart import predict_cold_start
    from kvpilot.twin.models import resolve_model

    def isvc(model: str, tp: int) -> InferenceService:
        return InferenceService.model_validate({
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "prod"},
            "spec": {"model": model, "engine": {"tensorParallelSize": tp},
                     "resources": {"gpus": tp, "gpuType": "H100-80GB"}}})

    small = startup_seconds(isvc("meta-llama/Llama-3.1-8B-Instruct", 1))
    assert small == predict_cold_start(resolve_model("Llama-3.1-8B")).total_s
    assert startup_seconds(isvc("meta-llama/Llama-3.1-70B-Instruct", 4)) > small
    assert startup_seconds(isvc("acme/unknown-model", 1)) == 120.0


def test_policy_from_hpa_defaults_and_from_disabled_directions() -> None:
    p = policy_from_spec(AutoscalingSpec.model_validate({"minReplicas": 2, "maxReplicas": 8}))
    assert (p.min_replicas, p.max_replicas) == (2, 8)
    assert (p.scale_up_max_pods, p.scale_up_max_percent, p.scale_up_period_s) == (4, 100.0, 15.0)
    assert (p.scale_down_stabilization_s, p.scale_down_max_percent, p.scale_down_period_s) == (300.0, 100.0, 15.0)
    p = policy_from_spec(AutoscalingSpec.model_validate({"maxReplicas": 8, "behavior": {
        "scaleUp": {"selectPolicy": "Disabled"},
        "scaleDown": {"stabilizationWindowSeconds": 60, "selectPolicy": "Min",
                      "policies": [{"type": "Percent", "value": 10, "periodSeconds": 60},
                                   {"type": "Percent", "value": 50, "periodSeconds": 120}]}}}))
    assert (p.scale_up_max_pods, p.scale_up_max_percent) == (0, 0.0)
    assert (p.scale_down_stabilization_s, p.scale_down_max_percent, p.scale_down_period_s) == (60.0, 10.0, 60.0)


def _d(desired: int, reason: str) -> Decision:
    return Decision(desired, reason, f"{reason} message", 10.0, desired)


def test_a_count_change_writes_the_scale_an_event_and_the_condition_once() -> None:
    rep = Reporter()
    a = rep.step(0.0, 2, _d(4, planner.LOAD_RISING), None)
    assert a.replicas == 4
    assert a.event == ("Normal", "LoadRising", "Scaling from 2 to 4 replicas: LoadRising message")
    assert a.condition == ("True", "LoadRising", "LoadRising message")
    # The next read: the count is in force, the condition written; the same reason again is no news.
    a = rep.step(1.0, 4, _d(4, planner.LOAD_RISING), ("True", "LoadRising"))
    assert (a.replicas, a.event, a.condition) == (None, None, None)


def test_held_reasons_changing_tell_once_a_minute_and_steady_state_not_at_all() -> None:
    rep = Reporter()
    a = rep.step(0.0, 4, _d(4, planner.HELD_STABILIZING), None)
    assert a.event == ("Normal", "ScaleDownStabilizing", "ScaleDownStabilizing message") and a.replicas is None
    a = rep.step(10.0, 4, _d(4, planner.HELD_UNSETTLED), ("True", "ScaleDownStabilizing"))
    assert a.event is None  # within the minute: the condition says it, no Event
    assert a.condition == ("True", "LoadUnsettled", "LoadUnsettled message")
    a = rep.step(10.0 + EVENT_MIN_INTERVAL_S, 4, _d(4, planner.HELD_STABILIZING), ("True", "LoadUnsettled"))
    assert a.event is not None and a.event[1] == "ScaleDownStabilizing"
    a = rep.step(500.0, 4, _d(4, planner.STEADY), ("True", "ScaleDownStabilizing"))
    assert a.event is None and a.condition == ("True", "AtDemand", "AtDemand message")


def test_no_data_holds_with_a_false_condition_and_a_warning() -> None:
    a = Reporter().step(0.0, 3, _d(3, planner.HELD_NO_DATA), ("True", "AtDemand"))
    assert a.replicas is None
    assert a.event == ("Warning", "NoDemandData", "NoDemandData message")
    assert a.condition == ("False", "NoDemandData", "NoDemandData message")


def test_reasons_are_a_bounded_camelcase_set() -> None:
    assert len(REASONS) == len(set(REASONS)) <= 20
    assert all(r[0].isupper() and r.isalnum() for r in REASONS)
    assert {planner.LOAD_RISING, planner.FAST_BURN, planner.LOAD_FELL, planner.HELD_NO_DATA} <= set(REASONS)


def test_mix_buckets_are_a_quarter_power_of_two_apart() -> None:
    assert mix_bucket(1000.0, 250.0) == mix_bucket(1050.0, 260.0) == (1024, 256)
    assert mix_bucket(1300.0, 250.0) != mix_bucket(1000.0, 250.0)
    assert mix_spec(0.0, 0.0) == DEFAULT_MIX
    # Medians whose lognormal means are the bucket's.
    assert mix_spec(1000.0, 250.0) == "prompt=lognormal/904/0.5,output=lognormal/226/0.5"
