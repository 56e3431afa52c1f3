"""promtool rule tests of the 6h page and the 1d/3d ticket alerts (days of synthetic series).

The files are tests/promtool/*.test.yaml, kept current by tests/unit/slo/test_promtool.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.prometheus import require_promtool

pytestmark = pytest.mark.integration

PROMTOOL_DIR = Path(__file__).resolve().parents[2] / "promtool"


@pytest.mark.parametrize("name", ["slo.page-6h.test.yaml", "slo.ticket.test.yaml"])
def test_promtool_rule_tests_long_windows(name: str) -> None:
    result = subprocess.run(
        [require_promtool(), "test", "rules", name], capture_output=True, text=True, timeout=240, cwd=PROMTOOL_DIR
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
