"""Issue 18's done-when figures: how many generated model/GPU/TP/length/fraction combinations the
prediction was checked on against the twin's start-up, how many the twin refused (and how), and how
long the check takes on one core.  The check itself is tests/unit/twin/test_admission_agreement.py;
this prints what it covers.

    python benchmarks/admission_agreement.py [--combinations 2400] [--seed 18] [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.admission_agreement import COMBINATIONS, SEED, agreement, cases  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--combinations", type=int, default=COMBINATIONS)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--smoke", action="store_true", help="40 combinations: the same path in seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.combinations = 40
    start = time.perf_counter()
    all_cases, invalid = cases(args.combinations, args.seed)
    drawn = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        counts = agreement(all_cases, Path(tmp))
    done = time.perf_counter()
    print(f"combinations checked: {len(all_cases)} (seed {args.seed}; {invalid} draws refused by the API itself "
          "and drawn again)")
    print(f"  models as config.json: {sum(c.config is not None for c in all_cases)}")
    print(f"started by the twin: {counts['started']}; predicted started: {counts['started']}")
    print(f"refused by the twin: {counts['refused']}; predicted refused with the same message: {counts['refused']}")
    for key, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        if key.startswith("refused: "):
            print(f"  {n:5d}  {key[len('refused: '):]}...")
    print(f"time: {done - start:.2f} s in all ({drawn - start:.2f} s drawing and validating the specs, "
          f"{done - drawn:.2f} s starting the twin and predicting), "
          f"{(done - drawn) / len(all_cases) * 1e3:.2f} ms per combination")


if __name__ == "__main__":
    main()
