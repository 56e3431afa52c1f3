"""spec.tuning.budgetGate: the policy (budget left, maintenance windows in a named time zone, daylight
saving), its validation, and the live loop holding trials back with the best engine in force."""

from __future__ import annotations

import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from pydantic import ValidationError

from harness.tuning_world import World
from kvpilot.api import InferenceService
from kvpilot.api.models import BudgetGate, TuningSpec
from kvpilot.api.validation import validate_object
from kvpilot.tuner.core.gate import (
    BUDGET_LOW,
    BUDGET_UNKNOWN,
    OUTSIDE_WINDOW,
    Closed,
    GatePolicy,
    PolicyGate,
    Window,
)
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner, Observer
from kvpilot.tuner.core.objective import SLO, Goal, Outcome
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import TunerStudy

UTC = dt.UTC
BERLIN = ZoneInfo("Europe/Berlin")


def at(text: str, zone: dt.tzinfo = UTC) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=zone)


# ---- the policy ------------------------------------------------------------------------------------

def test_the_budget_left_opens_and_closes_the_gate_at_min_remaining() -> None:
    policy = GatePolicy(min_remaining=0.5)
    now = at("2026-12-02T03:00")
    assert policy.check(now, 0.9) is None
    assert policy.check(now, 0.5) is None  # "at least"
    closed = policy.check(now, 0.49)
    assert closed is not None and closed.reason == BUDGET_LOW
    assert "49.0% of the error budget is left" in closed.message and "at least 50%" in closed.message
    overspent = policy.check(now, -0.3)
    assert overspent is not None and "0.0%" in overspent.message  # never a negative share in words


def test_an_unreadable_budget_holds_trials_back_unless_no_budget_is_asked_for() -> None:
    closed = GatePolicy(min_remaining=0.2).check(at("2026-12-02T03:00"), None)
    assert closed is not None and closed.reason == BUDGET_UNKNOWN
    assert "kvpilot:slo_*_error_budget_remaining:ratio" in closed.message
    assert GatePolicy(min_remaining=0.0).check(at("2026-12-02T03:00"), None) is None


def test_windows_are_read_in_their_time_zone_across_daylight_saving() -> None:
    # Mon-Fri 01:00-05:00 in Berlin: 00:00-04:00 UTC in winter (CET), 23:00-03:00 UTC in summer (CEST).
    policy = GatePolicy(windows=(Window.parse(["Mon", "Tue", "Wed", "Thu", "Fri"], "01:00", "05:00"),),
                        zone=BERLIN, min_remaining=0.0)
    assert policy.check(at("2026-12-02T00:30"), None) is None  # Wed 01:30 CET
    winter = policy.check(at("2026-12-02T04:30"), None)  # Wed 05:30 CET
    assert winter is not None and winter.reason == OUTSIDE_WINDOW
    assert "Wed 05:30" in winter.message and "Europe/Berlin" in winter.message
    assert policy.check(at("2026-07-01T02:30"), None) is None  # Wed 04:30 CEST
    summer = policy.check(at("2026-07-01T03:30"), None)  # Wed 05:30 CEST
    assert summer is not None and summer.reason == OUTSIDE_WINDOW
    weekend = policy.check(at("2026-12-05T00:30"), None)  # Sat 01:30
    assert weekend is not None and weekend.reason == OUTSIDE_WINDOW


def test_a_window_past_midnight_belongs_to_the_day_it_opens() -> None:
    fri_night = Window.parse(["Fri"], "22:00", "02:00")
    assert fri_night.contains(at("2026-12-04T23:00"))  # Fri 23:00
    assert fri_night.contains(at("2026-12-05T01:59"))  # Sat 01:59: still Friday's window
    assert not fri_night.contains(at("2026-12-05T02:00"))
    assert not fri_night.contains(at("2026-12-05T23:00"))  # Sat night: not a Friday
    assert not fri_night.contains(at("2026-12-04T01:00"))  # Fri early morning: Thursday's window
    whole_day = Window.parse(["Sun"], "00:00", "24:00")
    assert whole_day.contains(at("2026-12-06T23:59")) and not whole_day.contains(at("2026-12-07T00:00"))


