"""A short seeded chaos schedule on its own real control plane (harness/chaos.py, the run
`benchmarks/chaos.py --faults 7 --seed 1` makes): seven faults, one of each kind, each landing during a
rollout and a tuning trial, and not one invariant broken after any of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import chaos
from harness.cluster import built_binaries
from harness.prometheus import require_prometheus

pytestmark = pytest.mark.cluster


@pytest.mark.timeout(900)
def test_a_short_seeded_chaos_schedule_breaks_no_invariant(tmp_path: Path) -> None:
    built_binaries()
    require_prometheus()
    report = chaos.run(7, 1, tmp_path)
    assert sorted(f.kind for f in report.faults) == sorted(chaos.KINDS)
    assert report.violations == [], chaos.render(report)
    assert len(report.converge_s) == 7, chaos.render(report)
    assert sum(report.proxy["injected"].values()) > 0, "the API-error burst refused nothing"
