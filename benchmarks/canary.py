"""Canary trials against rolling trials, on the twin under drifting load.

    python benchmarks/canary.py            # prints the table (about 2-4 minutes on one core, first run;
                                           # the twin calibration is cached in out/canary-cache/)
    python benchmarks/canary.py --smoke    # the same table in seconds (CI)

What runs, honestly:
- The trial LOOP is kvpilot's own (`kvpilot.tuner.core.loop.LiveTuner`, Optuna study and all), once
  with trialStrategy rolling (whole fleet rolls, 25% drift rule re-measures the incumbent) and once
  with canary (paired tracks, the sequential test, promotion), on a virtual clock.
- The WORLD the loop drives is a simulated two-track service whose latencies are an analytic
  model CALIBRATED FROM THE TWIN, not the twin served request by request: for every config of the
  search space (maxNumBatchedTokens 256..16384 powers of two x gpuMemoryUtilization 0.85/0.90/0.95
  x maxNumSeqs 64..512 powers of two) the twin's offline engine (`kvpilot.twin.offline.drive`, via
  `adapters.offline.TwinEvaluator.run`: Llama-3.1-8B on an H100-80GB, the `chat` workload, 40 s of
  arrivals after 8 s of warm-up) gives p99 TTFT and p99 ITL at 4, 8, ..., 24 req/s; between those
  rates each p99 is interpolated linearly in log space.  A config the twin cannot start is a
  failed start (ApplyFailed).
- Measurement noise, which is what separates the strategies, is modelled, not simulated:
  * a common-mode shock shared by every engine serving at the same time (the workload mix of the
    minute: longer prompts slow every engine alike), lognormal with sigma 0.10, a new draw per
    60 s, and the drift of the load itself;
  * sampling noise of a p99 read from n requests, lognormal with sigma 2/sqrt(n) (the standard
    error of an exponential tail's 99th percentile), n = the track's share of the requests in
    the window.
  A rolling trial compares its window with the incumbent's, measured at another time (another
  shock, another load); a canary trial compares two tracks in the same interval (the shock
  cancels).  Burn rate = 0.5 x score under the SLO, rising 30x per unit of score above it.
- Load: a ramp (6 -> 22 req/s over 6 h, then flat) and a diurnal curve (14 - 8 cos(2 pi t / 6 h)).
  Rollouts and canary start-ups take 60 s (the old engine serves meanwhile).  Settings as a
  cluster would run them: warm-up 120 s, window 600 s, poll 15 s, 20 trials, canary weight 0.25.

Figures, per strategy and load (over 10 study seeds, seeds fixed):
- wrong promotions: an engine promoted (made the incumbent; for canary, rolled onto the stable
  track) whose true score at that moment's load is more than 2% worse than the engine it replaced;
- trials to 5%: the trials a study took until its incumbent's true score, averaged over the 6 h
  load curve, was within 5% of the best config's on the grid (">20" counts as 21 in the mean);
- exposed: the share of all requests, over the study, served by an engine whose true score at
  that moment is more than 2% worse than the incumbent's;
- hours: virtual time the study took.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import optuna  # noqa: E402

from harness.tuning_world import World  # noqa: E402
from kvpilot.api.vocabulary import Track, TrialStrategy  # noqa: E402
from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget  # noqa: E402
from kvpilot.tuner.core.loop import ApplyFailed, LiveSettings, LiveTuner, Observer, TrialEvent  # noqa: E402
from kvpilot.tuner.core.objective import SLO, Goal, Measurement  # noqa: E402
from kvpilot.tuner.core.space import EngineParams, SearchSpace  # noqa: E402
from kvpilot.tuner.core.study import Incumbent, TunerStudy  # noqa: E402
from kvpilot.twin.workload import Workload  # noqa: E402

CACHE = ROOT.parent / "out" / "canary-cache"
TARGET = TwinTarget()  # Llama-3.1-8B on H100-80GB
WORKLOAD = "chat"
SLO_ = SLO(ttft_seconds=0.5, itl_seconds=0.1)
SPACE = SearchSpace(max_num_batched_tokens=(256, 16384), gpu_memory_utilization=(0.85, 0.95),
                    max_num_seqs=(64, 512), scale="pow2", util_step=0.05)
TOKENS = [2 ** k for k in range(8, 15)]
UTILS = [0.85, 0.90, 0.95]
SEQS = [64, 128, 256, 512]
RATES = [4.0, 8.0, 12.0, 16.0, 20.0, 24.0]
START = EngineParams(512, 0.90, 64)
HORIZON_S = 6 * 3600.0
SHOCK_SIGMA, SHOCK_EVERY_S = 0.10, 60.0
ROLLOUT_S = 60.0
WORSE = 1.02  # "worse" means more than 2% worse in true score
TRIALS = 20
SEEDS = range(10)
SETTINGS = LiveSettings(warmup_s=120, window_s=600, poll_s=15, fast_burn_window_s=300, pause_poll_s=15,
                        max_trials=TRIALS)
WEIGHT = 0.25

LOADS: dict[str, Callable[[float], float]] = {
    "ramp": lambda t: 6.0 + 16.0 * min(t / HORIZON_S, 1.0),
    "diurnal": lambda t: 14.0 - 8.0 * math.cos(2 * math.pi * t / HORIZON_S),
}


# -- calibration: the twin's p99s per config and rate ---------------------------------------------
Table = dict[EngineParams, list[tuple[float, float]] | None]


def _fingerprint() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT.parent / "kvpilot" / "twin").glob("*.py")):
        h.update(path.read_bytes())
    h.update(json.dumps([TARGET.model, TARGET.gpu, WORKLOAD, RATES, TOKENS, UTILS, SEQS]).encode())
    return h.hexdigest()[:16]


def calibrate(probe_s: float = 40.0) -> Table:
    """The twin's p99s per config and rate, cached (40-s probes only: --smoke's shorter ones are not kept)."""
    path = CACHE / f"{_fingerprint()}.json"
    keep = probe_s == 40.0
    if keep and path.exists():
        raw = json.loads(path.read_text())
        return {EngineParams.from_spec(json.loads(k)): (None if v is None else [tuple(x) for x in v])
                for k, v in raw.items()}
    from kvpilot.twin.memory import EngineStartupError

    loose = SLO(ttft_seconds=1e6, itl_seconds=1e6)  # never stop a run early: the p99 itself is wanted
    ev = TwinEvaluator(TARGET, Workload.parse(WORKLOAD), loose, seed=0, probe_s=probe_s, warmup_s=probe_s / 5,
                       paths=1)
    table: Table = {}
    configs = [EngineParams(t, u, s) for t, u, s in itertools.product(TOKENS, UTILS, SEQS)]
    t0 = time.monotonic()
    for i, p in enumerate(configs):
        try:
            table[p] = [(ev.run(p, r).ttft_p99, ev.run(p, r).itl_p99) for r in RATES]
        except (EngineStartupError, ValueError):
            table[p] = None
        print(f"\rcalibrating on the twin: {i + 1}/{len(configs)} configs, {time.monotonic() - t0:.0f}s",
              end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    if not keep:
        return table
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({json.dumps(p.as_spec(), sort_keys=True): v for p, v in table.items()}))
    return table


def _interp(points: list[float], rate: float) -> float:
    """Log-linear in the rate between the calibrated rates, the end segments extended."""
    logs = [math.log(max(v, 1e-6)) for v in points]
    if rate <= RATES[0]:
        i = 0
    elif rate >= RATES[-1]:
        i = len(RATES) - 2
    else:
        i = max(k for k in range(len(RATES) - 1) if RATES[k] <= rate)
    x0, x1 = RATES[i], RATES[i + 1]
    y = logs[i] + (logs[i + 1] - logs[i]) * (rate - x0) / (x1 - x0)
    return math.exp(min(y, math.log(1e4)))


class Model:
    def __init__(self, table: Table) -> None:
        self.table = table

    def p99s(self, p: EngineParams, rate: float) -> tuple[float, float]:
        rows = self.table[p]
        assert rows is not None
        return _interp([r[0] for r in rows], rate), _interp([r[1] for r in rows], rate)

    def score(self, p: EngineParams, rate: float) -> float:
        ttft, itl = self.p99s(p, rate)
        return max(ttft / SLO_.ttft_seconds, itl / SLO_.itl_seconds)

    def mean_score(self, p: EngineParams, load: Callable[[float], float]) -> float:
        return statistics.fmean(self.score(p, load(t)) for t in range(0, int(HORIZON_S), 60))


def burn_of(score: float) -> float:
    return 0.5 * score if score <= 1.0 else 0.5 + 30.0 * (score - 1.0)


# -- the simulated two-track service ---------------------------------------------------------------
class SimService(World):
    """The shared fake tuning world's two tracks, virtual clock and rollouts (harness.tuning_world), with
    the calibrated model's signals: Applier, CanaryApplier and TrackSignals."""

    def __init__(self, model: Model, load: Callable[[float], float], seed: int) -> None:
        self.model = model
        self._shocks: dict[int, float] = {}
        self.shock_rng = random.Random(seed * 7919 + 1)
        self.incumbent: Callable[[], EngineParams] = lambda: START
        self.total = self.exposed = 0.0
        super().__init__(engine=START, load=load, canary_weight=WEIGHT, canary_startup_s=ROLLOUT_S,
                         rollout_s=ROLLOUT_S, seed=seed)
        self.rng = random.Random(seed)

    # -- requests and who served them
    def _serve(self, t: float) -> None:
        t0, self._last = self._last, t
        step = 30.0
        while t0 < t - 1e-9:
            dt = min(step, t - t0)
            rate = self.load(t0 + dt / 2)
            n = rate * dt
            ref = self.model.score(self.incumbent(), rate)
            share = WEIGHT if self.canary is not None else 0.0
            for eng, f in ((self.engine, 1 - share), (self.canary, share)):
                if eng is None or f == 0:
                    continue
                if self.model.score(eng, rate) > WORSE * ref:
                    self.exposed += n * f
            self.total += n
            t0 += dt

    def shock(self, t: float) -> float:
        k = int(t // SHOCK_EVERY_S)
        if k not in self._shocks:
            self._shocks[k] = self.shock_rng.gauss(0.0, SHOCK_SIGMA)
        return self._shocks[k]

    # -- Applier / CanaryApplier: the world's, but an engine already in force is no rollout
    def _refuse(self, params: EngineParams) -> None:
        if self.model.table.get(params) is None:
            raise ApplyFailed("StartupFailed", f"the twin cannot start {params.label()}")

    def apply(self, params: EngineParams, trial: int | None) -> None:
        if params == self.engine:
            return
        super().apply(params, trial)

    # -- signals
    def _window(self, p: EngineParams, window_s: float, share: float) -> Measurement:
        t1 = self.clock.t
        points = [t1 - window_s * (k + 0.5) / 6 for k in range(6)]
        rates = [self.load(max(t, 0.0)) for t in points]
        shock = statistics.fmean(self.shock(max(t, 0.0)) for t in points)
        n = max(statistics.fmean(rates) * window_s * share, 1.0)
        noise = 2.0 / math.sqrt(n)
        ttfts, itls = zip(*(self.model.p99s(p, r) for r in rates), strict=True)
        ttft = max(ttfts) * math.exp(shock + self.rng.gauss(0.0, noise))
        itl = max(itls) * math.exp(shock + self.rng.gauss(0.0, noise))
        score = max(ttft / SLO_.ttft_seconds, itl / SLO_.itl_seconds)
        # The rate of the requests this share saw, as Prometheus reads a track's (the loop puts a track
        # back in the service's terms).
        return Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=statistics.fmean(rates) * share,
                           burn_rate=burn_of(score))

    def burn_rate(self, window_s: float, track: Track | None = None) -> float:
        share = WEIGHT if self.canary is not None else 0.0
        if track is Track.CANARY:
            assert self.canary is not None
            return self._window(self.canary, min(window_s, 60.0), share).burn_rate or 0.0
        eng = self.engine
        return self._window(eng, min(window_s, 60.0), 1 - share if track is Track.STABLE else 1.0).burn_rate or 0.0

    def measure(self, window_s: float) -> Measurement:
        return self._window(self.engine, window_s, 1.0)

    def measure_tracks(self, window_s: float) -> tuple[Measurement, Measurement]:
        assert self.canary is not None
        # One draw of the shock for both tracks (same interval), independent sampling noise.
        return self._window(self.engine, window_s, 1 - WEIGHT), self._window(self.canary, window_s, WEIGHT)


