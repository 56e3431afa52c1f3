"""The replica planner: scale-up on load and on burn, scale-down only when safe, the policy's limits."""

from __future__ import annotations

import pytest

from kvpilot.fleet.planner import (
    AT_MAX,
    FAST_BURN,
    HELD_BUDGET,
    HELD_BURNING,
    HELD_NO_DATA,
    HELD_STABILIZING,
    HELD_UNSETTLED,
    LOAD_FELL,
    LOAD_RISING,
    STEADY,
    UP_LIMITED,
    UP_PENDING,
    Burn,
    Demand,
    Planner,
    Policy,
    corrected_capacity,
)

SCRAPE_S = 15.0
PER_REPLICA = 10.0  # req/s one replica sustains within the SLO
HEALTHY = Burn(budget_left=0.9)


def feed(planner: Planner, rates: list[float], start: float = 0.0) -> float:
    """One sample per scrape; returns the time of the last."""
    t = start
    for i, rate in enumerate(rates):
        t = start + i * SCRAPE_S
        planner.observe(Demand(at=t, rate=rate))
    return t


def test_a_steady_load_keeps_the_count_it_needs() -> None:
    planner = Planner(Policy(max_replicas=20), startup_s=120)
    now = feed(planner, [32.0] * 40)
    decision = planner.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    # 32 req/s at 80% of 10 req/s: ceil(4.0) = 4
    assert (decision.desired, decision.reason) == (4, STEADY)


def test_a_doubled_load_is_met_at_the_next_scrape() -> None:
    planner = Planner(Policy(max_replicas=20), startup_s=120)
    feed(planner, [32.0] * 40)
    now = feed(planner, [64.0], start=40 * SCRAPE_S)
    decision = planner.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    # 64 / 8 req/s at once: the default policy lets the count double within a period (the step's
    # trend asks for more still, which the limit holds back).
    assert decision.desired == 8 and decision.reason in (LOAD_RISING, UP_LIMITED)


def test_a_step_the_scrape_window_only_began_to_show_is_sized_from_the_requests_in_flight() -> None:
    """A step lands a third of the way into the scrape window: the windowed rate shows 42.7 of 64 req/s,
    the requests in flight (Little's law) show the whole of it."""
    planner = Planner(Policy(max_replicas=20), startup_s=120)
    feed(planner, [32.0] * 40)
    now = 40 * SCRAPE_S
    planner.observe(Demand(at=now, rate=42.7, in_flight_rate=64.0))
    decision = planner.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert decision.desired == 8 and decision.forecast_rate >= 64.0
    # Without the gauge the same scrape asks for too few: 42.7 plus the trend's share.
    blind = Planner(Policy(max_replicas=20), startup_s=120)
    feed(blind, [32.0] * 40)
    blind.observe(Demand(at=now, rate=42.7))
    assert blind.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=HEALTHY).desired < 8


def test_in_flight_noise_within_the_band_and_a_fall_are_left_to_the_window() -> None:
    planner = Planner(Policy(max_replicas=20), startup_s=120)
    for i in range(40):
        planner.observe(Demand(at=i * SCRAPE_S, rate=32.0, in_flight_rate=32.0 * (1.15 if i % 2 else 0.5)))
    decision = planner.plan(39 * SCRAPE_S, current=4, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert (decision.desired, decision.reason) == (4, STEADY) and decision.forecast_rate == pytest.approx(32.0)


def test_a_rising_ramp_is_met_before_it_arrives() -> None:
    """A replica takes start-up time to serve: the forecast sizes for the rate at the end of it."""
    planner = Planner(Policy(max_replicas=50), startup_s=300)
    rates = [20.0 + 0.05 * i * SCRAPE_S for i in range(21)]  # +0.05 req/s every second, to 35
    now = feed(planner, rates)
    decision = planner.plan(now, current=3, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert decision.forecast_rate == pytest.approx(rates[-1] + 0.05 * 300, rel=1e-6)
    assert decision.desired == 7  # ceil((35 + 15) / 8); reacting to the rate now would ask for 5


def test_a_fast_burn_adds_replicas_even_when_the_model_says_enough() -> None:
    planner = Planner(Policy(max_replicas=20), startup_s=120)
    now = feed(planner, [32.0] * 40)
    decision = planner.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=Burn(fast=True, budget_left=0.5))
    assert (decision.desired, decision.reason) == (6, FAST_BURN)


def test_a_fast_burn_asks_once_per_start_up_not_at_every_scrape() -> None:
    """The burn lasts while the replicas asked for start: asking again at each scrape would grow the
    fleet by half every 15 s (a first run of benchmarks/fleet_cost.py reached 240 replicas so)."""
    planner = Planner(Policy(max_replicas=100), startup_s=120)
    now = feed(planner, [32.0] * 40)
    burning = Burn(fast=True, budget_left=0.5)
    first = planner.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=burning)
    held = planner.plan(now + SCRAPE_S, current=first.desired, per_replica_rps=PER_REPLICA, burn=burning)
    assert (first.desired, held.desired, held.reason) == (6, 6, UP_PENDING)
    later = planner.plan(now + 121, current=6, per_replica_rps=PER_REPLICA, burn=burning)
    assert (later.desired, later.reason) == (9, FAST_BURN)  # started and serving, and still burning


