"""Independent `kvpilot tune --offline --join` processes on one PostgreSQL study: what the pods of the
chart's sweep Job (`sweep.parallelism` N) run, each the same command, with no parent among them.

- two processes, the second started while the first measures, finish exactly the study's budget,
  no config measured twice, and the second never fails the first's trial in progress;
- a worker SIGKILLed mid-trial: its trial is failed only once its heartbeat is older than the
  grace period, its config is measured again by the survivor, and the survivor's own trials are
  never touched;
- --join with SQLite is refused, naming the flag.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.postgres import postgres_server, postgres_url  # noqa: F401 - fixtures
from tests.integration.tuner.test_postgres_storage import TUNE, _env, kvpilot, trials, wait_for

pytestmark = pytest.mark.integration

HEARTBEAT, GRACE = 1, 3
JOIN = [*TUNE, "--join", "--heartbeat-interval", str(HEARTBEAT), "--grace-period", str(GRACE)]
GIVEN_BACK = {"Duplicate", "BudgetSpent"}  # failed by their own worker before they were measured


def _start(args: list[str], url: str, cwd: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = cwd / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=cwd, env=_env(url))
    return proc, log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def _worker(proc: subprocess.Popen[bytes]) -> str:
    return f"/{proc.pid}"


def _mine(t: Any, proc: subprocess.Popen[bytes]) -> bool:
    return str(t.user_attrs.get("worker", "")).endswith(_worker(proc))


def _measuring(url: str, proc: subprocess.Popen[bytes], log: Path) -> Any:
    """The trial `proc` is measuring (RUNNING, its config drawn), or None."""
    from optuna.trial import TrialState

    assert proc.poll() is None, f"worker {proc.pid} ended early: {log.read_text()[-3000:]}"
    try:
        ts = trials(url)
    except KeyError:  # the study is not created yet
        return None
    return next((t for t in ts if t.state == TrialState.RUNNING and t.params and _mine(t, proc)), None)


def _configs(ts: list[Any]) -> list[tuple[Any, ...]]:
    return [tuple(sorted(t.user_attrs["engine"].items())) for t in ts]


def test_two_independent_processes_finish_the_study_budget_once(
    postgres_url: str, tmp_path: Path  # noqa: F811
) -> None:
    from optuna.trial import TrialState

    args = [*JOIN, "--trials", "6", "--probe-seconds", "60"]
    first, first_log = _start(args, postgres_url, tmp_path, "first")
    second: subprocess.Popen[bytes] | None = None
    try:
        # The second opens the study while the first has a trial in progress: a live sibling's.
        seen: list[Any] = []
        wait_for(lambda: seen.append(_measuring(postgres_url, first, first_log)) or seen[-1] is not None, 180,
                 "the first worker's trial")
        live = seen[-1]
        second, second_log = _start(args, postgres_url, tmp_path, "second")
        assert first.wait(300) == 0, first_log.read_text()[-3000:]
        assert second.wait(300) == 0, second_log.read_text()[-3000:]
    finally:
        _stop(first)
        if second is not None:
            _stop(second)
    every = trials(postgres_url)
    measured = [t for t in every if t.state == TrialState.COMPLETE]
    # The budget is the study's: six in all, not six each.
    assert len(measured) == 6
    assert not [t for t in every if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    configs = _configs(measured)
    assert len(set(configs)) == len(configs), "a config was measured twice"
    # The first's trial in progress when the second joined was left to it and measured once.
    assert every[live.number].state == TrialState.COMPLETE and _mine(every[live.number], first)
    # Nothing was failed but draws given back by their own worker before they were measured.
    assert all(t.user_attrs.get("reason") in GIVEN_BACK for t in every if t.state == TrialState.FAIL)
    # Both printed the study's recommendation.
    assert "maxNumBatchedTokens" in first_log.read_text() and "maxNumBatchedTokens" in second_log.read_text()


def test_a_killed_worker_trial_is_measured_again_by_the_survivor_after_the_grace_period(
    postgres_url: str, tmp_path: Path  # noqa: F811
) -> None:
    from optuna.trial import TrialState

    # Long probes: a trial runs for seconds, so each worker is caught mid-trial.
    args = [*JOIN, "--trials", "4", "--probe-seconds", "120"]
    victim, victim_log = _start(args, postgres_url, tmp_path, "victim")
    survivor: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _measuring(postgres_url, victim, victim_log) is not None, 180, "the victim's trial")
        survivor, survivor_log = _start(args, postgres_url, tmp_path, "survivor")
        # Freeze the victim where it is measuring a trial (a SIGKILL sent on a stale look could land
        # between two trials), then kill it there.
        while True:
            wait_for(lambda: _measuring(postgres_url, victim, victim_log) is not None, 180, "a victim's trial")
            victim.send_signal(signal.SIGSTOP)
            cut = _measuring(postgres_url, victim, victim_log)
            if cut is not None:
                killed_at = time.time()
                victim.kill()
                break
            victim.send_signal(signal.SIGCONT)
        victim.wait(30)
        assert survivor.wait(300) == 0, survivor_log.read_text()[-3000:]
    finally:
        _stop(victim)
        if survivor is not None:
            _stop(survivor)
    every = trials(postgres_url)
    failed = every[cut.number]
    assert failed.state == TrialState.FAIL
    # Failed only once its last heartbeat (at most one interval before the kill) was older than the
    # grace period: never while its worker was alive.
    assert failed.datetime_complete is not None
    assert failed.datetime_complete.timestamp() >= killed_at + GRACE - HEARTBEAT
    # Its config was measured again, by the survivor, as a resumed trial.
    again = [t for t in every if t.state == TrialState.COMPLETE and t.params == cut.params]
    assert len(again) == 1 and _mine(again[0], survivor) and again[0].user_attrs["source"] == "resume"
    # The budget is kept and no config is measured twice.
    measured = [t for t in every if t.state == TrialState.COMPLETE]
    assert len(measured) == 4
    assert len(set(_configs(measured))) == 4
    assert not [t for t in every if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # The survivor's trials were never touched: each is measured, or a draw it gave back itself.
    for t in every:
        if _mine(t, survivor):
            assert t.state == TrialState.COMPLETE or t.user_attrs.get("reason") in GIVEN_BACK, t
    # The only trial failed from outside is the dead worker's.
    assert [t.number for t in every if t.state == TrialState.FAIL
            and t.user_attrs.get("reason") not in GIVEN_BACK] == [cut.number]


def test_join_with_sqlite_is_refused_naming_the_flag(tmp_path: Path) -> None:
    done = kvpilot(*TUNE, "--join", "--trials", "2", "--probe-seconds", "20",
                   storage=f"sqlite:///{tmp_path / 'study.db'}", cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert "--join: several independent processes on one study need a database server" in done.stderr
    assert "--workers N" in done.stderr
