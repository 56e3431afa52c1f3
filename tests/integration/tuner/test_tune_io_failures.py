"""`kvpilot tune --offline` (a real process) when its files fail it: a full disk (a file size limit,
RLIMIT_FSIZE: a write past it fails with EFBIG, as on a full disk; or the report on /dev/full), a
read-only directory, a damaged study file.  Each is one line naming what happened, with its own exit
status (never 70, "internal error"), and the recommended block is printed before the report is
written, so a report that cannot be written does not take the answer with it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from kvpilot.tuner.iofailure import EX_CANTCREAT, EX_DATAERR, EX_IOERR

SMALL = ["--workload", "prompt=256,output=32", "--probe-seconds", "20", "-q"]


def _tune(db: Path, trials: int, *extra: str, preexec: Callable[[], None] | None = None,
          report: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "tune", "--offline", *SMALL, "--trials", str(trials),
         "--storage", f"sqlite:///{db}", "--report", report, *extra],
        capture_output=True, text=True, timeout=600, preexec_fn=preexec,
        env={**os.environ, "PYTHONPATH": os.getcwd(), "KVPILOT_DEBUG": ""},
    )


def _one_clear_line(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    err = done.stderr
    assert done.returncode == code, err[-3000:]
    assert "internal error" not in err and "Traceback" not in err, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("kvpilot tune: "))
    for needle in needles:
        assert needle in line, line
    return line


def _block(stdout: str) -> dict[str, object]:
    engine: dict[str, object] = yaml.safe_load(stdout[stdout.index("# kvpilot tune --offline"):])["spec"]["engine"]
    return engine


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A study with one trial done, for the runs below to resume (and a file to fail)."""
    db = tmp_path_factory.mktemp("study") / "s.db"
    done = _tune(db, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return db


def _copy(study: Path, to: Path) -> Path:
    to.mkdir(exist_ok=True)
    (to / study.name).write_bytes(study.read_bytes())
    return to / study.name


@pytest.mark.parametrize("workers", [1, 2])
def test_a_full_disk_under_the_study_is_named_with_its_exit_status(workers: int, study: Path, tmp_path: Path) -> None:
    """In the run's own process, or in its forked workers (each says so; the run ends with their status)."""
    db = _copy(study, tmp_path / "full")
    limit = db.stat().st_size + 8192  # room to open and resume the study, none for the trials to come

    def fsize() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes get EFBIG

    done = _tune(db, 12, "--workers", str(workers), preexec=fsize)
    _one_clear_line(done, EX_IOERR, "cannot write the study storage", f"ulimit -f: {limit} bytes")


def test_a_damaged_study_file_is_named_with_its_exit_status(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    db.write_bytes(b"not a database, whatever was here before\n" * 200)
    _one_clear_line(_tune(db, 1), EX_DATAERR, f"the study storage sqlite:///{db} is not a SQLite database",
                    "move the file aside")


def _unprivileged() -> None:
    """In the child, before exec: without the capabilities that let root write where the mode says
    no (DAC override), so that a read-only directory is one for it too (the suite may run as root)."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    for cap in (1, 2, 3):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: exec then grants root no more
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@contextlib.contextmanager
def _read_only(directory: Path) -> Iterator[None]:
    directory.chmod(0o555)
    try:
        probe = subprocess.run([sys.executable, "-c", f"open({str(directory / 'probe')!r}, 'w')"],
                               preexec_fn=_unprivileged, capture_output=True, text=True)
        if probe.returncode == 0:
            pytest.skip("this process can write a directory of mode 0555 (root with its capabilities kept)")
        yield
    finally:
        directory.chmod(0o755)


def test_a_read_only_study_directory_is_named_with_its_exit_status(study: Path, tmp_path: Path) -> None:
    db = _copy(study, tmp_path / "ro")
    with _read_only(db.parent):
        done = _tune(db, 3, preexec=_unprivileged)
    _one_clear_line(done, EX_CANTCREAT, "cannot write the study storage", f"its directory {db.parent} is read-only")


def test_a_full_disk_under_the_report_leaves_the_answer_printed(study: Path, tmp_path: Path) -> None:
    db = _copy(study, tmp_path / "report")
    report = tmp_path / "report.html"
    report.symlink_to("/dev/full")  # every write: ENOSPC
    done = _tune(db, 1, report=str(report))
    _one_clear_line(done, EX_IOERR, f"cannot write the report {report}", "no space left on the device")
    assert set(_block(done.stdout)) >= {"maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs"}


def test_a_read_only_report_directory_leaves_the_answer_printed(study: Path, tmp_path: Path) -> None:
    db = _copy(study, tmp_path / "report")
    out = tmp_path / "out"
    out.mkdir()
    with _read_only(out):
        done = _tune(db, 1, report=str(out / "r.html"), preexec=_unprivileged)
    _one_clear_line(done, EX_CANTCREAT, f"cannot write the report {out / 'r.html'}", f"its directory {out} is read-only")
    assert set(_block(done.stdout)) >= {"maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs"}
