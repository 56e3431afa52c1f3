"""Wall time of `kvpilot tune --offline` with 1 and with N workers on one PostgreSQL study.

    .venv/bin/python benchmarks/tune_workers.py [--trials 16] [--probe-seconds 60] [--workers 1,2]
        [--modes workers,join]
    .venv/bin/python benchmarks/tune_workers.py --smoke   # 4 trials, workers mode, SQLite: seconds (CI)

Two ways to run N workers: `workers`, one `kvpilot tune --offline --workers N` that forks them; `join`,
N independent `kvpilot tune --offline --join` processes started together with the same command (what the
chart's sweep Job runs, one per pod), the budget the study's.

Each run gets a fresh database on a PostgreSQL started for the benchmark (harness/postgres.py,
Debian's server), so every run measures the whole budget.  Prints, per worker count: the wall time,
the trials measured, duplicates (configs measured twice; must be 0) and the speed-up over one worker.
The speed-up is bounded by the idle cores: the line above the table gives the machine's cores and
its load average at the start, so a shared machine's figure reads as what it is.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.postgres import PostgresServer  # noqa: E402

WORKLOAD = ["--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--workload", "prompt=256,output=32",
            "--slo", "ttft=0.5,itl=0.05"]


def run(url: str, workers: int, trials: int, probe: float, workdir: Path,
        mode: str = "workers") -> tuple[float, int, int]:
    import optuna
    from optuna.trial import TrialState

    argv = [sys.executable, "-m", "kvpilot.cli", "tune", "--offline", *WORKLOAD, "-q", "--report", "",
            "--study-name", "bench", "--trials", str(trials), "--probe-seconds", f"{probe:g}"]
    env = {**os.environ, "KVPILOT_TUNER_STORAGE": url, "PYTHONPATH": str(REPO)}
    # join: N processes, none the parent of another, each the same command.
    commands = [[*argv, "--join"]] * workers if mode == "join" else [[*argv, "--workers", str(workers)]]
    start = time.monotonic()
    procs = [subprocess.Popen(c, env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in commands]
    outputs = [p.communicate() for p in procs]
    wall = time.monotonic() - start
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{mode} {workers} failed ({p.returncode}):\n{err[-3000:]}")
    study = optuna.load_study(study_name="bench", storage=url)
    measured = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    counts = Counter(tuple(sorted(t.user_attrs["engine"].items())) for t in measured)
    return wall, len(measured), sum(n - 1 for n in counts.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--probe-seconds", type=float, default=60.0)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (default %(default)s)")
    ap.add_argument("--modes", default="workers,join",
                    help="workers (one process forking N) and/or join (N independent processes; default %(default)s)")
    ap.add_argument("--smoke", action="store_true",
                    help="4 trials at --probe-seconds 10, --modes workers on SQLite (no PostgreSQL): the table in "
                         "seconds (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.probe_seconds, args.modes = 4, 10.0, "workers"
    counts = [int(w) for w in args.workers.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"workers", "join"}:
        ap.error(f"--modes: workers and/or join, got {args.modes!r}")
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start; "
          f"{args.trials} trials at --probe-seconds {args.probe_seconds:g}, "
          f"{'SQLite' if args.smoke else 'PostgreSQL'} storage")
    print(f"{'mode':>7}  {'workers':>7}  {'wall s':>7}  {'trials':>6}  {'dups':>4}  {'speed-up':>8}")
    base: float | None = None
    workdir = REPO / "out" / "tune_workers"
    workdir.mkdir(parents=True, exist_ok=True)
    with PostgresServer() if not args.smoke else contextlib.nullcontext() as pg, \
            tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            for w in counts:
                if w == 1 and mode == "join" and "workers" in modes:
                    continue  # one process is one process; its figure is the workers row's
                url = pg.create_database(f"{mode}{w}_{int(time.time() * 1000)}") if pg is not None \
                    else f"sqlite:///{tmp}/{mode}{w}.db"
                wall, measured, dups = run(url, w, args.trials, args.probe_seconds, workdir, mode)
                base = wall if base is None else base
                print(f"{mode:>7}  {w:>7}  {wall:>7.1f}  {measured:>6}  {dups:>4}  {base / wall:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
