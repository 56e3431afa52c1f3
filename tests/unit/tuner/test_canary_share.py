"""A canary's share of the requests moves with the fleet (one pod among N+1); the loop reads each track
in the service's terms (kvpilot/tuner/core/tracks.py), so the load it records stays the service's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness.tuning_world import World
from kvpilot.api.vocabulary import TrialStrategy
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner
from kvpilot.tuner.core.objective import SLO, Goal, Measurement
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import KIND_REMEASURE, TunerStudy
from kvpilot.tuner.core.tracks import service_load

START = EngineParams(2048, 0.90, 256)
BETTER = EngineParams(512, 0.90, 256)  # about 14% better than START on the fake world
WORSE = EngineParams(8192, 0.90, 256)
CANARY = LiveSettings(warmup_s=60, window_s=300, poll_s=15, pause_poll_s=10, max_trials=6,
                      strategy=TrialStrategy.CANARY)


def test_each_track_reads_the_services_load_and_keeps_its_own_rate_and_share() -> None:
    stable, canary = service_load(Measurement(0.2, 0.02, request_rate=9.0, extra={"k": 1.0}),
                                  Measurement(0.3, 0.03, request_rate=1.0))
    assert stable.request_rate == canary.request_rate == 10.0
    assert stable.extra == {"k": 1.0, "trackRequestRate": 9.0, "trackShare": pytest.approx(0.9)}
    assert canary.extra == {"trackRequestRate": 1.0, "trackShare": pytest.approx(0.1)}
    assert (stable.ttft_p99, canary.itl_p99) == (0.2, 0.03)  # the latencies are the tracks' own
    idle = Measurement(0.2, 0.02, request_rate=0.0)
    assert service_load(idle, idle) == (idle, idle)


def _tuner(world: World) -> LiveTuner:
    study = TunerStudy(storage=None, name="t", goal=Goal.LATENCY, space=SearchSpace(), slo=SLO(), seed=0,
                       n_trials=CANARY.max_trials)
    study.enqueue(START, "current")
    return LiveTuner(study, world, world, CANARY, clock=world.clock)


def _planted(tuner: LiveTuner, params: EngineParams) -> tuple[int, EngineParams]:
    tuner.study.enqueue(params, "planted")
    n, p = tuner.study.ask()
    assert p == params
    return n, p


@pytest.mark.parametrize("stable_replicas", [3, 19])
def test_a_promoted_canary_records_the_services_load_whatever_the_fleets_size(stable_replicas: int) -> None:
    # One canary pod beside 3 or 19 stable ones: it takes 1/4 or 1/20 of 10 req/s.  The incumbent it
    # becomes carries the 10 req/s the service was offered, not its own 2.5 or 0.5.
    world = World(engine=START, load=lambda t: 10.0, canary_weight=1 / (stable_replicas + 1))
    tuner = _tuner(world)
    n0, p0 = tuner.study.ask()
    tuner.run_trial(n0, p0)  # the stable engine, measured in place
    n1, p1 = _planted(tuner, BETTER)
    assert tuner.run_trial(n1, p1) == "complete"
    inc = tuner.study.incumbent
    assert inc is not None and inc.params == BETTER
    assert inc.request_rate == pytest.approx(10.0)


def test_an_incumbent_a_canary_made_is_no_load_drift_when_trials_turn_rolling() -> None:
    # BETTER wins as a canary taking 1/4 of 10 req/s.  The fleet then shrinks to one replica, where
    # trials roll (trialStrategy's default below 2 replicas): a rolling trial at the same 10 req/s
    # finds the incumbent measured at the same load, so it neither re-measures it (a rollout of the
    # incumbent and a window more) nor reads the load as having quadrupled.
    world = World(engine=START, load=lambda t: 10.0, canary_weight=1 / 4)
    tuner = _tuner(world)
    n0, p0 = tuner.study.ask()
    tuner.run_trial(n0, p0)
    n1, p1 = _planted(tuner, BETTER)
    tuner.run_trial(n1, p1)
    assert world.engine == BETTER
    rolling = LiveTuner(tuner.study, world, world, replace(CANARY, strategy=TrialStrategy.ROLLING),
                        clock=world.clock)
    world.applies.clear()
    n2, p2 = _planted(rolling, WORSE)
    assert rolling.run_trial(n2, p2) == "complete"
    assert KIND_REMEASURE not in [t.user_attrs.get("kind") for t in tuner.study.study.trials]
    assert [p for _, p, _ in world.applies] == [WORSE]  # no rollout of the incumbent to measure it again
