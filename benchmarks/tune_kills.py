"""The answer of `kvpilot tune --offline` after kills, against the uninterrupted run with the same seed.

    .venv/bin/python benchmarks/tune_kills.py [--trials 10] [--seed 0] [--kills 1,4,7] [--probe-seconds 30]
        [--workload chat]
    .venv/bin/python benchmarks/tune_kills.py --smoke   # 4 trials, one kill: seconds (CI)

Runs the study uninterrupted twice (the baseline must repeat itself), then for each N in --kills a fresh
run SIGKILLed as soon as N trials are stored (the SQLite file polled) and rerun to the end, and one run
killed at every N in turn, rerun after each kill.  Prints each run's answer: the recommended config, its
value and vLLM's defaults' value, and whether it is the uninterrupted answer; the last line counts the
runs whose answer differs (the goal: none).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from harness.studies import complete_trials  # noqa: E402


def _argv(db: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "kvpilot.cli", "tune", "--offline", "-q", "--report", "", "--trials",
            str(args.trials), "--seed", str(args.seed), "--workload", args.workload, "--probe-seconds",
            f"{args.probe_seconds:g}", "--storage", f"sqlite:///{db}"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


def _kill_after(db: Path, n: int, args: argparse.Namespace) -> bool:
    """Start the run, SIGKILL it once n trials are stored; False when it finished first."""
    proc = subprocess.Popen(_argv(db, args), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while complete_trials(db) < n:
            if proc.poll() is not None:
                return False
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        return True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _finish(db: Path, args: argparse.Namespace) -> str:
    done = subprocess.run(_argv(db, args), env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"kvpilot tune failed ({done.returncode}):\n{done.stderr[-3000:]}")
    block = done.stdout[done.stdout.index("# kvpilot tune --offline"):]
    e = yaml.safe_load(block)["spec"]["engine"]
    value = block.splitlines()[0].split(": ", 1)[1]
    return f"{e['maxNumBatchedTokens']}/{e['gpuMemoryUtilization']:g}/{e['maxNumSeqs']}  {value}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", default="1,4,7", help="trials stored when each kill lands (default %(default)s)")
    ap.add_argument("--probe-seconds", type=float, default=30.0)
    ap.add_argument("--workload", default="prompt=256,output=32")
    ap.add_argument("--smoke", action="store_true", help="4 trials at --probe-seconds 10, one kill (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.probe_seconds, args.kills = 4, 10.0, "2"
    kills = [int(k) for k in args.kills.split(",") if k]
    if any(not 0 < k < args.trials for k in kills):
        ap.error(f"--kills: each between 1 and --trials - 1 ({args.trials - 1}), got {args.kills!r}")
    print(f"kvpilot tune --offline --trials {args.trials} --seed {args.seed} --workload {args.workload} "
          f"--probe-seconds {args.probe_seconds:g}")
    print(f"{'run':<26} answer (tokens/util/seqs  value)")
    differ = runs = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = _finish(Path(tmp) / "whole.db", args)
        print(f"{'uninterrupted':<26} {base}", flush=True)
        plans = [[k] for k in kills] + ([kills] if len(kills) > 1 else [])
        for i, plan in enumerate([[], *plans]):
            db = Path(tmp) / f"run{i}.db"
            cut = [k for k in plan if _kill_after(db, k, args)]
            answer = _finish(db, args)
            name = "uninterrupted again" if not plan else f"killed at {','.join(map(str, cut)) or 'none (ended first)'}"
            same = answer == base
            differ += not same
            runs += 1
            print(f"{name:<26} {answer}  {'same' if same else 'DIFFERS'}", flush=True)
    print(f"answers that differ from the uninterrupted run: {differ} of {runs} (goal 0)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
