"""`kvpilot tune --offline --workers N` on SQLite: the forked workers and the parent polling the study
take turns on one file's lock.  A holder that keeps it past Python's sqlite3 default wait (5 s: a
process descheduled mid-write on a loaded machine, a slow disk) must make the others wait, not fail
"database is locked" and end the run as an internal error.  The lock is a real one, taken on the
study's file by this test through sqlite3, while the run's workers measure."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.kmock_api import wait_for
from kvpilot.api.vocabulary import ENV_TUNER_STORAGE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
# Longer than Python's sqlite3 default busy timeout (5 s), the wait the run had before.
HELD_S = 7.0


def _running_trials(db: Path) -> int:
    try:
        with sqlite3.connect(db, timeout=30) as conn:
            return int(conn.execute("SELECT count(*) FROM trials WHERE state = 'RUNNING'").fetchone()[0])
    except sqlite3.Error:  # the tables are not made yet
        return 0


def test_forked_workers_on_sqlite_wait_out_a_lock_held_past_the_default_timeout(tmp_path: Path) -> None:
    db = tmp_path / "study.db"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(ENV_TUNER_STORAGE, None)
    proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "tune", "--offline", "--model", "Llama-3.1-8B",
                             "--gpu", "H100-80GB", "--workload", "prompt=256,output=32", "--trials", "6",
                             "--probe-seconds", "10", "--workers", "2", "-q", "--report", "",
                             "--study-name", "locked", "--storage", f"sqlite:///{db}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _running_trials(db) >= 1, timeout=120, what="a worker measuring a trial")
        holder = sqlite3.connect(db, timeout=30, isolation_level=None)
        try:
            holder.execute("BEGIN EXCLUSIVE")  # no other connection reads or writes the file meanwhile
            time.sleep(HELD_S)  # the fault itself: a lock held this long, not a wait for something
            holder.execute("COMMIT")
        finally:
            holder.close()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "database is locked" not in err
    import optuna
    from optuna.trial import TrialState

    study = optuna.load_study(study_name="locked", storage=f"sqlite:///{db}")
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in trials if t.state is TrialState.RUNNING] == []
    assert len([t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]) >= 6  # the budget
