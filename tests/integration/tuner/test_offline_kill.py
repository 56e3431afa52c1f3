"""`kvpilot tune --offline` killed (SIGKILL, a real process) at several points and rerun: the study
it finishes, and so its answer, is the one an uninterrupted run with the same seed gives; vLLM's
defaults are measured whatever the kill cut; `--workers` die with their parent."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

TRIALS = 7
SMALL = ["--workload", "prompt=256,output=32", "--probe-seconds", "20", "--seed", "3"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd(), "KVPILOT_DEBUG": ""}


def _argv(db: Path, *extra: str) -> list[str]:
    return ["tune", "--offline", "-q", "--trials", str(TRIALS), *SMALL, "--storage", f"sqlite:///{db}",
            "--report", "", *extra]


def _run(db: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpilot.cli", *_argv(db, *extra)], capture_output=True,
                          text=True, env=_env(), timeout=600)


def _count(db: Path, sql: str) -> int:
    """A count read from the tuner's SQLite file while it runs (0 while there is no file or no table)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return int(con.execute(sql).fetchone()[0])
    except sqlite3.Error:
        return 0


def _complete(db: Path) -> int:
    return _count(db, "SELECT count(*) FROM trials WHERE state = 'COMPLETE'")


@contextmanager
def _started(argv: list[str], log: Path) -> Iterator[subprocess.Popen[str]]:
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _wait(done: Callable[[], bool], proc: subprocess.Popen[str], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert proc.poll() is None, f"the tuner ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _answer(stdout: str) -> dict[str, object]:
    """The recommended block: the engine and its comment (value, vLLM defaults' value)."""
    block = stdout[stdout.index("# kvpilot tune --offline"):]
    return {"comment": block.splitlines()[0], "engine": yaml.safe_load(block)["spec"]["engine"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    db = tmp_path_factory.mktemp("whole") / "s.db"
    done = _run(db)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "vLLM defaults:" in done.stdout
    return done.stdout


@pytest.mark.parametrize("after", [1, 4])
def test_killed_after_n_trials_a_rerun_gives_the_uninterrupted_study_and_answer(
        after: int, uninterrupted: str, tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    with _started(["-m", "kvpilot.cli", *_argv(db)], tmp_path / "killed.log") as proc:
        _wait(lambda: _complete(db) >= after, proc, f"{after} trials were stored")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    rerun = _run(db)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _answer(rerun.stdout) == _answer(uninterrupted)
    # The whole table, trial numbers included: the rerun finished the cut trial under its own number.
    assert rerun.stdout == uninterrupted
    trials = optuna.load_study(study_name=None, storage=f"sqlite:///{db}").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * TRIALS


# Killed between two of a trial's parameters (a window of microseconds, so the kill is placed by
# the process itself): writing the given parameter (counted over the run) kills it.
_HALF_WRITTEN = textwrap.dedent(
    """
    import os, signal, sys
    import optuna
    calls = []
    real = optuna.storages.RDBStorage._set_trial_param
    def set_trial_param(self, trial_id, name, *rest):
        calls.append(name)
        if len(calls) == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, trial_id, name, *rest)
    optuna.storages.RDBStorage._set_trial_param = set_trial_param
    from kvpilot.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("trial", [0, 2])
def test_killed_with_a_trials_params_half_written_the_whole_config_is_measured(
        trial: int, uninterrupted: str, tmp_path: Path) -> None:
    """Trial 0 is vLLM's defaults (queued); trial 2 a sampler's draw: either is finished with the
    config it was going to measure, never with one parameter kept and the others drawn anew."""
    db = tmp_path / "s.db"
    crasher = _HALF_WRITTEN.format(kill_at=3 * trial + 2)  # three knobs a trial: its second
    with _started(["-c", crasher, *_argv(db)], tmp_path / "killed.log") as proc:
        proc.wait(timeout=300)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    assert _count(db, f"SELECT count(*) FROM trial_params JOIN trials USING (trial_id) WHERE number = {trial}") == 1
    rerun = _run(db)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _answer(rerun.stdout) == _answer(uninterrupted)
    assert "vLLM defaults:" in rerun.stdout
    assert rerun.stdout == uninterrupted


def test_a_failed_defaults_trial_is_queued_again(uninterrupted: str, tmp_path: Path) -> None:
    """A study whose vLLM-defaults trial ended FAIL (a run of an older kvpilot, killed) measures the
    defaults again rather than taking the failed trial for "already tried"."""
    db = tmp_path / "s.db"
    with _started(["-m", "kvpilot.cli", *_argv(db)], tmp_path / "killed.log") as proc:
        _wait(lambda: _count(db, "SELECT count(*) FROM trials WHERE number = 0 AND state = 'RUNNING'") == 1,
              proc, "trial 0 started")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    with sqlite3.connect(db) as con:  # what the old recovery left: trial 0 failed, nothing queued
        con.execute("UPDATE trials SET state = 'FAIL' WHERE number = 0")
    rerun = _run(db)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    trials = optuna.load_study(study_name=None, storage=f"sqlite:///{db}").trials
    defaults = [t for t in trials if t.user_attrs.get("source") == "vllmDefaults"]
    assert [t.state for t in defaults] == [TrialState.FAIL, TrialState.COMPLETE]
    # Trial numbers moved by one (so other draws): only the defaults' value is the uninterrupted one.
    comment = str(_answer(uninterrupted)["comment"])
    assert comment[comment.index("(vLLM defaults:"):] in rerun.stdout


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone while listed
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists processes through /proc")
def test_workers_die_with_their_killed_parent_and_the_rerun_measures_each_trial_once(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    budget = 24  # enough left at the kill that a worker left behind would still be measuring
    workers: list[int] = []
    try:
        with _started(["-m", "kvpilot.cli", *_argv(db, "--workers", "2", "--trials", str(budget))],
                      tmp_path / "killed.log") as proc:
            _wait(lambda: len(_children(proc.pid)) == 2 and _complete(db) >= 2, proc, "two workers measured 2 trials")
            workers = _children(proc.pid)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "workers outlived their killed parent"
    finally:
        for w in workers:  # only on failure: a worker left running would write into the rerun's study
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    cut = [t.number for t in optuna.load_study(study_name=None, storage=f"sqlite:///{db}").trials
           if t.state is TrialState.RUNNING]
    rerun = _run(db, "--workers", "2", "--trials", str(budget))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    trials = optuna.load_study(study_name=None, storage=f"sqlite:///{db}").trials
    # The budget measured, no more: the cut trials finished under their numbers, nothing left running,
    # each config measured once; a failed trial is only a draw two workers made at once, given back
    # before it was measured.
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    assert len(complete) == budget and all(trials[n].state is TrialState.COMPLETE for n in cut)
    assert all(t.state is TrialState.FAIL and t.user_attrs.get("reason") == "Duplicate"
               for t in trials if t.state is not TrialState.COMPLETE)
    engines = [tuple(sorted(t.user_attrs["engine"].items())) for t in complete]
    assert len(set(engines)) == len(engines), "a config was measured twice"
