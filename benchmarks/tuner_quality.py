"""Tuner quality on the twin: regret against the exhaustive grid optimum.

    python benchmarks/tuner_quality.py                 # all scenarios in benchmarks/scenarios/
    python benchmarks/tuner_quality.py --only llama8b-h100-chat --workers 2
    python benchmarks/tuner_quality.py --smoke         # one scenario on a small grid: the tables in seconds

For each scenario (a model on a GPU, a workload, an SLO; `benchmarks/scenarios/*.yaml`):
1. the capacity of every config on the grid maxNumBatchedTokens 256..16384 (powers of two) x
   gpuMemoryUtilization 0.70..0.95 (by 0.05) x maxNumSeqs 64..1024 (powers of two), skipping
   tokens < seqs; the best is the grid optimum;
2. the capacity of vLLM's default config for that GPU;
3. the median regret (1 - capacity found / grid optimum) over 5 seeds (`--seeds`) of the tuner
   (Latin hypercube start, then multivariate TPE, guided by the memory floor, redone start-up
   strata, polish, start-up strata claimed by trial 0 and a start-up cap within its token budget --
   `--without PART` turns parts off; vLLM's defaults enqueued first) and of
   plain random search, 20 trials each, both searching the grid's resolution (powers of two, 0.05 steps) so
   every trial is a grid point.  Where both medians are 0 the median says nothing, so it also
   prints, from the same studies' best-so-far curves: the mean regret after 20, 10 and 5 trials,
   how many seeds got within 5% of the optimum by trial 10, and the mean trials to get within 5%;
   and, per scenario, whether the tuner is below random search on each (a regret difference under
   the capacity search's 2% tolerance is a tie, not a win);
4. the honest warm start: a 20-trial tuner study on the nominal twin; its best 3 configs are
   enqueued into a study whose trials are measured on a perturbed twin (efficiency factors and
   overheads each off by up to 20%, standing in for real hardware); regret after 5 trials
   against the perturbed twin's own grid optimum; median over the 5 sampler seeds and
   `--warm-seeds` perturbations (each perturbation costs one more grid, so 1 by default).

Capacities are cached on disk (out/tuner-quality-cache/<hash of the twin's sources>/, one file per
scenario and twin perturbation, holding the scenario it was computed for):
the same config on the same scenario always gives the same capacity, so a rerun is instant and
a killed run resumes.  Grid evaluation fans out over processes (--workers, default 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from kvpilot.tuner.adapters.offline import StartupFailed, TwinEvaluator, TwinTarget, parse_workload  # noqa: E402
from kvpilot.tuner.core.objective import SLO, Goal, Measurement, Outcome, infeasible, score  # noqa: E402
from kvpilot.tuner.core.search import run_offline, top_configs  # noqa: E402
from kvpilot.tuner.core.space import EngineParams, SearchSpace  # noqa: E402
from kvpilot.tuner.core.startup import StartupMemory  # noqa: E402
from kvpilot.tuner.core.study import Guidance, TunerStudy  # noqa: E402

CACHE = ROOT.parent / "out" / "tuner-quality-cache"  # out/ is git-ignored
SCENARIO_KEY = "_scenario"  # in a cache file: the scenario its capacities belong to
GRID_SPACE = SearchSpace(scale="pow2", util_step=0.05)
TRIALS = 20
SEEDS = range(5)
PROBE_S = 150.0  # seconds of arrivals per probed rate (`kvpilot tune --offline`'s); --smoke: 10


def load_scenarios(only: list[str] | None) -> list[dict[str, Any]]:
    out = []
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        sc = yaml.safe_load(path.read_text())
        if only and sc["name"] not in only:
            continue
        out.append(sc)
    return out


def target_of(sc: dict[str, Any], perturb_seed: int | None) -> TwinTarget:
    t = TwinTarget(model=sc["model"], gpu=sc["gpu"], max_model_len=int(sc.get("maxModelLen", 8192)),
                   tensor_parallel_size=int(sc.get("tensorParallelSize", 1)))
    return t.perturbed(perturb_seed) if perturb_seed is not None else t


def slo_of(sc: dict[str, Any]) -> SLO:
    return SLO(float(sc["slo"]["ttftSeconds"]), float(sc["slo"]["itlSeconds"]))


def _key(p: EngineParams) -> str:
    return f"{p.max_num_batched_tokens}/{p.gpu_memory_utilization:.2f}/{p.max_num_seqs}"


def twin_fingerprint() -> str:
    """A hash of the twin's sources and the evaluator: a changed twin is never read from a stale cache."""
    import hashlib

    h = hashlib.sha256()
    files = sorted((ROOT.parent / "kvpilot" / "twin").glob("*.py")) + [
        ROOT.parent / "kvpilot" / "tuner" / "adapters" / "offline.py",
        ROOT.parent / "kvpilot" / "tuner" / "core" / "capacity.py",
        ROOT.parent / "kvpilot" / "api" / "engine.py",
        ROOT.parent / "kvpilot" / "api" / "vllm.py",
    ]
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:10]


