"""The fleet twin: the envelope from the step-level twin, and the fleet's ticks (routers, start-up, queues)."""

from __future__ import annotations

import pytest

from kvpilot.api.slo import SLO
from kvpilot.twin.engine import EngineConfig
from kvpilot.twin.fleet import Envelope, FleetTwin, budget_burned, gpu_hours, measure_envelope, windows
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model

SLO_ = SLO(ttft_seconds=0.5, itl_seconds=0.05)
# One replica: fine to 8 req/s, missing 5% of TTFTs at 10, flooded at 12.
ENV = Envelope(rates=(2.0, 4.0, 6.0, 8.0, 10.0, 12.0), ttft_miss=(0.0, 0.0, 0.001, 0.005, 0.05, 0.3),
               itl_miss=(0.0, 0.0, 0.0, 0.002, 0.01, 0.05), e2e_mean_s=(2.0, 2.1, 2.3, 2.6, 3.5, 6.0),
               saturation_rps=12.0)


def run(fleet: FleetTwin, rate: float, seconds: float) -> list:
    return [fleet.step(rate) for _ in range(int(seconds / fleet.tick_s))]


def test_the_envelope_interpolates_and_finds_where_the_p99s_leave_the_slo() -> None:
    assert ENV.at(7.0)[0] == pytest.approx(0.003)
    # Misses cross 1% between 8 (0.5%) and 10 (5%): at 8 + 2 * 0.5 / 4.5
    assert ENV.capacity_rps == pytest.approx(8.0 + 2 * 0.005 / 0.045)
    with pytest.raises(ValueError, match="ascend"):
        Envelope((2.0, 1.0), (0, 0), (0, 0), (1, 1), 3.0)


def test_the_envelope_measured_by_the_step_level_twin_is_ordered_by_load() -> None:
    config = EngineConfig.resolve(resolve_model("meta-llama/Meta-Llama-3-8B-Instruct"), resolve_gpu("H100-80GB"),
                                  max_num_batched_tokens=2048, max_num_seqs=256, gpu_memory_utilization=0.9)
    env = measure_envelope(config, "prompt=512,output=128", SLO_, points=4, duration_s=40, flood_requests=400)
    assert env.rates[-1] == pytest.approx(env.saturation_rps)
    assert env.ttft_miss[0] <= 0.01  # a quarter of saturation is well within the SLO
    assert env.ttft_miss[-1] >= env.ttft_miss[0] and env.e2e_mean_s[-1] >= env.e2e_mean_s[0]
    assert 0 < env.capacity_rps <= env.saturation_rps


def test_a_load_within_capacity_keeps_every_window_and_no_queue() -> None:
    fleet = FleetTwin(ENV, SLO_, startup_s=120, replicas=4, seed=1)
    ticks = run(fleet, 4 * 5.0, 3600)
    assert all(w.attained for w in windows(ticks))
    assert max(t.queued for t in ticks) == 0
    assert gpu_hours(ticks) == pytest.approx(4.0)
    assert budget_burned(ticks, 0.99) < 0.1


def test_an_overload_queues_misses_and_burns_the_budget() -> None:
    fleet = FleetTwin(ENV, SLO_, startup_s=120, replicas=2, seed=1)
    ticks = run(fleet, 2 * 15.0, 600)  # 30 req/s on 24 req/s of saturation
    assert ticks[-1].queued > ticks[0].queued > 0
    assert not any(w.attained for w in windows(ticks)[1:])
    assert budget_burned(ticks, 0.99) > 10


def test_a_new_replica_serves_only_after_its_start_up() -> None:
    fleet = FleetTwin(ENV, SLO_, startup_s=120, replicas=1, seed=1)
    fleet.scale(3)
    ticks = run(fleet, 5.0, 180)
    assert [t.serving for t in ticks[:12]] == [1] * 12  # 0..110 s: still starting
    assert ticks[12].serving == 3 and all(t.provisioned == 3 for t in ticks)


def test_removing_replicas_hands_their_queue_back() -> None:
    fleet = FleetTwin(ENV, SLO_, startup_s=0, replicas=3, seed=1)
    run(fleet, 3 * 20.0, 60)  # overloaded: queues build
    before = sum(r.queued for r in fleet.serving())
    fleet.scale(1)
    assert sum(r.queued for r in fleet.serving()) == pytest.approx(before)
    assert fleet.provisioned == 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_least_outstanding_routing_balances_what_random_spread_leaves_uneven(seed: int) -> None:
    """Near saturation a random spread overloads some replicas while others idle; least outstanding
    requests keeps the queues level, so it misses no more."""
    random = FleetTwin(ENV, SLO_, startup_s=0, replicas=8, router="random", seed=seed)
    lor = FleetTwin(ENV, SLO_, startup_s=0, replicas=8, router="least-outstanding", seed=seed)
    r_ticks, l_ticks = run(random, 8 * 11.5, 1800), run(lor, 8 * 11.5, 1800)
    assert sum(t.bad for t in l_ticks) <= sum(t.bad for t in r_ticks)
    queues = [r.queued for r in lor.serving()]
    assert max(queues) - min(queues) <= 1.0


def test_a_router_out_of_the_list_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="router must be one of random, least-outstanding"):
        FleetTwin(ENV, SLO_, startup_s=0, router="round-robin")


def test_serving_times_are_exact_within_a_tick() -> None:
    fleet = FleetTwin(ENV, SLO(ttft_seconds=0.5, itl_seconds=0.05), startup_s=66.0, replicas=2, tick_s=10.0)
    fleet.step(10.0)
    fleet.scale(3)  # asked at the end of the first tick (10 s): serves from 76 s, not from the 80 s tick
    assert fleet.serving_times() == [0.0, 0.0, 76.0]
    while fleet.now < 76.0:
        fleet.step(10.0)
    assert fleet.now == 80.0 and len(fleet.serving()) == 3
