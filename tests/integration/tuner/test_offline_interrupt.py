"""Ctrl-C on `kvpilot tune --offline` (SIGINT to its whole process group, as a terminal sends it), and
its progress where stderr is a log: a real process each time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.studies import complete_trials

ARGS = ["--workload", "prompt=256,output=32", "--probe-seconds", "20", "--seed", "3", "--report", ""]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.getcwd(), "KVPILOT_DEBUG": ""}


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_says_what_was_kept_and_how_to_resume_without_a_traceback(tmp_path: Path, workers: str) -> None:
    # With --workers 2 each worker printed a KeyboardInterrupt traceback; with one, nothing was said.
    db = tmp_path / "s.db"
    argv = [sys.executable, "-m", "kvpilot.cli", "tune", "--offline", "--trials", "30", "--workers", workers,
            *ARGS, "--storage", f"sqlite:///{db}"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)  # its own process group, as a shell job has
    try:
        deadline = time.monotonic() + 300
        while complete_trials(db) < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "timed out waiting for two trials"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "kvpilot tune: interrupted:" in err and "trials are kept in study" in err
    assert "run the same command again to resume" in err


def test_progress_into_a_log_is_a_line_per_trial(tmp_path: Path) -> None:
    # tqdm wrote carriage-return frames into logs when stderr was not a terminal.
    db = tmp_path / "s.db"
    done = subprocess.run([sys.executable, "-m", "kvpilot.cli", "tune", "--offline", "--trials", "3", *ARGS,
                           "--storage", f"sqlite:///{db}"], capture_output=True, text=True, env=_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "\r" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("kvpilot tune: ") and " trials" in line]
    assert [line.split(",")[0] for line in lines] == [f"kvpilot tune: {n}/3 trials" for n in (1, 2, 3)]
    assert all(", best " in line for line in lines)
