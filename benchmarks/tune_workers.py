"""Wall time of `kvpilot tune --offline` with 1 and with N workers on one PostgreSQL study.

    .venv/bin/python benchmarks/tune_workers.py [--trials 16] [--probe-seconds 60] [--workers 1,2]

Each run gets a fresh database on a PostgreSQL started for the benchmark (tests/support/postgres.py,
Debian's server), so every run measures the whole budget.  Prints, per worker count: the wall time,
the trials measured, duplicates (configs measured twice; must be 0) and the speed-up over one worker.
The speed-up is bounded by the idle cores: the line above the table gives the machine's cores and
its load average at the start, so a shared machine's figure reads as what it is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.postgres import PostgresServer  # noqa: E402

WORKLOAD = ["--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--workload", "prompt=256,output=32",
            "--slo", "ttft=0.5,itl=0.05"]


def run(pg: PostgresServer, workers: int, trials: int, probe: float, workdir: Path) -> tuple[float, int, int]:
    import optuna
    from optuna.trial import TrialState

    url = pg.create_database(f"w{workers}_{int(time.time() * 1000)}")
    argv = [sys.executable, "-m", "kvpilot.cli", "tune", "--offline", *WORKLOAD, "-q", "--report", "",
            "--study-name", "bench", "--trials", str(trials), "--probe-seconds", f"{probe:g}",
            "--workers", str(workers)]
    env = {**os.environ, "KVPILOT_TUNER_STORAGE": url, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    done = subprocess.run(argv, env=env, cwd=workdir, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"--workers {workers} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    study = optuna.load_study(study_name="bench", storage=url)
    measured = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    counts = Counter(tuple(sorted(t.user_attrs["engine"].items())) for t in measured)
    return wall, len(measured), sum(n - 1 for n in counts.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--probe-seconds", type=float, default=60.0)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (default %(default)s)")
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; "
          f"{args.trials} trials at --probe-seconds {args.probe_seconds:g}, PostgreSQL storage")
    print(f"{'workers':>7}  {'wall s':>7}  {'trials':>6}  {'dups':>4}  {'speed-up':>8}")
    base: float | None = None
    workdir = REPO / "out" / "tune_workers"
    workdir.mkdir(parents=True, exist_ok=True)
    with PostgresServer() as pg:
        for w in counts:
            wall, measured, dups = run(pg, w, args.trials, args.probe_seconds, workdir)
            base = wall if base is None else base
            print(f"{w:>7}  {wall:>7.1f}  {measured:>6}  {dups:>4}  {base / wall:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