def test_outside_the_windows_the_budget_is_not_read() -> None:
    reads: list[int] = []

    def budget() -> float:
        reads.append(1)
        return 0.9

    gate = PolicyGate(GatePolicy(windows=(Window.parse(["Mon"], "01:00", "02:00"),)), budget,
                      now=lambda: at("2026-12-02T03:00"))
    closed = gate.closed()
    assert closed is not None and closed.reason == OUTSIDE_WINDOW and reads == []
    gate.now = lambda: at("2026-11-30T01:30")  # Monday, inside
    assert gate.closed() is None and reads == [1]


def test_the_policy_comes_from_the_spec() -> None:
    gate = BudgetGate.model_validate({"minRemaining": 0.25, "timeZone": "America/New_York",
                                      "windows": [{"days": ["Sat", "Sun"], "start": "02:00", "end": "06:00"}]})
    policy = GatePolicy.from_spec(gate)
    assert policy.min_remaining == 0.25 and policy.zone == ZoneInfo("America/New_York")
    assert policy.windows == (Window(frozenset({5, 6}), 120, 360),)
    default = GatePolicy.from_spec(BudgetGate.model_validate({}))
    assert default.min_remaining == 0.5 and default.windows == () and default.zone == ZoneInfo("UTC")


# ---- validation --------------------------------------------------------------------------------------

def _doc(gate: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "prod"},
            "spec": {"model": "m", "replicas": 2, "tuning": {"enabled": True, "budgetGate": gate}}}


@pytest.mark.parametrize(("gate", "path", "needle"), [
    ({"timeZone": "Mars/Olympus_Mons"}, "spec.tuning.budgetGate.timeZone", "IANA time zone"),
    ({"timeZone": "../../etc/passwd"}, "spec.tuning.budgetGate.timeZone", "IANA time zone"),
    ({"minRemaining": 1.5}, "spec.tuning.budgetGate.minRemaining", "less than or equal to 1"),
    ({"windows": [{"start": "25:00", "end": "02:00"}]}, "spec.tuning.budgetGate.windows[0].start", "pattern"),
    ({"windows": [{"start": "01:00", "end": "01:00"}]}, "spec.tuning.budgetGate.windows", "empty window"),
    ({"windows": [{"days": ["Monday"], "start": "01:00", "end": "02:00"}]},
     "spec.tuning.budgetGate.windows[0].days[0]", "'Mon'"),
    ({"windows": [{"start": "01:00"}]}, "spec.tuning.budgetGate.windows[0].end", "required"),
    ({"minRemainig": 0.5}, "spec.tuning.budgetGate.minRemainig", "allowed here: minRemaining"),
])
def test_a_bad_gate_is_refused_naming_the_field(gate: dict[str, Any], path: str, needle: str) -> None:
    issues = {i.path: i.message for i in validate_object(_doc(gate))}
    assert path in issues, issues
    assert needle in issues[path], issues[path]


def test_a_good_gate_validates_and_keeps_its_wire_form() -> None:
    gate = {"minRemaining": 0.5, "timeZone": "Europe/Berlin",
            "windows": [{"days": ["Mon", "Tue"], "start": "22:00", "end": "02:00"}]}
    assert validate_object(_doc(gate)) == []
    isvc = InferenceService.model_validate(_doc(gate))
    assert isvc.to_wire()["spec"]["tuning"]["budgetGate"] == gate
    with pytest.raises(ValidationError, match="budgetGate.timeZone"):
        TuningSpec.model_validate({"budgetGate": {"timeZone": "Nowhere/Else"}})


# ---- the loop -------------------------------------------------------------------------------------------

START = EngineParams(2048, 0.90, 256)
SETTINGS = LiveSettings(warmup_s=60, window_s=300, poll_s=15, pause_poll_s=60, max_trials=4)


class GateRecorder(Observer):
    def __init__(self) -> None:
        self.paused: list[str] = []
        self.gate: list[str | None] = []
        self.finished: list[tuple[int, str]] = []

    def phase(self, phase: str, reason: str, message: str) -> None:
        if phase == "Paused":
            self.paused.append(reason)

    def gate_changed(self, closed: Closed | None) -> None:
        self.gate.append(closed.reason if closed else None)

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None:
        self.finished.append((number, state))