def _cache_path(sc: dict[str, Any], perturb_seed: int | None) -> Path:
    suffix = "nominal" if perturb_seed is None else f"perturbed{perturb_seed}"
    return CACHE / twin_fingerprint() / f"{sc['name']}.{suffix}.json"


def _evaluate_chunk(job: tuple[dict[str, Any], int | None, list[tuple[int, float, int]]]) -> dict[str, Any]:
    """Worker: capacities of a list of configs (neighbours, so each search hints the next)."""
    sc, perturb_seed, configs = job
    ev = TwinEvaluator(target_of(sc, perturb_seed), parse_workload(sc["workload"]), slo_of(sc), seed=0,
                       probe_s=PROBE_S, warmup_s=PROBE_S / 5)
    out: dict[str, Any] = {}
    for t, u, s in configs:
        p = EngineParams(t, u, s)
        res = ev.capacity(p)
        out[_key(p)] = {"failed": res.message, "memory": res.memory.as_dict() if res.memory else None} if isinstance(
            res, StartupFailed) else {
            "capacity": res.capacity, "ttft": res.at_capacity[0] if res.at_capacity else None,
            "itl": res.at_capacity[1] if res.at_capacity else None, "sims": res.simulations,
        }
    return {"scenario": sc["name"], "perturb": perturb_seed, "results": out, "sims": ev.simulations}


class Table:
    """Capacities of one scenario (and perturbation), backed by the disk cache."""

    def __init__(self, sc: dict[str, Any], perturb_seed: int | None) -> None:
        self.sc, self.perturb, self.path = sc, perturb_seed, _cache_path(sc, perturb_seed)
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}
        # The scenario (model, GPU, workload, SLO) is part of the key: an edited scenario file is
        # evaluated afresh.  A file from before this check (no scenario recorded) is adopted.
        if self.data.get(SCENARIO_KEY, sc) != sc:
            print(f"{self.path.name}: scenario changed since it was cached; evaluating afresh", file=sys.stderr)
            self.data = {}
        self.data[SCENARIO_KEY] = sc

    def missing(self, configs: list[EngineParams]) -> list[EngineParams]:
        return [p for p in configs if _key(p) not in self.data]

    def merge(self, results: dict[str, Any]) -> None:
        self.data.update(results)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=0, sort_keys=True))
        tmp.replace(self.path)

    def capacity(self, p: EngineParams) -> float:
        v = self.data[_key(p)]
        return 0.0 if "failed" in v else float(v["capacity"])

    def outcome(self, p: EngineParams) -> Outcome:
        v = self.data[_key(p)]
        if "failed" in v:  # the twin's numbers grade the failure
            memory = StartupMemory.from_dict(v["memory"]) if v["memory"] else None
            return infeasible(Goal.CAPACITY, "StartupFailed", v["failed"], memory=memory)
        m = Measurement(ttft_p99=v["ttft"] or float("inf"), itl_p99=v["itl"] or float("inf"),
                        request_rate=v["capacity"], capacity=v["capacity"])
        return score(Goal.CAPACITY, m, slo_of(self.sc))