def _fell(planner: Planner, low: float, scrapes: int) -> float:
    feed(planner, [64.0] * 40)
    return feed(planner, [low] * scrapes, start=40 * SCRAPE_S)


def test_scale_down_waits_out_the_stabilization_window_then_goes_to_what_it_needed() -> None:
    planner = Planner(Policy(max_replicas=20, scale_down_stabilization_s=300, scale_down_max_percent=100),
                      startup_s=120)
    feed(planner, [64.0] * 40)
    t = 40 * SCRAPE_S
    reasons = []
    # The load halves; the planner is asked at every scrape, as it would be.
    for i in range(60):
        now = t + i * SCRAPE_S
        planner.observe(Demand(at=now, rate=32.0))
        decision = planner.plan(now, current=8, per_replica_rps=PER_REPLICA, burn=HEALTHY)
        reasons.append(decision.reason)
        if decision.reason == LOAD_FELL:
            break
    assert decision.reason == LOAD_FELL and decision.desired == 4
    # It held first: an unsettled trend, then the window's higher recommendations.
    assert reasons[0] in (HELD_UNSETTLED, HELD_STABILIZING)
    assert (now - t) >= 300


@pytest.mark.parametrize("burn, reason", [
    (Burn(slow=True, budget_left=0.9), HELD_BURNING),
    (Burn(fast=False, budget_left=0.1), HELD_BUDGET),
    (Burn(), HELD_BUDGET),  # no budget recording: never scale down on a guess
])
def test_scale_down_needs_budget_left_and_no_burn(burn: Burn, reason: str) -> None:
    planner = Planner(Policy(max_replicas=20, scale_down_stabilization_s=0), startup_s=120)
    now = _fell(planner, 16.0, 40)
    decision = planner.plan(now, current=8, per_replica_rps=PER_REPLICA, burn=burn)
    assert (decision.desired, decision.reason) == (8, reason)


def test_the_scale_up_limit_per_period_holds() -> None:
    policy = Policy(max_replicas=100, scale_up_max_pods=2, scale_up_max_percent=50, scale_up_period_s=60)
    planner = Planner(policy, startup_s=60)
    now = feed(planner, [400.0] * 3)
    first = planner.plan(now, current=4, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert (first.desired, first.reason) == (6, UP_LIMITED)  # max(4 + 2, 4 * 1.5)
    # Within the same period the base is still 4: no further step.
    second = planner.plan(now + 10, current=6, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert second.desired == 6
    # A period later the base is 6.
    third = planner.plan(now + 61, current=6, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert third.desired == 9


def test_bounds_and_no_data() -> None:
    planner = Planner(Policy(min_replicas=2, max_replicas=5), startup_s=60)
    assert planner.plan(0.0, current=3, per_replica_rps=PER_REPLICA, burn=HEALTHY).reason == HELD_NO_DATA
    now = feed(planner, [1000.0] * 3)
    decision = planner.plan(now, current=3, per_replica_rps=PER_REPLICA, burn=HEALTHY)
    assert (decision.desired, decision.reason) == (5, AT_MAX)
    assert "maxReplicas 5" in decision.message


def test_telling_the_same_scrape_twice_is_harmless() -> None:
    once, twice = Planner(Policy(), startup_s=60), Planner(Policy(), startup_s=60)
    for rate_at in range(10):
        sample = Demand(at=rate_at * SCRAPE_S, rate=10.0 + rate_at)
        once.observe(sample)
        twice.observe(sample)
        twice.observe(sample)
    assert once.trend() == twice.trend() and once.forecast() == twice.forecast()


def test_capacity_is_corrected_by_measured_against_predicted_within_bounds() -> None:
    assert corrected_capacity(10.0, 0.4, 0.5) == pytest.approx(8.0)
    assert corrected_capacity(10.0, 0.4, 40.0) == pytest.approx(2.5)  # floor 0.25
    assert corrected_capacity(10.0, 0.4, None) == 10.0


def test_a_policy_out_of_range_names_the_fields() -> None:
    with pytest.raises(ValueError, match=r"maxReplicas must be >= minReplicas .*targetUtilization"):
        Policy(min_replicas=5, max_replicas=2, target_utilization=0)