class ScriptedBudget:
    """The budget left as a function of the world's virtual time; counts its reads."""

    def __init__(self, world: World, curve: Any) -> None:
        self.world, self.curve, self.reads = world, curve, 0

    def __call__(self) -> float | None:
        self.reads += 1
        return self.curve(self.world.clock.t)


def _tuner(world: World, gate: PolicyGate) -> tuple[LiveTuner, GateRecorder]:
    study = TunerStudy(storage=None, name="t", goal=Goal.LATENCY, space=SearchSpace(), slo=SLO(), seed=0,
                       n_trials=SETTINGS.max_trials)
    study.enqueue(START, "current")
    rec = GateRecorder()
    return LiveTuner(study, world, world, SETTINGS, clock=world.clock, observer=rec, gate=gate), rec


def test_a_low_budget_holds_trials_back_with_the_best_engine_in_force_until_it_recovers() -> None:
    world = World(engine=START)
    # Plenty of budget for the first two trials, then low for an hour, then back.
    budget = ScriptedBudget(world, lambda t: 0.9 if t < 800 or t > 4400 else 0.3)
    gate = PolicyGate(GatePolicy(min_remaining=0.5), budget, now=lambda: at("2026-12-02T03:00"))
    tuner, rec = _tuner(world, gate)
    starts: list[float] = []
    world_apply = world.apply

    def apply(params: EngineParams, trial: int | None) -> None:
        if trial is not None:
            starts.append(world.clock.t)
        world_apply(params, trial)

    world.apply = apply  # type: ignore[method-assign]
    tuner.run()
    assert [s for _, s in rec.finished] == ["complete"] * SETTINGS.max_trials
    # No trial started while the budget was low, and the loop waited rather than stopped.
    assert not any(800 < t <= 4400 for t in starts), starts
    assert rec.paused and set(rec.paused) == {BUDGET_LOW}
    assert rec.gate == [BUDGET_LOW, None]  # one change each way, not one per poll
    # It waited until the budget came back (past t=4400), however late in a trial the budget fell.
    assert tuner.gate_pauses == len(rec.paused)
    assert any(t > 4400 for t in starts) and min(t for t in starts if t > 800) > 4400
    # During the pause the engine in force was the best known (or the starting one), never a trial's.
    pause_applies = [(t, p, trial) for t, p, trial in world.applies if 800 < t <= 4400]
    assert all(trial is None for _, _, trial in pause_applies)
    best_then = tuner.study.incumbent
    assert best_then is not None


def test_the_gate_is_asked_before_each_trial_never_during_one() -> None:
    world = World(engine=START)
    budget = ScriptedBudget(world, lambda t: 0.9)
    gate = PolicyGate(GatePolicy(min_remaining=0.5), budget, now=lambda: at("2026-12-02T03:00"))
    tuner, rec = _tuner(world, gate)
    tuner.run()
    assert budget.reads == SETTINGS.max_trials and rec.paused == [] and rec.gate == []


def test_a_stop_while_paused_leaves_the_best_engine_and_the_study_resumable() -> None:
    world = World(engine=START)
    gate = PolicyGate(GatePolicy(min_remaining=0.5), lambda: 0.1, now=lambda: at("2026-12-02T03:00"))
    tuner, rec = _tuner(world, gate)

    def stop_after_three_polls(t: float) -> None:
        if tuner.gate_pauses >= 3:
            tuner.stop_requested = True

    world.clock.listeners.append(stop_after_three_polls)
    assert tuner.run() == START
    assert tuner.study.finished_count() == 0 and rec.finished == []
    assert world.applies == []  # nothing was changed: the starting engine was already in force


def test_a_gate_swapped_while_paused_applies_at_the_next_check() -> None:
    world = World(engine=START)
    now = [at("2026-12-02T03:00")]  # Wednesday
    gate = PolicyGate(GatePolicy(min_remaining=0.0, windows=(Window.parse(["Sat"], "01:00", "05:00"),)),
                      lambda: 1.0, now=lambda: now[0])
    tuner, rec = _tuner(world, gate)

    def widen(t: float) -> None:
        if tuner.gate_pauses == 2:
            gate.policy = GatePolicy(min_remaining=0.0)  # the user removed the windows

    world.clock.listeners.append(widen)
    tuner.run()
    assert rec.gate == [OUTSIDE_WINDOW, None]
    assert tuner.study.finished_count() == SETTINGS.max_trials