def fill(tables: list[Table], extra: dict[str, list[EngineParams]], workers: int) -> None:
    """Evaluate every grid config (plus extras) missing from the tables, in parallel."""
    jobs = []
    for tb in tables:
        configs = list(GRID_SPACE.grid()) + extra.get(tb.sc["name"], [])
        todo = tb.missing(configs)
        # Chunks of neighbours (same token budget, then same cap): good capacity hints.
        todo.sort(key=lambda p: (p.max_num_batched_tokens, p.max_num_seqs, p.gpu_memory_utilization))
        size = max(4, len(todo) // 8 + 1)
        for i in range(0, len(todo), size):
            chunk = [(p.max_num_batched_tokens, p.gpu_memory_utilization, p.max_num_seqs) for p in todo[i:i + size]]
            jobs.append((tb.sc, tb.perturb, chunk))
    if not jobs:
        return
    by_name = {(tb.sc["name"], tb.perturb): tb for tb in tables}
    total = sum(len(j[2]) for j in jobs)
    done = 0
    t0 = time.time()
    print(f"evaluating {total} configs in {len(jobs)} chunks on {workers} workers ...", file=sys.stderr, flush=True)
    with mp.get_context("fork").Pool(workers) as pool:
        for res in pool.imap_unordered(_evaluate_chunk, jobs):
            by_name[(res["scenario"], res["perturb"])].merge(res["results"])
            done += len(res["results"])
            print(f"  {done}/{total} configs, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


GUIDANCE = Guidance()  # the tuner's; --without turns parts off to measure what each is worth


def tuned(table: Table, seed: int, sampler: str, trials: int, seeds: Sequence[EngineParams] = ()) -> TunerStudy:
    """A study on the grid, its trials read from the cached table."""
    return run_study(table.sc, GRID_SPACE, table.outcome, seed, sampler, trials, seeds)


def run_study(sc: dict[str, Any], space: SearchSpace, evaluate: Any, seed: int, sampler: str, trials: int,
              seeds: Sequence[EngineParams] = ()) -> TunerStudy:
    """The tuner ("tpe": vLLM's defaults first, or the warm-start `seeds`) or random search."""
    st = TunerStudy(storage=None, name=f"{sc['name']}-{sampler}-{seed}", goal=Goal.CAPACITY,
                    space=space, slo=slo_of(sc), seed=seed, n_trials=trials, sampler=sampler,
                    guidance=GUIDANCE if sampler == "tpe" else None)
    for p in seeds:
        st.enqueue(p, "warmStart")
    if sampler == "tpe" and not seeds:
        st.enqueue(target_of(sc, None).vllm_defaults(), "vllmDefaults")
    run_offline(st, evaluate, trials)
    return st


def best_capacity(st: TunerStudy, table: Table) -> float:
    best = st.best_trial()
    return 0.0 if best is None else table.capacity(st.engine_of(best))


def best_so_far(st: TunerStudy, capacity_of: Any) -> list[float]:
    """The best feasible capacity found after each trial (0.0 until one is found)."""
    best, out = 0.0, []
    for t in st.trials():
        if t.value is not None and all(c <= 0 for c in t.constraints.values()):
            best = max(best, capacity_of(t))
        out.append(best)
    return out


def regret_curve(st: TunerStudy, table: Table, opt: float) -> list[float]:
    """Regret of the best feasible config found after each trial (1.0 until one is found)."""
    return [1 - c / opt for c in best_so_far(st, lambda t: table.capacity(st.engine_of(t)))]


def trials_to(curve: list[float], regret: float) -> int | None:
    """The first trial (1-based) whose best-so-far is within `regret` of the optimum; None: never."""
    return next((i + 1 for i, r in enumerate(curve) if r <= regret), None)


# Capacities are found by bisection to 2% (core.capacity, rel_tol=0.02): two configs whose
# capacities differ by less than that are not told apart, so a regret difference below it is a tie.
TIE = 0.02
NEAR = 0.05  # "within 5% of the optimum": the issue's regret goal


def compare(tuner: float, random_: float, tie: float = TIE) -> str:
    """'below' / 'tie' / 'ABOVE' for a lower-is-better figure of the tuner against random search."""
    if abs(tuner - random_) < tie:
        return "tie"
    return "below" if tuner < random_ else "ABOVE"


def summarise(tpe: list[list[float]], rnd: list[list[float]]) -> dict[str, Any]:
    """Figures over the seeds for both samplers, from their regret curves."""
    def stats(curves: list[list[float]]) -> dict[str, Any]:
        hits = [trials_to(c, NEAR) for c in curves]
        return {
            "median20": statistics.median(c[TRIALS - 1] for c in curves),
            "mean20": statistics.mean(c[TRIALS - 1] for c in curves),
            "mean10": statistics.mean(c[9] for c in curves),
            "mean5": statistics.mean(c[4] for c in curves),
            "within5By10": sum(1 for h in hits if h is not None and h <= 10),
            # A seed that never gets within 5% counts as TRIALS + 1 (a floor on the truth).
            "trialsTo5": statistics.mean(h if h is not None else TRIALS + 1 for h in hits),
            "never5": sum(1 for h in hits if h is None),
            "curves": curves,
        }
    t, r = stats(tpe), stats(rnd)
    return {
        "tuner": t, "random": r,
        "vsRandom": {
            "median20": compare(t["median20"], r["median20"]),
            "mean5": compare(t["mean5"], r["mean5"]),
            "mean10": compare(t["mean10"], r["mean10"]),
            # Trials: a difference under half a trial on average is a tie.
            "trialsTo5": compare(t["trialsTo5"], r["trialsTo5"], tie=0.5),
        },
    }


def _twin_curves(job: tuple[dict[str, Any], str, list[int]]) -> dict[str, Any]:
    """Worker for --space default: one scenario, one sampler, every seed, on the twin itself.

    The product's default space (log-scale integers, the fraction by 0.01) has no grid to cache,
    so configs are evaluated on the nominal twin as the tuner draws them (cached in memory, shared
    by the seeds).  Returns each seed's best-so-far capacity after every trial."""
    sc, sampler, seed_list = job
    ev = TwinEvaluator(target_of(sc, None), parse_workload(sc["workload"]), slo_of(sc), seed=0)
    cache: dict[EngineParams, Outcome] = {}

    def evaluate(p: EngineParams) -> Outcome:
        if p not in cache:
            cache[p] = ev.evaluate(p)
        return cache[p]

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    curves = [best_so_far(run_study(sc, SearchSpace(), evaluate, seed, sampler, TRIALS), lambda t: float(t.value))
              for seed in seed_list]
    return {"scenario": sc["name"], "sampler": sampler, "curves": curves, "configs": len(cache)}


def default_space_report(nominal: list[Table], seeds: range, workers: int) -> None:
    """--space default: regret on the space `kvpilot tune` searches by default, against the best
    config known: the grid optimum, or a better one any study here found off the grid."""
    jobs = [(tb.sc, sampler, list(seeds)) for tb in nominal for sampler in ("tpe", "random")]
    t0 = time.time()
    print(f"default space: {len(jobs)} studies of {len(seeds)} seeds on the twin, {workers} workers ...",
          file=sys.stderr, flush=True)
    results: dict[tuple[str, str], list[list[float]]] = {}
    with mp.get_context("fork").Pool(workers) as pool:
        for res in pool.imap_unordered(_twin_curves, jobs):
            results[(res["scenario"], res["sampler"])] = res["curves"]
            print(f"  {res['scenario']} {res['sampler']}: {res['configs']} configs, {time.time() - t0:.0f}s",
                  file=sys.stderr, flush=True)
    print(f"twin {twin_fingerprint()}; default space {SearchSpace().as_spec()} (log-scale integers, fraction by "
          f"0.01); {len(seeds)} seeds x {TRIALS} trials; regret against the best config known (the grid "
          "optimum, or better found here by either sampler)")
    print(f"{'scenario':<20} {'grid opt':>8} {'best known':>10} | {'median @20':>15} {'mean @20':>15} "
          f"{'mean @10':>15}")
    print(f"{'':<20} {'req/s':>8} {'req/s':>10} | {'tuner/random':>15} {'tuner/random':>15} {'tuner/random':>15}")
    worst = 0.0
    for tb in nominal:
        grid_opt = max(tb.capacity(p) for p in GRID_SPACE.grid())
        opt = max([grid_opt] + [c[-1] for k in ("tpe", "random") for c in results[(tb.sc["name"], k)]])
        reg = {k: [[1 - c / opt for c in curve] for curve in results[(tb.sc["name"], k)]] for k in ("tpe", "random")}

        def med(k: str, i: int) -> float:
            return statistics.median(c[i] for c in reg[k])  # noqa: B023

        def mean(k: str, i: int) -> float:
            return statistics.mean(c[i] for c in reg[k])  # noqa: B023

        worst = max(worst, med("tpe", TRIALS - 1))
        print(f"{tb.sc['name']:<20} {grid_opt:>8.3f} {opt:>10.3f} | "
              f"{med('tpe', TRIALS - 1):>7.1%}/{med('random', TRIALS - 1):>7.1%} "
              f"{mean('tpe', TRIALS - 1):>7.1%}/{mean('random', TRIALS - 1):>7.1%} "
              f"{mean('tpe', 9):>7.1%}/{mean('random', 9):>7.1%}")
    print(f"\nworst tuner median regret @20 on the default space: {worst:.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", help="scenario names")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=len(SEEDS),
                    help="sampler seeds 0..N-1 per scenario (default 5, as the issue sets; the grid is "
                         "cached, so more seeds cost only sampler time, ~1 s per study)")
    ap.add_argument("--warm-seeds", type=int, default=1,
                    help="perturbed twins per scenario for the warm-start check (each costs a grid)")
    ap.add_argument("--no-warm-start", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the figures (with every regret curve) here")
    ap.add_argument("--space", choices=("grid", "default"), default="grid",
                    help="grid: the issue's (powers of two, fraction by 0.05; every trial a cached grid point); "
                         "default: the space `kvpilot tune` searches by default, evaluated on the twin as "
                         "drawn (slow: minutes per scenario; no warm-start check)")
    parts = [f.name for f in dataclasses.fields(Guidance)]
    ap.add_argument("--without", default="", metavar="PART[,PART]",
                    help=f"run the tuner without these parts of its guidance ({', '.join(parts)}; "
                         "'all' for plain TPE after the Latin hypercube start)")
    ap.add_argument("--smoke", action="store_true",
                    help="one scenario on a 2x2x2 grid, 10-s probes (cached apart), 1 seed, no warm start: the "
                         "tables in seconds (CI)")
    args = ap.parse_args(argv)
    global GUIDANCE, GRID_SPACE, PROBE_S, CACHE
    if args.smoke:
        GRID_SPACE = SearchSpace(max_num_batched_tokens=(512, 1024), gpu_memory_utilization=(0.90, 0.95),
                                 max_num_seqs=(128, 256), scale="pow2", util_step=0.05)
        PROBE_S, CACHE = 10.0, CACHE / "smoke"
        args.only, args.seeds, args.no_warm_start, args.json = ["llama8b-h100-chat"], 1, True, None
    off = parts if args.without == "all" else [p for p in args.without.split(",") if p]
    unknown = sorted(set(off) - set(parts))
    if unknown:
        ap.error(f"--without: unknown part(s) {', '.join(unknown)}; expected some of {', '.join(parts)} or 'all'")
    GUIDANCE = dataclasses.replace(Guidance(), **{p: False for p in off})
    logging.getLogger("optuna").setLevel(logging.WARNING)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    scenarios = load_scenarios(args.only)
    if not scenarios:
        print("no scenarios found", file=sys.stderr)
        return 2
    seeds = range(args.seeds)
    nominal = [Table(sc, None) for sc in scenarios]
    defaults = {sc["name"]: [target_of(sc, None).vllm_defaults()] for sc in scenarios}
    fill(nominal, defaults, args.workers)
    if args.space == "default":
        default_space_report(nominal, seeds, args.workers)
        return 0
    perturbed: list[Table] = []
    if not args.no_warm_start:
        perturbed = [Table(sc, s) for sc in scenarios for s in range(args.warm_seeds)]
        fill(perturbed, {}, args.workers)

    rows = []
    for tb in nominal:
        sc = tb.sc
        grid = list(GRID_SPACE.grid())
        opt_p = max(grid, key=tb.capacity)
        opt = tb.capacity(opt_p)
        default_p = defaults[sc["name"]][0]
        tpe_studies = {s: tuned(tb, s, "tpe", TRIALS) for s in seeds}
        rnd_studies = {s: tuned(tb, s, "random", TRIALS) for s in seeds}
        row: dict[str, Any] = {
            "scenario": sc["name"], "optimum": opt, "optimumConfig": _key(opt_p),
            "default": tb.capacity(default_p), "defaultConfig": _key(default_p),
            # How flat the landscape is: grid configs within 5% of the optimum (random search's odds).
            "gridNear": sum(1 for p in grid if tb.capacity(p) >= (1 - NEAR) * opt), "gridSize": len(grid),
            "gridInfeasible": sum(1 for p in grid if tb.capacity(p) <= 0),
            **summarise([regret_curve(tpe_studies[s], tb, opt) for s in seeds],
                        [regret_curve(rnd_studies[s], tb, opt) for s in seeds]),
        }
        warm = []
        for pt in (t for t in perturbed if t.sc["name"] == sc["name"]):
            popt = max(pt.capacity(p) for p in grid)
            for s in SEEDS:
                twin_study = tpe_studies[s] if s in tpe_studies else tuned(tb, s, "tpe", TRIALS)  # NOMINAL twin
                seeds_ = [p for p, _ in top_configs(twin_study, 3)]
                live = tuned(pt, s, "tpe", 5, seeds=seeds_)  # measured on the PERTURBED twin
                warm.append(1 - best_capacity(live, pt) / popt)
        if warm:
            row["warmStartRegret"] = statistics.median(warm)
            row["warmStartRegrets"] = warm
        rows.append(row)

    if off:
        print(f"tuner WITHOUT {', '.join(off)}")
    print(f"twin {twin_fingerprint()}; capacity = req/s with p99 TTFT and ITL within SLO; regret = 1 - found / "
          f"grid optimum; {args.seeds} seeds x {TRIALS} trials per sampler; @10 and @5 read from the same "
          "20-trial studies")
    hdr = (f"{'scenario':<20} {'grid optimum':>24} {'near':>7} {'vLLM def':>8} | {'median @20':>13} "
           f"{'mean @20':>13} {'mean @10':>13} {'mean @5':>13} {'in 5% by 10':>11} {'trials to 5%':>12} "
           f"| {'warm@5':>6}")
    print(hdr)
    print(f"{'':<20} {'req/s':>9} {'tok/util/seqs':>14} {'grid':>7} {'req/s':>8} | {'tuner/random':>13} "
          f"{'tuner/random':>13} {'tuner/random':>13} {'tuner/random':>13} {'seeds t/r':>11} {'mean t/r':>12} "
          f"| {'median':>6}")
    print("-" * len(hdr))
    for r in rows:
        t, q = r["tuner"], r["random"]
        ws = f"{r['warmStartRegret']:.1%}" if "warmStartRegret" in r else "-"
        near = f"{r['gridNear']}/{r['gridSize']}"
        print(f"{r['scenario']:<20} {r['optimum']:>9.3f} {r['optimumConfig']:>14} {near:>7} {r['default']:>8.3f} | "
              f"{t['median20']:>6.1%}/{q['median20']:>6.1%} {t['mean20']:>6.1%}/{q['mean20']:>6.1%} "
              f"{t['mean10']:>6.1%}/{q['mean10']:>6.1%} {t['mean5']:>6.1%}/{q['mean5']:>6.1%} "
              f"{t['within5By10']:>5}/{q['within5By10']:<5} {t['trialsTo5']:>5.1f}/{q['trialsTo5']:<6.1f} | {ws:>6}")
    print(f"\n'near': grid configs within 5% of the optimum (a random draw's odds of landing there); "
          f"'trials to 5%': a seed that never gets there counts {TRIALS + 1}.")
    print(f"tuner against random search (regret differences under {TIE:.0%}, the capacity search's tolerance, "
          "are ties; trials-to-5% differences under 0.5 are ties):")
    for r in rows:
        v = r["vsRandom"]
        print(f"  {r['scenario']:<20} median @20: {v['median20']:<5}  mean @5: {v['mean5']:<5}  "
              f"mean @10: {v['mean10']:<5}  trials to 5%: {v['trialsTo5']}")
    t_all = [c for r in rows for c in r["tuner"]["curves"]]
    r_all = [c for r in rows for c in r["random"]["curves"]]
    pooled = summarise(t_all, r_all)
    print(f"  {'all scenarios':<20} mean @10 {pooled['tuner']['mean10']:.1%} vs {pooled['random']['mean10']:.1%}, "
          f"mean @20 {pooled['tuner']['mean20']:.1%} vs {pooled['random']['mean20']:.1%}, "
          f"trials to 5% {pooled['tuner']['trialsTo5']:.1f} vs {pooled['random']['trialsTo5']:.1f}")
    within = all(r["tuner"]["median20"] <= NEAR for r in rows)
    below = [r["scenario"] for r in rows if r["vsRandom"]["median20"] == "below"]
    above = [r["scenario"] for r in rows if r["vsRandom"]["median20"] == "ABOVE"]
    print(f"\ngoal tuner median regret <= 5% on every scenario: {'met' if within else 'NOT met'}")
    # Issue 13, item 4: the cold start at or below random search in mean regret at 5 and at 10
    # trials on every scenario (a tie under the capacity search's tolerance counts).
    early = [f"{r['scenario']} @{k[4:]}" for r in rows for k in ("mean5", "mean10") if r["vsRandom"][k] == "ABOVE"]
    print(f"goal tuner mean regret @5 and @10 at or below random search on every scenario: "
          f"{'met' if not early else 'NOT met (above: ' + ', '.join(early) + ')'}")
    print(f"goal tuner median regret below random search on every scenario: "
          f"{'met' if len(below) == len(rows) else 'NOT met'} (below on {len(below)} of {len(rows)}"
          f"{', above on ' + ', '.join(above) if above else ''}; the rest tie)")
    # Where random search's median is 0 too (a flat landscape: 20 random draws land within 5% with
    # odds of 1 - (1 - near/grid)^20), no sampler can be below it on the median; the mean over the
    # seeds still tells the two apart.
    m_below = [r["scenario"] for r in rows if compare(r["tuner"]["mean20"], r["random"]["mean20"]) == "below"]
    m_above = [r["scenario"] for r in rows if compare(r["tuner"]["mean20"], r["random"]["mean20"]) == "ABOVE"]
    print(f"     and on the mean regret @20: {'never above' if not m_above else 'above on ' + ', '.join(m_above)} "
          f"(below on {len(m_below)} of {len(rows)}, the rest tie)")
    if perturbed:
        ok_warm = all(r.get("warmStartRegret", 0.0) <= 0.10 for r in rows)
        print(f"goal warm start regret <= 10% after 5 trials: {'met' if ok_warm else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "pooled": {k: v for k, v in pooled.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
