"""Offline search: ask, evaluate, tell, with no clock and no transport.

Used by `kvpilot tune --offline`, the warm start (search the twin first), and the quality
benchmark.  `evaluate` is any function from a config to an Outcome (the twin's capacity search,
a cached table, a fake).
"""

from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from kvpilot.tuner.core.objective import Goal, Outcome, penalty
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import TunerStudy

Evaluate = Callable[[EngineParams], Outcome]
OnTrial = Callable[[FrozenTrial, EngineParams, Outcome], None]


def run_offline(study: TunerStudy, evaluate: Evaluate, n_trials: int, on_trial: OnTrial | None = None,
                limit: int | None = None) -> int:
    """Run trials until `n_trials` count towards the budget (a resumed study continues), or this
    call has run `limit` of them (one worker's share when several run the study).

    Returns how many trials this call ran.
    """
    ran = 0
    while study.finished_count() < n_trials and (limit is None or ran < limit):
        number, params = study.ask()
        with study.heartbeat(number):
            outcome = evaluate(params)
        frozen = study.tell(number, outcome)
        ran += 1
        if on_trial is not None:
            on_trial(frozen, params, outcome)
    return ran


def run_joined(study: TunerStudy, evaluate: Evaluate, n_trials: int, wait: Callable[[], None],
               on_trial: OnTrial | None = None) -> int:
    """One of several independent workers on a study (`TunerStudy(joined=True)`): run trials until
    the study's budget is spent, whoever measures them.

    Before each ask it fails the trials whose worker stopped heart-beating (their configs queued
    again); it asks only while finished + running trials are fewer than `n_trials`, and gives a
    trial back when a sibling's asked at the same moment took the last place.  When every place
    is taken by a sibling's running trial it calls `wait` and looks again: it returns only once
    `n_trials` are finished, so a sibling that dies with the last trial is replaced, not missed.

    Returns how many trials this worker measured.
    """
    ran = 0
    while True:
        study.fail_stale()
        if study.finished_count() >= n_trials:
            return ran
        if study.budget_left(n_trials) <= 0:
            wait()
            continue
        number, params = study.ask()
        if study.over_budget(number, n_trials):
            study.give_back(number)
            continue
        with study.heartbeat(number):
            outcome = evaluate(params)
        try:
            frozen = study.tell(number, outcome)
        except optuna.exceptions.UpdateFinishedTrialError:
            # Failed as stale while it was measured (this worker's heartbeats did not reach the
            # database for a grace period): its config is queued again; this measurement is dropped.
            continue
        ran += 1
        if on_trial is not None:
            on_trial(frozen, params, outcome)


def top_configs(study: TunerStudy, k: int, *, fill: bool = False) -> list[tuple[EngineParams, float]]:
    """The k best distinct feasible configs (for warm-starting a live study).  With `fill`, fewer
    than k feasible ones are followed by the best infeasible ones that ran (a latency value below
    the penalty of a config that could not): under a load that no config serves within the SLO,
    the nearest misses are still the configs to try first."""
    seen: set[EngineParams] = set()
    sign = 1.0 if study.goal.direction == "minimize" else -1.0
    done = [t for t in study.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    feasible = {t.number for t in study.feasible()}
    ranked = sorted((t for t in done if t.number in feasible), key=lambda t: sign * (t.value or 0.0))
    if fill:
        ranked += sorted((t for t in done if t.number not in feasible and _ran(study.goal, t.value)),
                         key=lambda t: sign * (t.value or 0.0))
    out: list[tuple[EngineParams, float]] = []
    for t in ranked:
        p = study.engine_of(t)
        if p in seen:
            continue
        seen.add(p)
        out.append((p, float(t.value or 0.0)))
        if len(out) == k:
            break
    return out


def _ran(goal: Goal, value: float | None) -> bool:
    """A value a running engine scored, not the penalty told for one that could not run."""
    if value is None:
        return False
    return value < penalty(goal) if goal.direction == "minimize" else value > penalty(goal)
