"""Does the capacity `kvpilot tune --offline` reports hold?  Checked a second, independent way.

    python benchmarks/capacity_holds.py                       # the README's main job
    python benchmarks/capacity_holds.py --smoke               # the same path in seconds (CI)
    python benchmarks/capacity_holds.py --model Qwen2.5-7B --gpu A100-80GB --workload rag --slo ttft=1.0,itl=0.1

1. Runs the offline study as `kvpilot tune --offline` does (the same code, the same defaults, a
   throwaway SQLite study) and takes its recommended config, its reported capacity, and the
   capacity it reports for vLLM's defaults on that GPU.
2. For each of the two, serves `--check-seconds` (300) of arrivals with `kvpilot twin run`'s own
   path (`kvpilot.twin.offline.simulate`: every request from an empty engine counted, other seeds
   than the study's) at 95% and at 120% of the reported capacity, and prints p99 TTFT and ITL.

A capacity a user can plan with meets the SLO at 95% (on every seed) and misses it at 120%.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpilot.api.slo import SLO  # noqa: E402
from kvpilot.tuner.adapters.offline import PROBE_SECONDS, TwinEvaluator, TwinTarget, parse_workload  # noqa: E402
from kvpilot.tuner.core.objective import Goal  # noqa: E402
from kvpilot.tuner.core.search import run_offline  # noqa: E402
from kvpilot.tuner.core.space import EngineParams, SearchSpace  # noqa: E402
from kvpilot.tuner.core.study import TunerStudy  # noqa: E402
from kvpilot.twin.offline import simulate  # noqa: E402


def check(target: TwinTarget, params: EngineParams, rate: float, workload: str, slo: SLO, seconds: float,
          seed: int) -> tuple[float, float, bool]:
    report = simulate(target.engine_config(params), parse_workload(workload).with_rate(rate), duration_s=seconds,
                      seed=seed, slo=slo)
    ttft, itl = report.ttft_p99, report.itl_p99
    met = report.num_unfinished == 0 and ttft <= slo.ttft_seconds and itl <= slo.itl_seconds
    return ttft, itl, met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--gpu", default="H100-80GB")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--slo", default="ttft=0.5,itl=0.05")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--probe-seconds", type=float, default=PROBE_SECONDS)
    ap.add_argument("--check-seconds", type=float, default=300.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[101, 202])
    ap.add_argument("--smoke", action="store_true",
                    help="4 trials, 20-s probes, 30-s checks on one seed: the same path in seconds (CI); "
                         "too small to judge the capacity, so the verdict is printed but not the exit status")
    args = ap.parse_args()
    if args.smoke:
        args.trials, args.probe_seconds, args.check_seconds, args.seeds = 4, 20.0, 30.0, [101]

    slo = SLO.parse(args.slo)
    target = TwinTarget(model=args.model, gpu=args.gpu, max_model_len=args.max_model_len)
    ev = TwinEvaluator(target, parse_workload(args.workload), slo, seed=0, probe_s=args.probe_seconds,
                       warmup_s=args.probe_seconds / 5)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        st = TunerStudy(storage=f"sqlite:///{tmp}/s.db", name="capacity-holds", goal=Goal.CAPACITY,
                        space=SearchSpace(), slo=slo, seed=0, n_trials=args.trials)
        defaults = target.vllm_defaults()
        st.enqueue(defaults, "vllmDefaults")
        run_offline(st, ev.evaluate, args.trials)
        best = st.best_engine()
    wall = time.perf_counter() - t0
    if best is None:
        print("no config met the SLO", file=sys.stderr)
        return 1
    rows = [("recommended", best[0], best[1]), ("vLLM defaults", defaults, ev.evaluate(defaults).value)]
    print(f"{args.model} on {args.gpu}, workload {args.workload}, SLO p99 TTFT <= {slo.ttft_seconds:g} s, "
          f"ITL <= {slo.itl_seconds:g} s; study of {args.trials} trials in {wall:.0f} s "
          f"({ev.simulations} probes of {args.probe_seconds:g} s)")
    ok = True
    for what, params, capacity in rows:
        print(f"\n{what}: {params.label()}: reported capacity {capacity:.2f} req/s")
        for share, want in ((0.95, True), (1.20, False)):
            for seed in args.seeds:
                ttft, itl, met = check(target, params, share * capacity, args.workload, slo, args.check_seconds, seed)
                verdict = "meets" if met else "misses"
                good = met == want
                ok &= good
                print(f"  {share:>4.0%} = {share * capacity:6.2f} req/s, {args.check_seconds:g} s, seed {seed}: "
                      f"p99 TTFT {ttft:7.3f} s, ITL {itl:6.4f} s: {verdict} the SLO  {'ok' if good else 'WRONG'}")
    print(f"\ncapacity holds (meets at 95%, misses at 120%, every seed): {'yes' if ok else 'NO'}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
