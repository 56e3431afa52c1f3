"""The install scripts `make test` runs on a shared CI host: they wait for a busy apt instead of failing,
and never stop processes that are not theirs."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = [ROOT / "scripts" / "install-test-tools.sh", ROOT / "scripts" / "build-image.sh"]
DPKG_FRONTEND_LOCK = Path("/var/lib/dpkg/lock-frontend")


def test_no_script_kills_processes_by_name() -> None:
    for script in [*SCRIPTS, ROOT / "scripts" / "lib" / "apt.sh"]:
        code = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert not re.search(r"\b(pkill|killall)\b", code), f"{script.name} kills processes by name"


def test_every_apt_call_goes_through_the_lock_waiting_helper() -> None:
    for script in SCRIPTS:
        # Commands only: comments and the quoted text of messages aside.
        code = "\n".join(re.sub(r'"[^"]*"', '""', line) for line in script.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        assert not re.search(r"(^|[;&|(]\s*|\s)apt-get\s", code), f"{script.name} calls apt-get directly"
        assert ". scripts/lib/apt.sh" in code


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None, reason="needs root and apt")
def test_apt_waits_for_a_held_dpkg_lock() -> None:
    """Holds dpkg's frontend lock as another apt run would; the helper waits, then installs once it is free."""
    fd = os.open(DPKG_FRONTEND_LOCK, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc = subprocess.Popen(
            ["bash", "-c", ". scripts/lib/apt.sh; APT_LOCK_WAIT_S=120 apt_get install --no-install-recommends coreutils"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=3)  # without waiting, apt-get fails at once ("Could not get lock")
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    finally:
        os.close(fd)
