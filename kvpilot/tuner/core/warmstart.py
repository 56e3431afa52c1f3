"""Warm start: search the twin first, then try its best few configs live before anything else.

The live workload is estimated from Prometheus (request rate; prompt and output length
distributions from vLLM's per-request token histograms), the twin is searched under it for the
live study's goal (latency at the measured rate; for a service that autoscales, the GPUs its
replicas need for the measured rate: `twin_goal`), and the best `k` distinct configs are enqueued
as the first live trials.  The twin is
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


def twin_best(space: SearchSpace, slo: SLO, evaluate: Evaluate, *, goal: Goal = Goal.CAPACITY, trials: int = 20,
              k: int = 3, seed: int = 0, first: list[EngineParams] | None = None) -> list[tuple[EngineParams, float]]:
    """A search on the twin (in memory) under `goal`; its best k distinct configs and their values.

    A live study scores latency at the load it serves, so its warm start searches the twin for
    that (`evaluate` the twin's latency at the measured rate), not for capacity: the configs that
    sustain the highest rate are not the ones with the lowest p99s at a lighter one (on real vLLM
    the capacity ranking's best three were 14-18% behind the best of a measured grid at its load).  Under the
    latency goal, configs the twin sees missing the SLO still fill the k (nearest miss first)."""
    st = TunerStudy(storage=None, name="warm-start", goal=goal, space=space, slo=slo, seed=seed, n_trials=trials)
    for p in first or []:
        st.enqueue(p, "current")
    run_offline(st, evaluate, trials)
    return top_configs(st, k, fill=goal is Goal.LATENCY)


def twin_goal(goal: Goal, autoscaling: bool) -> Goal:
    """The goal the twin is searched for.  A service that autoscales pays for GPUs: its fleet grows
    to carry whatever load comes, so the config worth trying first is the one whose replicas carry
    the measured load (the service's whole rate, at its token mix) on the fewest GPUs -- not the one
    with the lowest p99s with that whole rate on one twin engine, nor the one of most capacity at
    one mix in the abstract (the gpus goal weighs capacity at this load's mix).  Otherwise the
    spec's goal."""
    return Goal.GPUS if autoscaling else goal


def enqueue_warm_start(study: TunerStudy, configs: list[tuple[EngineParams, float]]) -> int:
    """Queue the twin's picks as the next live trials; returns how many were new."""
    return sum(1 for p, _ in configs if study.enqueue(p, "warmStart"))
