"""How well the twin's step-time model predicts measured per-layer times (Vidur profiles).

    python benchmarks/twin_calibration.py [--profiles DIR] [--smoke]

For every CSV in benchmarks/data/vidur-profiles (or --profiles, or $KVPILOT_VIDUR_PROFILES) it
prints the median and maximum relative error of `per_layer_linear_time` (what `kvpilot twin
step-time` reports as per_layer_linear_ms) against the measured sum of the op medians of one
layer (every op but `emb`), over every token count and tensor-parallel size in the file.
Goal: median <= 7 %, maximum <= 30 %.

It checks, in order:
1. the constants stored in kvpilot/twin/steptime.py;
2. the same fit re-derived here (kvpilot.twin.calibration.layers.fit_by_class), printed so the stored
   constants can be compared or replaced;
3. generalisation, by leaving each file out of the fit: with its architecture's constants fitted
   on the other files of that architecture (a model the fit never saw), and with the generic
   constants fitted on the other files only (what a GPU of an unmeasured architecture gets).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: kvpilot

from kvpilot.twin.calibration.layers import (  # noqa: E402
    CLASS_FIELDS,
    FIT_FIELDS,
    Profile,
    fit_by_class,
    load_profiles,
    relative_errors,
)
from kvpilot.twin.steptime import StepTimeParams, kernel_params_for  # noqa: E402

DEFAULT_DIR = Path(__file__).resolve().parent / "data" / "vidur-profiles"
MEDIAN_GOAL, MAX_GOAL = 0.07, 0.30


def _line(label: str, profile: Profile, params: StepTimeParams) -> bool:
    err = relative_errors(profile, params)
    med, mx = float(np.median(err)), float(err.max())
    worst = int(err.argmax())
    ok = med <= MEDIAN_GOAL and mx <= MAX_GOAL
    print(f"  {label:<44} {profile.name:<42} n={len(err):<5} median {med * 100:5.2f} %  max {mx * 100:5.2f} % "
          f"(at {profile.tokens[worst]} tokens, tp {profile.tp[worst]})  {'ok' if ok else 'MISSED'}")
    return ok


def _constants(p: StepTimeParams, names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={getattr(p, n):.4g}" for n in names)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=os.environ.get("KVPILOT_VIDUR_PROFILES", str(DEFAULT_DIR)))
    ap.add_argument("--smoke", action="store_true",
                    help="every fit stopped after 40 Nelder-Mead iterations (800 otherwise): every table in "
                         "seconds, the refits' figures not meant to be read (CI)")
    args = ap.parse_args()
    iters = 40 if args.smoke else 800
    directory = Path(args.profiles)
    if not directory.is_dir():
        print(f"no profiles at {directory}; pass --profiles DIR")
        return 2
    profiles = load_profiles(directory)
    print(f"{len(profiles)} profiles in {directory}; goal: median <= {MEDIAN_GOAL:.0%}, max <= {MAX_GOAL:.0%}\n")

    print("1. stored constants (kvpilot/twin/steptime.py)")
    stored_ok = all([_line(f"{p.gpu.architecture} constants", p, kernel_params_for(p.gpu)) for p in profiles])

    print("\n2. re-derived fit (all files)")
    t0 = time.perf_counter()
    generic, by_class = fit_by_class(profiles, iters=iters)
    print(f"  fitted in {time.perf_counter() - t0:.1f} s")
    print(f"  generic: {_constants(generic, FIT_FIELDS)}")
    for arch, p in by_class.items():
        print(f"  {arch}: {_constants(p, CLASS_FIELDS)}")
    refit_ok = all([_line(f"refit {p.gpu.architecture}", p, by_class[p.gpu.architecture]) for p in profiles])

    print("\n3. generalisation: each file left out of the fit")
    class_ok, generic_ok = [], []
    for i, held in enumerate(profiles):
        rest = [p for j, p in enumerate(profiles) if j != i]
        g, bc = fit_by_class(rest, iters=iters)
        arch = held.gpu.architecture
        if arch in bc:
            class_ok.append(_line(f"unseen model, {arch} fitted on the rest", held, bc[arch]))
        unseen_gpu = all(p.gpu.name != held.gpu.name for p in rest)
        label = "unseen GPU: generic fitted on the rest" if unseen_gpu else "generic fitted on the rest"
        generic_ok.append(_line(label, held, g))

    print("\nsummary")
    print(f"  stored constants:                  {'goal MET' if stored_ok else 'goal NOT met'}")
    print(f"  re-derived fit:                    {'goal MET' if refit_ok else 'goal NOT met'}")
    print(f"  held-out model (same GPU class):   {'goal MET' if class_ok and all(class_ok) else 'goal NOT met'}")
    print(f"  held-out file, generic constants:  {sum(generic_ok)}/{len(generic_ok)} files meet the goal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
