"""Every benchmark's `--smoke` run, as CI runs it: `python benchmarks/X.py --smoke` in a subprocess, exit 0
and its table printed.  A script in benchmarks/ with a `__main__` block is a benchmark; one without a
smoke mode, or without a line below saying what its smoke run prints, fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

# A line of each benchmark's table (a regular expression, searched in stdout and stderr together).
PRINTS = {
    "admission_agreement": r"combinations checked: 40 ",
    "canary": r"(?m)^diurnal\s+canary\s+\d+",
    "chaos": r"(?m)^invariant violations: \d+$",
    "capacity_holds": r"capacity holds \(meets at 95%, misses at 120%, every seed\): (yes|NO)",
    "fleet_cost": r"2x step absorbed in \d+, \d+, \d+ s at the scrape's three phases \(goal <= \d+ s",
    "gpu_probe": r"h200_meta-llama_Llama-3.1-70B.mlp.csv: as committed",
    "live_steps": r"(?m)^\s+128/8: \d+ token gaps",
    "live_tuning": r"(?m)^warm start\s+\d+\.\d%",
    "operator_failover": r'"sigkill_takeover_max_s": \d',
    "operator_scale": r"operator peak RSS \(VmHWM\):\s+\d",
    "planner_read": r"(?m)^first read, mix 2000/150\s+\d+\.\d+\s+\d",
    "tune_kills": r"answers that differ from the uninterrupted run: \d+ of \d+ \(goal 0\)",
    "tune_workers": r"(?m)^workers\s+2\s+\d",
    "tuner_quality": r"goal tuner median regret <= 5% on every scenario: (met|NOT met)",
    "twin_calibration": r"held-out file, generic constants:\s+\d+/3 files",
    "twin_flood": r"/health latency during: median",
    "twin_hostile": r"goals: <= 2 CPU-s and 200 MB a request, /health and stream gaps <= 100 ms: (met|NOT met)",
    "twin_memory": r"test  vLLM >= 0\.17\s+fitted:",
    "twin_speed": r"goal >= 300x real time: (MET|NOT MET)",
    "twin_tracing": r"on / off:\s+\d",
    "twin_vs_gpu": r"== attention per layer",
    "twin_vs_gpu_serving": r"(?m)^\s+twin\s+whole-run rows(\s+[\d.]+){7}$",
    "twin_vs_vllm": r"(?m)^\s+itl_p99\s+\d+\.\d% \(max",
    "twin_vs_vllm_scheduler": r"(?m)^dp-interval\s+2\s+\d+",
    "validate_throughput": r'"validate_object_per_s": \d',
    "vllm_pod_security": r'"mode": "uid-nouser"',
    "webhook": r'"reviews_per_s": \d',
}


def benchmarks() -> list[str]:
    """Every script with a `__main__` block but figures.py (it measures nothing; test_figures.py runs it)."""
    return sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text() and p.stem != "figures")


def test_every_benchmark_is_listed() -> None:
    assert benchmarks() == sorted(PRINTS), "a benchmark without a line in PRINTS, or a line without its benchmark"


@pytest.mark.parametrize("name", benchmarks())
def test_smoke(name: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run([sys.executable, f"benchmarks/{name}.py", "--smoke"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} --smoke ran past {TIMEOUT_S} s:\n{e.stdout!s:.3000}\n{e.stderr!s:.3000}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} --smoke exited {done.returncode}:\n{output[-4000:]}"
    assert name in PRINTS and re.search(PRINTS[name], output), f"{name} --smoke did not print its table:\n{output[-4000:]}"
