"""The twin's scheduler against vLLM's own V1 scheduler, step by step, on random request traces.

    python benchmarks/twin_vs_vllm_scheduler.py [--traces 200] [--seed 0] [--family F ...] [--show 3]
    python benchmarks/twin_vs_vllm_scheduler.py --smoke   # the path and the table against the twin itself, no vLLM

Needs the real-vLLM venv (`make vllm-env`).  Each trace (see harness/conformance/traces.py)
runs through the twin's `Scheduler` here and through vLLM's `Scheduler` / `AsyncScheduler`
in-process in that venv (no model: a step's "model" samples one token per finished prompt), with
the same budget, max_num_seqs, block size, KV blocks, long_prefill_token_threshold, watermark,
prefix caching and scheduling mode.  A step agrees when both schedule the same requests with the
same token counts and preempt, resume and finish the same requests.  Prints, per family: traces
run, steps compared, steps that differ, traces with a difference; and the first differences.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.conformance.reference import VllmEnvMissing, VllmScheduler  # noqa: E402
from harness.conformance.replay import compare_steps, replay_twin  # noqa: E402
from harness.conformance.traces import FAMILIES, random_traces  # noqa: E402


class TwinItself:
    """--smoke's stand-in for vLLM's scheduler, where no real-vLLM venv is needed: the twin's own replay.
    It runs the traces, the comparison and the table, and checks nothing (every step agrees)."""

    def __enter__(self) -> TwinItself:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def run(self, trace: dict[str, object]) -> list[dict[str, object]]:
        return replay_twin(trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=200, help="random traces per family (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the trace generator (default 0)")
    ap.add_argument("--family", action="append", choices=FAMILIES, help="only these families (repeatable)")
    ap.add_argument("--show", type=int, default=3, help="differing traces to spell out per family (default 3)")
    ap.add_argument("--smoke", action="store_true",
                    help="2 traces per family against the twin itself, not vLLM: the path and the table in "
                         "seconds, no real-vLLM venv, nothing checked (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.traces = 2
    if args.traces < 1:
        ap.error("--traces must be >= 1")
    families = args.family or list(FAMILIES)
    ref: VllmScheduler | TwinItself
    try:
        ref = TwinItself() if args.smoke else VllmScheduler()
    except VllmEnvMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    shown: list[str] = []
    started = time.perf_counter()
    with ref:
        for family in families:
            steps = differing = bad = 0
            shown_here = 0
            for i, trace in enumerate(random_traces(family, args.traces, args.seed)):
                cmp = compare_steps(replay_twin(trace), ref.run(trace))
                steps += cmp.steps
                differing += cmp.differing
                if cmp.differing:
                    bad += 1
                    if shown_here < args.show:
                        shown_here += 1
                        shown.append(f"{family} trace {i} (seed {args.seed}), {cmp.differing} of {cmp.steps} steps "
                                     f"differ, config {trace['config']}:\n    {cmp.first}")
            rows.append((family, args.traces, steps, differing, bad))
    against = "the twin itself (--smoke: nothing checked)" if args.smoke else "vLLM 0.32 V1 scheduler"
    print(f"twin vs {against}, {args.traces} traces per family, seed {args.seed} "
          f"({time.perf_counter() - started:.0f} s)")
    print(f"{'family':<14} {'traces':>7} {'steps':>9} {'differ':>8} {'traces differ':>14}")
    for family, n, steps, differing, bad in rows:
        print(f"{family:<14} {n:>7} {steps:>9} {differing:>8} {bad:>14}")
    for line in shown:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
