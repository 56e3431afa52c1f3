"""Trials and scaling do not confound each other: a window in which the replica count moved is left out
and measured again (kvpilot/tuner/core/fleetsize.py), in rolling and in canary trials."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from harness.tuning_world import World
from kvpilot.api.vocabulary import TrialStrategy
from kvpilot.tuner.core.fleetsize import Replicas, moved
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner, Observer
from kvpilot.tuner.core.objective import SLO, Goal, Measurement
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import TunerStudy

START = EngineParams(2048, 0.90, 256)
BETTER = EngineParams(512, 0.90, 256)  # about 14% better than START on the fake world
ROLLING = LiveSettings(warmup_s=60, window_s=300, poll_s=15, pause_poll_s=10, max_trials=4, confirm_windows=0)
CANARY = replace(ROLLING, strategy=TrialStrategy.CANARY)
SPIKE_TTFT = 2.0  # what a window read across a scale event shows: a new replica's cold caches, a queue moving


@dataclass
class ScalingWorld(World):
    """A fleet that scales from 2 to 3 replicas at `scale_at`; a window read across that moment reads
    SPIKE_TTFT (on the canary track too: its share of the load moved), any other window the engine's
    own p99s."""

    scale_at: float = 200.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.replicas_at = lambda t: (2, 2) if t < self.scale_at else (3, 3)
        self.reads: list[tuple[float, float]] = []  # (when, window) of each measure

    def _across(self, window_s: float) -> bool:
        assert self.replicas_at is not None
        t = self.clock.t
        return self.replicas_at(t - window_s) != self.replicas_at(t)

    def measure(self, window_s: float) -> Measurement:
        m = super().measure(window_s)
        self.reads.append((self.clock.t, window_s))
        return replace(m, ttft_p99=SPIKE_TTFT) if self._across(window_s) else m

    def measure_tracks(self, window_s: float) -> tuple[Measurement, Measurement]:
        stable, canary = super().measure_tracks(window_s)
        return (stable, replace(canary, ttft_p99=SPIKE_TTFT)) if self._across(window_s) else (stable, canary)


class Phases(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def phase(self, phase: str, reason: str, message: str) -> None:
        self.seen.append((phase, reason, message))


def _tuner(world: World, settings: LiveSettings, fleet: bool = True) -> tuple[LiveTuner, Phases]:
    study = TunerStudy(storage=None, name="t", goal=Goal.LATENCY, space=SearchSpace(), slo=SLO(), seed=0,
                       n_trials=settings.max_trials)
    study.enqueue(START, "current")
    obs = Phases()
    return LiveTuner(study, world, world, settings, clock=world.clock, observer=obs,
                     fleet=world if fleet else None), obs


def test_moved_names_what_changed_and_ignores_unknown_readings() -> None:
    assert moved(Replicas(2, 2), Replicas(2, 2)) is None
    assert moved(None, Replicas(2, 2)) is None and moved(Replicas(2, 2), None) is None
    assert moved(Replicas(2, 2), Replicas(4, 2)) == "spec.replicas went from 2 to 4"
    assert moved(Replicas(4, 2), Replicas(4, 3)) == "ready replicas went from 2 to 3"


def test_a_rolling_window_with_a_scale_event_is_left_out_and_measured_again() -> None:
    # Apply ends at 30 s, warm-up at 90 s; the window 90-390 s holds the scale at 200 s.  The poll at
    # 210 s sees 3 replicas: the window starts again there and is read at 510 s, all of it at 3 replicas.
    world = ScalingWorld(engine=START)
    tuner, obs = _tuner(world, ROLLING)
    n, p = tuner.study.ask()
    assert tuner.run_trial(n, p) == "complete"
    assert world.reads == [(510.0, 300.0)]
    assert tuner.scale_discards == 1
    told = tuner.study.study.trials[n].value
    assert told is not None and told < SPIKE_TTFT / SLO().ttft_seconds
    assert ("Measuring", "ScaleEvent", "spec.replicas went from 2 to 3 during the window; it is left out "
            "and measured again") in obs.seen


def test_without_a_fleet_reading_the_confounded_window_is_what_gets_told() -> None:
    # The same world, the tuner not told the fleet's size: the window read across the scale is scored.
    world = ScalingWorld(engine=START)
    tuner, _ = _tuner(world, ROLLING, fleet=False)
    n, p = tuner.study.ask()
    tuner.run_trial(n, p)
    assert world.reads == [(390.0, 300.0)]
    assert tuner.study.study.trials[n].value == pytest.approx(SPIKE_TTFT / SLO().ttft_seconds)


def test_a_steady_fleet_costs_no_extra_window() -> None:
    world = ScalingWorld(engine=START, scale_at=1e9)
    tuner, _ = _tuner(world, ROLLING)
    n, p = tuner.study.ask()
    tuner.run_trial(n, p)
    assert world.reads == [(390.0, 300.0)] and tuner.scale_discards == 0


def test_a_canary_window_with_a_scale_event_starts_its_paired_test_again() -> None:
    # The stable engine is measured in place first (to 390 s); the canary of BETTER serves from 410 s
    # (its start-up is 20 s), warms up to 470 s, and the fleet scales at 500 s, its window's second
    # poll.  Read across that, the canary would look 4x worse than the stable track and lose; left
    # out, the paired test starts again and promotes it.
    world = ScalingWorld(engine=START, scale_at=500.0)
    tuner, _ = _tuner(world, CANARY)
    n0, p0 = tuner.study.ask()
    tuner.run_trial(n0, p0)
    tuner.study.enqueue(BETTER, "planted")
    n1, p1 = tuner.study.ask()
    assert p1 == BETTER
    assert tuner.run_trial(n1, p1) == "complete"
    assert tuner.scale_discards == 1
    assert world.engine == BETTER  # promoted on the window after the scale event
    inc = tuner.study.incumbent
    assert inc is not None and inc.params == BETTER


def test_without_a_fleet_reading_the_canary_loses_to_the_scale_event() -> None:
    world = ScalingWorld(engine=START, scale_at=500.0)
    tuner, _ = _tuner(world, CANARY, fleet=False)
    n0, p0 = tuner.study.ask()
    tuner.run_trial(n0, p0)
    tuner.study.enqueue(BETTER, "planted")
    n1, p1 = tuner.study.ask()
    tuner.run_trial(n1, p1)
    assert world.engine == START
