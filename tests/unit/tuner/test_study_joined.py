"""Joined workers on one study (`kvpilot tune --offline --join`), in process on a SQLite file with
Optuna's RDB heartbeat (the PostgreSQL tests run the same with real processes): only a trial whose
worker stopped heart-beating is failed and queued again, a trial with no heartbeat at all only once
older than the grace period, and a trial asked past the budget is given back."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from optuna.trial import TrialState

from kvpilot.tuner.core.objective import SLO, Goal, Measurement, score
from kvpilot.tuner.core.space import SearchSpace
from kvpilot.tuner.core.study import REASON_BUDGET_SPENT, TunerStudy, heartbeat_storage, study_name

GRACE = 2


def _worker(url: str) -> TunerStudy:
    space = SearchSpace()
    return TunerStudy(storage=heartbeat_storage(url, 1, GRACE), name=study_name("ns", "svc", space, Goal.CAPACITY),
                      goal=Goal.CAPACITY, space=space, slo=SLO(), seed=0, n_trials=4, joined=True)


def _good() -> object:
    return score(Goal.CAPACITY, Measurement(ttft_p99=0.1, itl_p99=0.01, request_rate=3, capacity=3), SLO())


def _until(pred, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
    return got


def test_a_live_trial_is_left_alone_and_a_dead_one_is_failed_and_queued_again(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    a, b = _worker(url), _worker(url)
    n_live, _ = a.ask()
    n_dead, p_dead = b.ask()
    started = time.monotonic()
    with a.heartbeat(n_live):  # `a` keeps beating; `b` died after its first beat (in ask)
        stale = _until(lambda: a.fail_stale() or None)
        assert time.monotonic() - started >= GRACE - 1  # not before the grace period (lower bound)
    assert stale == [n_dead]
    trials = a.study.get_trials(deepcopy=False)
    assert trials[n_live].state == TrialState.RUNNING and trials[n_dead].state == TrialState.FAIL
    # The dead trial's config is queued once and is what the next ask measures, as a resumed trial.
    assert len([t for t in trials if t.state == TrialState.WAITING]) == 1
    n_again, p_again = a.ask()
    assert p_again == p_dead and a.study.get_trials(deepcopy=False)[n_again].user_attrs["source"] == "resume"
    a.tell(n_live, _good())  # the live trial is still its worker's to tell
    assert a.study.get_trials(deepcopy=False)[n_live].state == TrialState.COMPLETE


def test_a_trial_that_never_beat_counts_as_dead_only_past_the_grace_period(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    a = _worker(url)
    with warnings.catch_warnings():  # Optuna: heartbeats are meant for optimize (kvpilot beats itself)
        warnings.simplefilter("ignore", UserWarning)
        raw = a.study.ask(a.distributions)  # a worker killed between creating its trial and its first beat
    assert a.fail_stale() == []  # young: it may be a sibling's ask in progress
    assert _until(lambda: a.fail_stale() or None) == [raw.number]
    assert a.study.get_trials(deepcopy=False)[raw.number].state == TrialState.FAIL


def test_a_trial_asked_past_the_budget_is_given_back_and_a_queued_config_kept(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    a, b = _worker(url), _worker(url)
    done = []
    for _ in range(3):
        n, _p = a.ask()
        done.append(n)
    assert a.budget_left(4) == 1
    # Both saw one place left; `b` queued-config trial comes second and gives it back.
    n_a, _ = a.ask()
    a.study.enqueue_trial({"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128},
                          user_attrs={"source": "resume", "kind": "trial"})
    n_b, _ = b.ask()
    assert not a.over_budget(n_a, 4) and b.over_budget(n_b, 4)
    b.give_back(n_b)
    trials = b.study.get_trials(deepcopy=False)
    assert trials[n_b].state == TrialState.FAIL and trials[n_b].user_attrs["reason"] == REASON_BUDGET_SPENT
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    # Not lost: queued again (a waiting trial holds its params as Optuna's fixed_params).
    assert len(waiting) == 1 and waiting[0].system_attrs["fixed_params"] == trials[n_b].params
    assert a.budget_left(4) == 0
