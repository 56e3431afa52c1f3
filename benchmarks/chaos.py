"""Chaos on a real control plane: faults on a seeded schedule, the invariants checked after each.

    python benchmarks/chaos.py --faults 200 --seed 1 [--workdir DIR] [--smoke]

The bed is harness/chaos_bed.py: etcd, kube-apiserver, the controllers and kwok nodes (harness/cluster.py,
`make control-plane`), the real `kvpilot operator` and `kvpilot tuner` as the chart's ServiceAccounts
(through a proxy that can answer 429/5xx), and a real Prometheus. The faults (harness/chaos.py): etcd and
the API server killed and restarted, the operator and the tuner SIGKILLed and restarted, Prometheus down
for a while, bursts of 429/5xx, a kwok node removed during a rollout. Prints the faults injected, every
invariant violation (what and when) and the time to converge after a fault (p50/p99); exits 1 if any
invariant was violated, 2 if the bed cannot be built here, 3 if stopped (SIGTERM, Ctrl-C) before the
last fault; what ran is reported either way.

--smoke: two faults (an operator kill and a burst of API errors), the same path in about a minute (CI).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import chaos  # noqa: E402
from harness.chaos_bed import BedUnavailable  # noqa: E402


def main() -> int:
    # SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so every process the bed started is stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=20, help="faults to inject (default 20)")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    parser.add_argument("--workdir", type=Path, help="keep the logs and the study here (default: a temporary "
                        "directory, removed afterwards)")
    parser.add_argument("--converge", type=float, default=chaos.CONVERGE_S,
                        help=f"seconds each fault has to converge (default {chaos.CONVERGE_S:.0f})")
    parser.add_argument("--smoke", action="store_true", help="two cheap faults: the same path in about a minute")
    args = parser.parse_args()
    if args.faults < 1:
        parser.error(f"--faults must be at least 1 (got {args.faults})")
    kinds: tuple[str, ...] = chaos.KINDS
    if args.smoke:
        args.faults, kinds = 2, ("operator-kill", "api-errors")
    with tempfile.TemporaryDirectory(prefix="kvpilot-chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            report = chaos.run(args.faults, args.seed, workdir, converge_s=args.converge, kinds=kinds,
                               progress=lambda line: print(line, flush=True))
        except BedUnavailable as exc:
            print(f"chaos: {exc}")
            return 2
    print(chaos.render(report))
    return 1 if report.violations else 3 if report.interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
