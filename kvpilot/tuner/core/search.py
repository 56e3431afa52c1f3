"""Offline search: ask, evaluate, tell, with no clock and no transport.

Used by `kvpilot tune --offline`, the warm start (search the twin first), and the quality
benchmark.  `evaluate` is any function from a config to an Outcome (the twin's capacity search,
a cached table, a fake).
"""

from __future__ import annotations

from collections.abc import Callable

from optuna.trial import FrozenTrial

from kvpilot.tuner.core.objective import Outcome
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
        outcome = evaluate(params)
        frozen = study.tell(number, outcome)
        ran += 1
        if on_trial is not None:
            on_trial(frozen, params, outcome)
    return ran


def top_configs(study: TunerStudy, k: int) -> list[tuple[EngineParams, float]]:
    """The k best distinct feasible configs (for warm-starting a live study)."""
    seen: set[EngineParams] = set()
    ranked = sorted(
        (t for t in study.feasible() if t.value is not None),
        key=lambda t: (t.value or 0.0) if study.goal.direction == "minimize" else -(t.value or 0.0),
    )
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
