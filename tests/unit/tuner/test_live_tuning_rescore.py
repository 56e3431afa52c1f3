"""benchmarks/live_tuning.py --only rescore: recorded studies valued on grids pooled over several runs.

Real subprocesses of the script on recorded JSON (no vLLM): two grid runs of the same four configs,
where the host favoured another config in each, and one run's studies; and, in-process, the load's
own percentiles it adds to each grid window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "live_tuning.py"
GRID_ARGS = ["--tokens", "128:256", "--seqs", "2:4"]
ARGS = {"load": "poisson", "rate": 5.0, "engine_threads": 1}
SLO = {"ttftSeconds": 0.25, "itlSeconds": 0.025}


def _engine(tokens: int, seqs: int) -> dict[str, Any]:
    return {"maxNumBatchedTokens": tokens, "gpuMemoryUtilization": 0.1, "maxNumSeqs": seqs}


def _grid(path: Path, itl_ms: dict[tuple[int, int], list[float]], stamp: str) -> Path:
    """A --only grid run's --out whose windows score by p99 ITL alone (TTFT well inside its SLO)."""
    rows = [{"engine": _engine(t, s), "ttftP99": [0.05] * len(v), "itlP99": [x / 1e3 for x in v],
             "rate": [5.0] * len(v)} for (t, s), v in itl_ms.items()]
    path.write_text(json.dumps({"args": ARGS, "grid": rows, "measuredAt": stamp}))
    return path


def _run(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--only", "rescore", *GRID_ARGS, *map(str, argv)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_pooled_grids_value_the_studies_picks_over_both_runs(tmp_path: Path) -> None:
    a = _grid(tmp_path / "a.json", {(128, 2): [25, 25], (128, 4): [20, 20], (256, 2): [24, 24], (256, 4): [15, 15]},
              "13:25")
    b = _grid(tmp_path / "b.json", {(128, 2): [25, 25], (128, 4): [20, 20], (256, 2): [24, 24], (256, 4): [23, 23]},
              "16:29")
    trial = {"state": "COMPLETE", "source": "sampler", "feasible": True, "reason": None}
    studies = tmp_path / "studies.json"
    studies.write_text(json.dumps({"slo": SLO, "measuredAt": "14:05", "studies": [
        {"seed": 0, "warmStart": True, "regret": {}, "trials": [
            {**trial, "number": i, "engine": _engine(*e), "value": v}
            for i, (e, v) in enumerate([((128, 2), 1.0), ((128, 4), 0.8), ((128, 4), 0.8), ((128, 4), 0.8),
                                        ((128, 4), 0.8), ((128, 4), 0.8), ((128, 4), 0.8), ((128, 4), 0.8),
                                        ((128, 4), 0.8), ((128, 4), 0.8)])]},
        {"seed": 0, "warmStart": False, "regret": {}, "trials": [
            {**trial, "number": i, "engine": _engine(256, 4), "value": 0.6} for i in range(10)]}]}))
    out = tmp_path / "rescore.json"

    alone = _run("--studies", studies, "--grid", a, "--out", out)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert abs(json.loads(out.read_text())["summary"]["warm"]["5"] - (20 / 15 - 1)) < 1e-12  # 128/4 vs 256/4's 15 ms

    pooled = _run("--studies", studies, "--grid", a, "--grid", b, "--out", out)
    assert pooled.returncode == 0, pooled.stderr[-2000:]
    got = json.loads(out.read_text())
    # 256/4 is 19 ms over both runs' four windows: still the optimum, 128/4 now 5.3% off it.
    assert got["optimum"] == _engine(256, 4) and got["measuredAt"] == "13:25 + 16:29"
    assert abs(got["summary"]["warm"]["5"] - (20 / 19 - 1)) < 1e-12 and got["summary"]["cold"]["5"] == 0.0
    assert "0.600 0.600 0.920 0.920" in pooled.stdout  # each config's windows from both runs


def test_a_grid_of_other_configs_is_refused_by_name(tmp_path: Path) -> None:
    a = _grid(tmp_path / "a.json", {(128, 2): [25], (128, 4): [20], (256, 2): [24], (256, 4): [15]}, "13:25")
    other = _grid(tmp_path / "other.json", {(128, 2): [25], (128, 4): [20]}, "16:29")
    studies = tmp_path / "studies.json"
    studies.write_text(json.dumps({"slo": SLO, "studies": [{"seed": 0, "warmStart": True, "trials": []}]}))
    res = _run("--studies", studies, "--grid", a, "--grid", other, "--out", tmp_path / "o.json")
    assert res.returncode != 0 and f"--grid {other} holds another grid" in res.stderr


def test_each_grid_window_gets_the_loads_own_percentiles_of_the_requests_it_sent() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import live_tuning
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from kvpilot.loadgen import LoadResult, RequestRecord

    # 40 requests a second for 2 s: the first window's TTFTs 0.10-0.139 s, the second's 0.50-0.539 s.
    records = [RequestRecord(index=i, start=i / 40, ok=True, ttft=(0.1 if i < 40 else 0.5) + (i % 40) / 1000,
                             itls=[0.005, 0.010 if i < 40 else 0.050]) for i in range(80)]
    records.append(RequestRecord(index=80, start=0.5, ok=False, error="reset"))  # counted, not measured
    row = {"engine": _engine(256, 8), "ttftP99": [0.2, 0.6], "itlP99": [0.0099, 0.049], "spans": [(0.0, 1.0), (1.0, 2.0)]}
    live_tuning.client_figures([row, {"engine": _engine(128, 2), "ttftP99": [1.0], "itlP99": [0.02]}],
                               LoadResult(records=records, duration_s=2.0))
    first, second = row["client"]
    assert first["requests"] == 41 and second["requests"] == 40
    assert first["ttftP50"] == pytest.approx(0.1195) and first["ttftP99"] == pytest.approx(0.13861)
    assert second["ttftP99"] == pytest.approx(0.53861)
    assert first["itlP50"] == pytest.approx(0.0075) and second["itlP99"] == pytest.approx(0.05)
