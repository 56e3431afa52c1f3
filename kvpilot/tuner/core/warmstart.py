"""Warm start: search the twin first, then try its best few configs live before anything else.

The live workload is estimated from Prometheus (request rate; prompt and output length
distributions from vLLM's per-request token histograms), the twin is searched for capacity
under it, and the best `k` distinct configs are enqueued as the first live trials.  The twin is
a model, so its answers are only a head start: the live trials measure them for real, and
Optuna carries on from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.tuner.core.objective import SLO, Goal
from kvpilot.tuner.core.search import Evaluate, run_offline, top_configs
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import TunerStudy

Z90 = 1.2815515655446004  # the standard normal's 0.9 quantile


@dataclass(frozen=True)
class WorkloadEstimate:
    request_rate: float  # req/s
    prompt_median: float
    prompt_sigma: float  # lognormal sigma
    output_median: float
    output_sigma: float


def lognormal_from_quantiles(p50: float, p90: float) -> tuple[float, float]:
    """(median, sigma) of the lognormal with these two quantiles (sigma >= 0.05)."""
    median = max(p50, 1.0)
    sigma = math.log(max(p90, median) / median) / Z90
    return median, max(sigma, 0.05)


def lognormal_from_mean(mean: float, sigma: float = 0.5) -> tuple[float, float]:
    """(median, sigma) of a lognormal with this mean, when only a mean is known."""
    return max(mean / math.exp(sigma * sigma / 2), 1.0), sigma


def twin_best(space: SearchSpace, slo: SLO, evaluate: Evaluate, *, trials: int = 20, k: int = 3,
              seed: int = 0, first: list[EngineParams] | None = None) -> list[tuple[EngineParams, float]]:
    """A capacity search on the twin (in memory); its best k distinct configs and their capacity."""
    st = TunerStudy(storage=None, name="warm-start", goal=Goal.CAPACITY, space=space, slo=slo, seed=seed,
                    n_trials=trials)
    for p in first or []:
        st.enqueue(p, "current")
    run_offline(st, evaluate, trials)
    return top_configs(st, k)


def enqueue_warm_start(study: TunerStudy, configs: list[tuple[EngineParams, float]]) -> int:
    """Queue the twin's picks as the next live trials; returns how many were new."""
    return sum(1 for p, _ in configs if study.enqueue(p, "warmStart"))
