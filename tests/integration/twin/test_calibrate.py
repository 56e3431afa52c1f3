"""`kvpilot twin calibrate` as a real process refits the CPU profile kvpilot ships from the observations it
ships, to the last digit: the fit is product code and deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.twin.calibration import CPU_PROFILE

pytestmark = pytest.mark.integration


def test_calibrate_refits_the_shipped_profile_from_the_shipped_observations(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "twin", "calibrate", "--output", str(out)],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout and "decode: median |error|" in proc.stdout
    refit, shipped = json.loads(out.read_text()), json.loads(CPU_PROFILE.read_text())
    assert refit["device"] == shipped["device"]
    assert refit["step_time"] == shipped["step_time"]
