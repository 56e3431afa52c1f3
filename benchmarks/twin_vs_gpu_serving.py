"""The twin against published real-vLLM serving runs on GPUs.

    python benchmarks/twin_vs_gpu_serving.py [--data CSV] [--traces DIR] [--fit] [--smoke]

--data: rows in the columns of `blis_train13_by_stage.csv` (default: that file, committed in
benchmarks/data/gpu-serving).  For each experiment it rebuilds the workload (stages of Poisson
arrivals, shared system prompts as prefix-cache hits), runs the twin with the row's engine settings
and prints, per experiment and stage, the twin's E2E/TTFT mean, p90, p99 and TPOT beside the
measured figures (and BLIS's, where the file has them), then the median absolute error per metric
over the whole-run rows and over every row.

--traces: the exact per-request traces (GuideLLM sweeps of CodeLlama-34B on an H100, LLMServingSim's
Llama-3.1-8B on an RTX 4090), replayed request for request; same figures per load point.

--fit: the calibration of the serving constants (kvpilot.twin.serving_runs.SERVING_GRID) on the
data's rows, and its leave-one-model-out cross-validation (each model's rows judged by constants
chosen without them).  --smoke: two experiments, a tenth of their length, no traces.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpilot.twin.serving_runs import (  # noqa: E402
    METRICS,
    WHOLE_RUN,
    Experiment,
    ExperimentError,
    TraceRun,
    errors,
    fit_serving,
    median_errors,
    planned_blocks,
    read_guidellm_runs,
    read_llmservingsim_run,
    run_experiment,
    run_trace,
)

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "benchmarks" / "data" / "gpu-serving"
SHOWN = ("e2e_mean", "e2e_p99", "ttft_mean", "ttft_p99", "itl_mean")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_experiments(exps: list[Experiment], time_scale: float) -> tuple[list, list]:
    twin_errs: list = []
    blis_errs: list = []
    unsimulated: list[str] = []
    print(f"{'experiment':44s} {'stage':>5s}  " + "  ".join(f"{m:>23s}" for m in SHOWN))
    print(f"{'':44s} {'':5s}  " + "  ".join(f"{'twin/measured/BLIS':>23s}" for _ in SHOWN))
    for exp in exps:
        try:
            pred = run_experiment(exp, time_scale=time_scale)
        except ExperimentError as exc:  # counted apart: a NaN would turn every median into NaN
            print(f"{exp.key[:44]:44s} NOT SIMULATED: {exc}")
            unsimulated.append(exp.key)
            continue
        twin_errs.append(errors(pred, exp.measured))
        if exp.published:
            blis_errs.append(errors(exp.published, exp.measured))
        for stage in sorted(exp.measured, key=lambda s: (s != WHOLE_RUN, s)):
            p, m, b = pred.get(stage, {}), exp.measured[stage], exp.published.get(stage, {})
            cells = [f"{_fmt(p.get(k)):>7s}/{_fmt(m.get(k)):>7s}/{_fmt(b.get(k)):>7s}" for k in SHOWN]
            label = "all" if stage == WHOLE_RUN else str(stage)
            print(f"{exp.key[:44]:44s} {label:>5s}  " + "  ".join(cells))
    if unsimulated:
        print(f"\n{len(unsimulated)} of {len(exps)} experiments not simulated (left out of the medians): "
              + ", ".join(unsimulated))
    return twin_errs, blis_errs


def print_medians(title: str, twin: list, blis: list) -> None:
    print(f"\n{title}: median absolute error, %   " + "  ".join(f"{m:>9s}" for m in METRICS))
    for name, errs in (("twin", twin), ("BLIS", blis)):
        if not errs:
            continue
        for label, stage in (("whole-run rows", WHOLE_RUN), ("every row", None)):
            med = median_errors(errs, stage)
            print(f"  {name:5s} {label:15s}" + " " * 16 + "  ".join(f"{med[m]:9.1f}" for m in METRICS))


def print_traces(runs: list[TraceRun]) -> None:
    print(f"\n{'trace run':52s} {'reqs':>5s}  " + "  ".join(f"{m:>17s}" for m in SHOWN))
    print(f"{'':52s} {'':5s}  " + "  ".join(f"{'twin/measured':>17s}" for _ in SHOWN))
    errs = []
    for run in runs:
        try:
            pred = run_trace(run)
        except ExperimentError as exc:
            print(f"{run.name[:52]:52s} NOT SIMULATED: {exc}")
            continue
        errs.append(errors({WHOLE_RUN: pred}, {WHOLE_RUN: run.measured}))
        cells = [f"{_fmt(pred.get(k)):>8s}/{_fmt(run.measured.get(k)):>8s}" for k in SHOWN]
        print(f"{run.name[:52]:52s} {len(run.arrival_s):5d}  " + "  ".join(cells))
    if errs:
        med = median_errors(errs)
        print("  median absolute error, %: " + ", ".join(f"{m} {med[m]:.1f}" for m in METRICS))


def print_memory_plans(exps: list[Experiment]) -> None:
    print("\nmemory plan: KV-cache blocks at vLLM's default utilisation against the blocks each run logged")
    dense, other = [], []
    seen = set()
    for exp in exps:
        key = (exp.model, exp.tp, exp.max_num_batched_tokens)
        if exp.num_gpu_blocks is None or key in seen:
            continue
        seen.add(key)
        try:
            planned = planned_blocks(exp)
        except (ExperimentError, ValueError) as exc:
            print(f"  {exp.model:52s} tp{exp.tp}: not planned: {str(exc).splitlines()[0][:80]}")
            continue
        err = (planned - exp.num_gpu_blocks) / exp.num_gpu_blocks * 100
        (other if exp.model_spec().is_moe else dense).append(abs(err))
        print(f"  {exp.model:52s} tp{exp.tp} chunk {exp.max_num_batched_tokens:5d}: twin {planned:6d}, "
              f"logged {exp.num_gpu_blocks:6d}, {err:+.1f}%")
    if dense:
        print(f"  dense models: median |error| {np.median(dense):.1f}%, max {max(dense):.1f}% ({len(dense)} configs)")
    if other:
        print(f"  mixture-of-experts models: median |error| {np.median(other):.1f}% ({len(other)} configs)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=SHARED / "blis_train13_by_stage.csv",
                    help="CSV in the columns of blis_train13_by_stage.csv (default: the committed training rows)")
    ap.add_argument("--traces", type=Path, default=SHARED,
                    help="folder holding guidellm_codellama34b_h100_10pts.csv, llmservingsim_rtx4090_llama8b.csv "
                         "and traces/ (default: benchmarks/data/gpu-serving); 'none' skips the traces")
    ap.add_argument("--fit", action="store_true",
                    help="calibrate the serving constants on --data and print the leave-one-model-out figures")
    ap.add_argument("--smoke", action="store_true", help="two experiments at a tenth of their length, no traces")
    args = ap.parse_args()

    from kvpilot.twin.serving_runs import read_experiments

    t0 = time.perf_counter()
    try:
        exps = read_experiments(args.data)
    except ExperimentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    scale = 1.0
    if args.smoke:
        exps, scale = exps[:2], 0.1
    print(f"{len(exps)} experiments from {args.data}\n")
    twin, blis = print_experiments(exps, scale)
    print_medians("measured runs", twin, blis)
    print_memory_plans(exps)

    if args.fit:
        print("\ncalibration of the serving constants (grid search on runs half their length):")
        result = fit_serving(exps, time_scale=0.1 if args.smoke else 0.5, log=print)
        print(f"  fitted on every row: {json.dumps(result.best)}")
        print_medians("leave-one-model-out (each model judged by constants chosen without it)", result.cv_errors, [])
        for model, chosen in result.cv_choice.items():
            print(f"    without {model}: {json.dumps(chosen)}")

    if not args.smoke and str(args.traces) != "none":
        runs = []
        guide = args.traces / "guidellm_codellama34b_h100_10pts.csv"
        if guide.exists():
            runs += read_guidellm_runs(guide, args.traces)
        llmss = args.traces / "llmservingsim_rtx4090_llama8b.csv"
        if llmss.exists():
            runs += read_llmservingsim_run(llmss, args.traces)
        if runs:
            print_traces(runs)
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
