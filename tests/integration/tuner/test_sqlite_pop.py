"""A queued config on a SQLite study is handed to one worker only, however many ask at once.

Optuna pops a WAITING trial by reading it and then writing RUNNING; on PostgreSQL the read locks the
row (FOR UPDATE), on SQLite nothing does, and Python's sqlite3 begins no transaction before a read:
two forked workers of `kvpilot tune --workers 2` both read vLLM's defaults as WAITING and both ran
it as trial 0 (one trial of the budget lost, an UpdateFinishedTrialError at the second tell). The
storage kvpilot opens on SQLite takes the file's write lock at the start of every transaction.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from kvpilot.tuner.storage import sqlite_storage

WORKERS = 6
ROUNDS = 5


def _ask(url: str, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="pop", storage=sqlite_storage(url))
    barrier.wait(30)
    trial = study.ask()
    results.put(trial.number)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_one_queued_trial_goes_to_one_of_several_workers_asking_at_once(tmp_path: Path, round_: int) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="pop", storage=sqlite_storage(url))
    study.enqueue_trial({"x": 1.0})
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(url, barrier, results)) for _ in range(WORKERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    numbers = sorted(results.get(timeout=5) for _ in range(WORKERS))
    # Each worker got a trial of its own: the queued one (number 0) once, new ones for the rest.
    assert numbers == list(range(WORKERS)), numbers
