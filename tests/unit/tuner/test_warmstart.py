"""Warm start: lognormal fits of the live workload, and the twin's best configs queued first."""

from __future__ import annotations

import math

import pytest

from kvpilot.fleet.regime import gpus_needed
from kvpilot.tuner.core.objective import LATENCY_PENALTY, SLO, Goal, Measurement, Outcome, infeasible, score
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import TunerStudy
from kvpilot.tuner.core.warmstart import (
    enqueue_warm_start,
    lognormal_from_mean,
    lognormal_from_quantiles,
    twin_best,
    twin_goal,
)


def test_lognormal_from_quantiles_round_trips() -> None:
    median, sigma = 800.0, 0.7
    p90 = median * math.exp(1.2815515655446004 * sigma)
    assert lognormal_from_quantiles(median, p90) == pytest.approx((median, sigma))


def test_lognormal_from_mean_keeps_the_mean() -> None:
    median, sigma = lognormal_from_mean(1000.0, 0.5)
    assert median * math.exp(sigma**2 / 2) == pytest.approx(1000.0)


def _twin(p: EngineParams) -> Outcome:
    """A fake twin whose capacity peaks at 2048 tokens, 64 seqs, the highest fraction."""
    cap = 20.0 - abs(math.log2(p.max_num_batched_tokens / 2048)) * 3 - abs(math.log2(p.max_num_seqs / 64)) * 2
    cap += (p.gpu_memory_utilization - 0.7) * 10
    return score(Goal.CAPACITY, Measurement(0.1, 0.01, cap, capacity=max(cap, 0.0)), SLO())


def test_the_twins_best_are_the_first_live_trials() -> None:
    space = SearchSpace()
    picks = twin_best(space, SLO(), _twin, trials=25, k=3, seed=0)
    assert len(picks) == 3 and len({p for p, _ in picks}) == 3
    assert picks[0][1] >= picks[1][1] >= picks[2][1]
    assert picks[0][1] >= 18.0  # close to the fake twin's 22.5 peak after 25 trials

    live = TunerStudy(storage=None, name="live", goal=Goal.LATENCY, space=space, slo=SLO(), seed=0)
    live.enqueue(EngineParams(8192, 0.92, 1024), "current")
    assert enqueue_warm_start(live, picks) == 3
    asked = [live.ask() for _ in range(4)]
    assert [p for _, p in asked[1:]] == [p for p, _ in picks]
    assert [live.study.trials[n].user_attrs["source"] for n, _ in asked] == ["current"] + ["warmStart"] * 3


def _latency_twin(p: EngineParams) -> Outcome:
    """A fake twin's p99s at the live load: TTFT lowest (0.2 s) at 512 tokens, 16 seqs."""
    ttft = 0.2 + abs(math.log2(p.max_num_batched_tokens / 512)) * 0.1 + abs(math.log2(p.max_num_seqs / 16)) * 0.05
    return score(Goal.LATENCY, Measurement(ttft, 0.01, 5.0), SLO(ttft_seconds=1.0, itl_seconds=0.05))


def test_a_latency_warm_start_picks_the_lowest_scores() -> None:
    space = SearchSpace(max_num_batched_tokens=(128, 4096), max_num_seqs=(4, 64), scale="pow2")
    picks = twin_best(space, SLO(ttft_seconds=1.0), _latency_twin, goal=Goal.LATENCY, trials=30, k=3, seed=0)
    assert len(picks) == 3 and len({p for p, _ in picks}) == 3
    assert picks[0][1] <= picks[1][1] <= picks[2][1] <= 0.35  # the best is 0.2 (512 tokens, 16 seqs)


def test_when_no_config_meets_the_slo_the_nearest_misses_are_picked_not_none() -> None:
    def over(p: EngineParams) -> Outcome:
        o = _latency_twin(p)
        m = o.measurement
        assert m is not None
        return score(Goal.LATENCY, Measurement(m.ttft_p99 + 1.0, m.itl_p99, m.request_rate), SLO(ttft_seconds=1.0))

    space = SearchSpace(max_num_batched_tokens=(128, 4096), max_num_seqs=(4, 64), scale="pow2")
    picks = twin_best(space, SLO(ttft_seconds=1.0), over, goal=Goal.LATENCY, trials=30, k=3, seed=0)
    assert len(picks) == 3 and 1.0 < picks[0][1] <= picks[1][1] <= picks[2][1] <= 1.35


def test_configs_that_could_not_run_never_fill_a_warm_start() -> None:
    def fails_mostly(p: EngineParams) -> Outcome:
        if p.max_num_seqs != 16:
            return infeasible(Goal.LATENCY, "StartupFailed", "no room")
        return _latency_twin(p)

    space = SearchSpace(max_num_batched_tokens=(512, 1024), max_num_seqs=(8, 32), scale="pow2")
    picks = twin_best(space, SLO(ttft_seconds=1.0), fails_mostly, goal=Goal.LATENCY, trials=12, k=3, seed=0)
    assert {p.max_num_seqs for p, _ in picks} == {16}
    assert all(v < LATENCY_PENALTY for _, v in picks)


def test_a_service_that_autoscales_warm_starts_with_the_configs_needing_fewest_gpus() -> None:
    assert twin_goal(Goal.LATENCY, autoscaling=True) is Goal.GPUS
    assert twin_goal(Goal.CAPACITY, autoscaling=True) is Goal.GPUS
    assert twin_goal(Goal.LATENCY, autoscaling=False) is Goal.LATENCY
    assert twin_goal(Goal.CAPACITY, autoscaling=False) is Goal.CAPACITY

    def gpus_twin(p: EngineParams) -> Outcome:
        """The fake capacity twin's configs, told as GPUs for 40 req/s."""
        cap = _twin(p).value
        return score(Goal.GPUS, Measurement(0.1, 0.01, 40.0, capacity=cap, gpus=gpus_needed(40.0, cap)), SLO())

    picks = twin_best(SearchSpace(), SLO(), gpus_twin, goal=twin_goal(Goal.LATENCY, autoscaling=True), trials=25,
                      k=3, seed=0)
    assert picks[0][1] <= picks[1][1] <= picks[2][1]  # fewest GPUs first
    assert picks[0][1] <= gpus_needed(40.0, 18.0)  # near the fake twin's most capacity (22.5 req/s)