class Judge(Observer):
    """Scores promotions and time-to-good against the model's truth."""

    def __init__(self, svc: SimService, model: Model, load: Callable[[float], float], best_mean: float) -> None:
        self.svc, self.model, self.load, self.best_mean = svc, model, load, best_mean
        self.best = START
        self.prev = START
        self.wrong = 0
        self.promotions = 0
        self.reached: int | None = None
        self.tuner: LiveTuner | None = None

    def best_changed(self, incumbent: Incumbent) -> None:
        if incumbent.params != self.best:
            self.prev, self.best = self.best, incumbent.params

    def trial_event(self, number: int, strategy: TrialStrategy, event: TrialEvent) -> None:
        if event is not TrialEvent.PROMOTED:
            return
        self.promotions += 1
        rate = self.load(self.svc.clock.t)
        if self.model.score(self.best, rate) > WORSE * self.model.score(self.prev, rate):
            self.wrong += 1

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: object) -> None:
        if self.reached is None and self.tuner is not None:
            good = self.model.mean_score(self.tuner.fallback(), self.load) <= 1.05 * self.best_mean
            if good:
                self.reached = self.tuner.study.finished_count()


def run_one(model: Model, load_name: str, strategy: TrialStrategy, seed: int, best_mean: float) -> dict[str, float]:
    load = LOADS[load_name]
    svc = SimService(model, load, seed)
    study = TunerStudy(storage=None, name=f"{load_name}-{strategy.value}-{seed}", goal=Goal.LATENCY, space=SPACE,
                       slo=SLO_, seed=seed, n_trials=TRIALS)
    study.enqueue(START, "current")
    judge = Judge(svc, model, load, best_mean)
    settings = LiveSettings(**{**SETTINGS.__dict__, "strategy": strategy})
    tuner = LiveTuner(study, svc, svc, settings, clock=svc.clock, observer=judge)
    judge.tuner = tuner
    svc.incumbent = tuner.fallback
    tuner.run()
    return {
        "wrong": judge.wrong, "promotions": judge.promotions,
        "reached": float(judge.reached if judge.reached is not None else TRIALS + 1),
        "never": float(judge.reached is None),
        "exposed": svc.exposed / svc.total, "hours": svc.clock.t / 3600.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true",
                    help="the twin calibrated on 5-s probes (not cached), one study seed: the table in seconds (CI)")
    args = ap.parse_args(argv)
    seeds = range(1) if args.smoke else SEEDS
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    logging.disable(logging.WARNING)
    t0 = time.monotonic()
    model = Model(calibrate(5.0 if args.smoke else 40.0))
    usable = [p for p, rows in model.table.items() if rows is not None]
    print(f"twin calibration: {TARGET.model} on {TARGET.gpu}, {WORKLOAD}; {len(usable)}/{len(model.table)} configs "
          f"start; SLO p99 TTFT {SLO_.ttft_seconds:g} s, ITL {SLO_.itl_seconds:g} s; start {START.label()}")
    header = (f"{'load':8} {'strategy':8} {'wrong promotions':>17} {'promotions':>11} {'trials to 5%':>13} "
              f"{'never':>6} {'exposed':>8} {'hours':>6}")
    print(header)
    print("-" * len(header))
    for load_name, load in LOADS.items():
        scores = {p: model.mean_score(p, load) for p in usable}
        best = min(scores, key=lambda p: scores[p])
        for strategy in (TrialStrategy.ROLLING, TrialStrategy.CANARY):
            runs = [run_one(model, load_name, strategy, seed, scores[best]) for seed in seeds]
            print(f"{load_name:8} {strategy.value:8} {sum(r['wrong'] for r in runs):>17.0f} "
                  f"{sum(r['promotions'] for r in runs):>11.0f} "
                  f"{statistics.fmean(r['reached'] for r in runs):>13.1f} "
                  f"{sum(r['never'] for r in runs):>6.0f} "
                  f"{statistics.fmean(r['exposed'] for r in runs):>8.1%} "
                  f"{statistics.fmean(r['hours'] for r in runs):>6.1f}")
        print(f"{'':8} best on the grid: {best.label()} (mean score {scores[best]:.3f}; start "
              f"{scores[START]:.3f})")
    print(f"wrong promotions and promotions: totals over {len(seeds)} seeds; trials to 5%, exposed, hours: means "
          f"(a study that never got within 5% counts {TRIALS + 1}); {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
