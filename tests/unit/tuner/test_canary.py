"""Canary trials in the live loop, on the two-track fake world with a virtual clock (harness/tuning_world.py)."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.trial import TrialState

from harness.tuning_world import World
from kvpilot.api.vocabulary import TrialStrategy
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner, Observer, TrialEvent
from kvpilot.tuner.core.objective import SLO, Goal, Outcome
from kvpilot.tuner.core.sequential import PairedSPRT, SequentialSettings, Verdict
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import KIND_REMEASURE, TunerStudy

START = EngineParams(2048, 0.90, 256)  # score 0.55 on the fake world (ITL-bound)
BETTER = EngineParams(512, 0.90, 256)  # score 0.475: about 14% better
WORSE = EngineParams(8192, 0.90, 256)  # score 0.85: much worse, but not burning fast
BAD = EngineParams(16384, 0.80, 1024)  # burns the budget at 60x
SETTINGS = LiveSettings(warmup_s=60, window_s=300, poll_s=15, pause_poll_s=10, max_trials=6,
                        strategy=TrialStrategy.CANARY)


class Events(Observer):
    def __init__(self) -> None:
        self.events: list[tuple[int, str, str]] = []

    def trial_event(self, number: int, strategy: TrialStrategy, event: TrialEvent) -> None:
        self.events.append((number, strategy.value, event.value))


def _study(storage: optuna.storages.BaseStorage | None = None) -> TunerStudy:
    return TunerStudy(storage=storage, name="t", goal=Goal.LATENCY, space=SearchSpace(), slo=SLO(), seed=0,
                      n_trials=SETTINGS.max_trials)


def _tuner(world: World, settings: LiveSettings = SETTINGS, study: TunerStudy | None = None
           ) -> tuple[LiveTuner, Events]:
    study = study or _study()
    study.enqueue(START, "current")
    ev = Events()
    return LiveTuner(study, world, world, settings, clock=world.clock, observer=ev), ev


def _first_trial_in_place(tuner: LiveTuner) -> None:
    n, p = tuner.study.ask()
    assert p == START
    assert tuner.run_trial(n, p) == "complete"  # the stable engine is measured in place: no canary
    assert world_of(tuner).canary_starts == []
    world_of(tuner).applies.clear()  # (a no-op apply of the engine in force)


def world_of(tuner: LiveTuner) -> World:
    assert isinstance(tuner.applier, World)
    return tuner.applier


def _next(tuner: LiveTuner, params: EngineParams) -> tuple[int, EngineParams]:
    tuner.study.enqueue(params, "planted")
    n, p = tuner.study.ask()
    assert p == params
    return n, p


def test_a_burning_canary_is_pruned_within_one_poll_and_only_its_share_saw_it() -> None:
    world = World(engine=START, burning=lambda p: p == BAD, canary_weight=0.25)
    tuner, ev = _tuner(world)
    _first_trial_in_place(tuner)
    assert world.canary_starts == []
    n, p = _next(tuner, BAD)
    before = dict(world.served)
    assert tuner.run_trial(n, p) == "pruned"
    (t_start, started, trial), = world.canary_starts
    serving_at = t_start + world.canary_startup_s
    assert started == BAD and trial == n
    assert world.canary is None and world.canary_stops[-1] - serving_at <= SETTINGS.poll_s
    assert world.applies == [] and world.engine == START  # the stable track was never touched
    # Only the canary's share of the requests in its short life saw the bad engine.
    alive = world.canary_stops[-1] - serving_at
    assert world.served[BAD] == pytest.approx(0.25 * 5.0 * alive)
    during = sum(world.served.values()) - sum(before.values()) - 5.0 * world.canary_startup_s
    assert world.served[BAD] / during == pytest.approx(0.25)
    t = tuner.study.study.trials[n]
    assert t.state is TrialState.PRUNED and t.user_attrs["reason"] == "FastBurn"
    assert (n, "canary", "pruned") in ev.events and (n, "canary", "rolled_back") in ev.events


def test_a_better_canary_is_promoted_early_by_the_sequential_test() -> None:
    world = World(engine=START, noise=0.02)
    tuner, ev = _tuner(world)
    _first_trial_in_place(tuner)
    n, p = _next(tuner, BETTER)
    t0 = world.clock.t
    assert tuner.run_trial(n, p) == "complete"
    assert tuner.verdicts[-1] == (n, Verdict.BETTER)
    # Decided before the window's end: warm-up plus a few polls, not the whole 300 s.
    assert world.clock.t - t0 < world.canary_startup_s + SETTINGS.warmup_s + SETTINGS.window_s + 30
    assert [(params, trial) for _, params, trial in world.applies] == [(BETTER, n)]  # the promotion
    assert world.engine == BETTER and world.canary is None
    inc = tuner.study.incumbent
    assert inc is not None and inc.params == BETTER and inc.trial == n
    assert (n, "canary", "promoted") in ev.events
    # The promotion rolled out while the canary still served; the canary was stopped after it.
    assert world.canary_stops[-1] >= world.applies[-1][0]


def test_a_worse_canary_is_told_as_measured_and_the_stable_track_stays() -> None:
    world = World(engine=START, noise=0.02)
    tuner, ev = _tuner(world)
    _first_trial_in_place(tuner)
    n, p = _next(tuner, WORSE)
    assert tuner.run_trial(n, p) == "complete"
    assert tuner.verdicts[-1] == (n, Verdict.WORSE)
    assert world.applies == [] and world.engine == START and world.canary is None
    t = tuner.study.study.trials[n]
    assert t.state is TrialState.COMPLETE and t.value == pytest.approx(0.85, rel=0.1)
    inc = tuner.study.incumbent
    assert inc is not None and inc.params == START
    assert not any(e == (n, "canary", "promoted") for e in ev.events)


def test_canary_trials_compare_paired_and_never_remeasure_for_drift() -> None:
    # The load doubles after the first trial: the stable track, measured beside the canary, is the
    # incumbent's fresh value; no re-measurement trial, no rollout of the incumbent.
    world = World(engine=START, load=lambda t: 4.0 if t < 500 else 8.0)
    tuner, _ = _tuner(world)
    _first_trial_in_place(tuner)
    n, p = _next(tuner, WORSE)
    tuner.run_trial(n, p)
    kinds = [t.user_attrs.get("kind") for t in tuner.study.study.trials]
    assert KIND_REMEASURE not in kinds
    inc = tuner.study.incumbent
    assert inc is not None and inc.params == START and inc.request_rate == 8.0
    assert world.applies == []


def test_a_canary_that_cannot_start_is_infeasible_and_leaves_nothing() -> None:
    world = World(engine=START)
    tuner, ev = _tuner(world)
    _first_trial_in_place(tuner)
    n, p = _next(tuner, EngineParams(4096, 0.95, 256))  # util 0.95 "OOMs"
    assert tuner.run_trial(n, p) == "infeasible"
    t = tuner.study.study.trials[n]
    assert t.state is TrialState.COMPLETE and t.user_attrs["reason"] == "OutOfMemory"
    assert world.canary is None and world.canary_stops and world.applies == []


def test_a_stop_mid_canary_leaves_no_canary_and_the_resumed_study_fails_the_cut_off_trial() -> None:
    storage = optuna.storages.InMemoryStorage()
    world = World(engine=START)
    tuner, _ = _tuner(world, study=_study(storage))
    _first_trial_in_place(tuner)
    tuner.study.enqueue(WORSE, "planted")  # what run() asks next: the trial the stop cuts off
    world.clock.listeners.append(lambda t: setattr(tuner, "stop_requested", world.canary is not None))
    tuner.run()
    assert world.canary_starts and world.canary is None
    assert world.canary_stops[-1] >= world.canary_starts[-1][0]
    cut = [t.number for t in tuner.study.study.trials if t.state is TrialState.RUNNING]
    assert len(cut) == 1
    resumed = _study(storage)
    assert resumed.resumed == cut
    assert resumed.study.trials[cut[0]].state is TrialState.FAIL


def test_the_loop_removes_a_canary_left_by_a_tuner_that_died() -> None:
    world = World(engine=START, canary=WORSE)
    tuner, _ = _tuner(world, settings=LiveSettings(**{**SETTINGS.__dict__, "max_trials": 1}))
    tuner.run()
    assert world.canary_stops[0] == 0.0 and world.canary is None


def test_metrics_events_by_strategy_for_a_whole_study() -> None:
    world = World(engine=START, burning=lambda p: p == BAD)
    tuner, ev = _tuner(world)
    tuner.study.enqueue(BAD, "planted")
    tuner.study.enqueue(BETTER, "planted")
    tuner.run()
    kinds = {e for _, s, e in ev.events if s == "canary"}
    assert {"started", "pruned", "rolled_back", "promoted"} <= kinds
    assert world.canary is None
    assert world.engine == tuner.fallback()


def test_canary_needs_an_applier_and_signals_that_can_run_it() -> None:
    class Plain:
        def current(self) -> EngineParams:
            return START

        def apply(self, params: EngineParams, trial: int | None) -> None: ...

    world = World(engine=START)
    with pytest.raises(ValueError, match="canary"):
        LiveTuner(_study(), Plain(), world, SETTINGS, clock=world.clock)


def test_the_rolling_strategy_is_unchanged_and_emits_its_events() -> None:
    world = World(engine=START, burning=lambda p: p == BAD)
    tuner, ev = _tuner(world, settings=LiveSettings(**{**SETTINGS.__dict__, "strategy": TrialStrategy.ROLLING}))
    tuner.study.enqueue(BAD, "planted")
    tuner.run()
    assert world.canary_starts == [] and world.canary_stops == []
    assert {e for _, s, e in ev.events if s == "rolling"} >= {"started", "pruned", "rolled_back", "promoted"}


# -- the sequential test alone ---------------------------------------------------------------------
def test_sprt_decides_worse_better_or_stays_undecided_when_equal() -> None:
    import random

    rng = random.Random(1)

    def run(ratio: float, n: int = 40) -> tuple[Verdict, int]:
        t = PairedSPRT(SequentialSettings())
        for i in range(n):
            v = t.add(ratio * math.exp(rng.gauss(0, 0.05)), 1.0)
            if v is not Verdict.UNDECIDED:
                return v, i + 1
        return t.verdict, n

    assert run(1.3)[0] is Verdict.WORSE
    assert run(0.75)[0] is Verdict.BETTER
    false_calls = sum(run(1.0, 20)[0] is not Verdict.UNDECIDED for _ in range(200))
    assert false_calls <= 0.15 * 200  # about 2 alpha at most, over two one-sided tests


def test_sequential_settings_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="alpha"):
        SequentialSettings(alpha=0.7)
    with pytest.raises(ValueError, match="min_samples"):
        SequentialSettings(min_samples=1)


def test_an_outcome_hook_without_events_is_fine() -> None:
    Observer().trial_event(0, TrialStrategy.CANARY, TrialEvent.STARTED)
    assert Outcome(1.0, (0.0,), True, "WithinSLO").feasible


def test_an_equal_canary_is_not_promoted_on_a_lucky_window() -> None:
    # Same latency as the stable engine (only max_num_seqs differs, which the fake world ignores):
    # the test rules "better" out long before the window ends, so the window's coin flip never rolls
    # the fleet.  Without the guard about half of these would be promoted.
    twin = EngineParams(2048, 0.90, 128)
    promoted = {True: 0, False: 0}
    for guard in (True, False):
        for seed in range(6):
            world = World(engine=START, noise=0.03, seed=seed)
            settings = LiveSettings(**{**SETTINGS.__dict__, "canary_guard": guard})
            tuner, _ = _tuner(world, settings=settings)
            _first_trial_in_place(tuner)
            n, p = _next(tuner, twin)
            tuner.run_trial(n, p)
            promoted[guard] += world.engine == twin
    assert promoted[True] == 0
    assert promoted[False] >= 1


def test_the_starting_engine_measured_first_is_no_promotion() -> None:
    for strategy in TrialStrategy:
        world = World(engine=START)
        tuner, ev = _tuner(world, settings=LiveSettings(**{**SETTINGS.__dict__, "strategy": strategy}))
        n, p = tuner.study.ask()
        tuner.run_trial(n, p)
        assert tuner.study.incumbent is not None and tuner.study.incumbent.params == START
        assert [e for _, _, e in ev.events] == ["started"], strategy


def test_a_canary_track_without_signals_pauses_the_window_and_says_why() -> None:
    world = World(engine=START)
    tuner, _ = _tuner(world)
    _first_trial_in_place(tuner)
    phases: list[tuple[str, str]] = []
    tuner.obs.phase = lambda phase, reason, message: phases.append((phase, reason))  # type: ignore[method-assign]
    real = world.measure_tracks
    dark_until = world.clock.t + 200

    def measure_tracks(window_s: float):  # type: ignore[no-untyped-def]
        if world.clock.t < dark_until:
            from kvpilot.tuner.core.loop import SignalsUnavailable

            raise SignalsUnavailable("NoTraffic", "no requests on the canary track")
        return real(window_s)

    world.measure_tracks = measure_tracks  # type: ignore[method-assign]
    n, p = _next(tuner, WORSE)
    assert tuner.run_trial(n, p) == "complete"
    assert ("Paused", "NoTraffic") in phases
    assert world.clock.t >= dark_until and world.canary is None
