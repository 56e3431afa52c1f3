"""The capacity the offline tuner reports is a steady-state figure: a rate the engine sustains,
checked against the twin's own `twin run` path (other request sequences, every request counted)
and against the engine's saturation throughput."""

from __future__ import annotations

import numpy as np
import pytest

from kvpilot.api.slo import SLO
from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget, parse_workload
from kvpilot.tuner.core.space import EngineParams
from kvpilot.twin.offline import simulate

TARGET = TwinTarget(model="Qwen2.5-0.5B", gpu="L4", max_model_len=4096)
WORKLOAD = "chat"
SLO_ = SLO(0.5, 0.05)
PARAMS = EngineParams(512, 0.9, 128)


@pytest.fixture(scope="module")
def capacity() -> float:
    ev = TwinEvaluator(TARGET, parse_workload(WORKLOAD), SLO_, seed=0, probe_s=60.0, warmup_s=12.0)
    result = ev.capacity(PARAMS)
    assert not hasattr(result, "message"), result
    assert result.capacity > 0
    return float(result.capacity)


def run(rate: float, seconds: float, seed: int):
    return simulate(TARGET.engine_config(PARAMS), parse_workload(WORKLOAD).with_rate(rate), duration_s=seconds,
                    seed=seed, slo=SLO_)


@pytest.mark.parametrize("seed", [11, 12])
def test_the_slo_holds_below_the_capacity_and_not_above_it(capacity: float, seed: int) -> None:
    below = run(0.9 * capacity, 120.0, seed)
    assert below.num_unfinished == 0
    assert below.ttft_p99 <= SLO_.ttft_seconds and below.itl_p99 <= SLO_.itl_seconds, (below.ttft_p99, below.itl_p99)
    above = run(1.3 * capacity, 120.0, seed)
    assert above.ttft_p99 > SLO_.ttft_seconds or above.itl_p99 > SLO_.itl_seconds, (above.ttft_p99, above.itl_p99)


def test_the_capacity_is_never_above_the_saturation_throughput(capacity: float) -> None:
    # Offered far more than it can serve, the engine completes requests at its saturation rate.
    flooded = run(4.0 * capacity, 60.0, 13)
    saturation = flooded.num_completed / flooded.makespan_s
    assert capacity < saturation


def test_a_burst_on_an_idle_engine_is_not_capacity(capacity: float) -> None:
    """What the tuner measured before: 160 requests from an empty engine pass at rates the engine
    cannot sustain; the steady-state probe does not."""
    burst_rate = 1.5 * capacity
    burst = simulate(TARGET.engine_config(PARAMS), parse_workload(WORKLOAD).with_rate(burst_rate),
                     num_requests=60, seed=0, slo=SLO_)
    assert burst.ttft_p99 <= SLO_.ttft_seconds and burst.itl_p99 <= SLO_.itl_seconds
    sustained = run(burst_rate, 120.0, 0)
    assert sustained.ttft_p99 > SLO_.ttft_seconds or sustained.itl_p99 > SLO_.itl_seconds


def test_probing_a_higher_rate_keeps_the_requests_lower_rates_saw() -> None:
    """The probe's request sequence grows by blocks: a capacity measured before a higher rate was
    probed is measured on the same requests after (the search's answer does not depend on its path)."""
    ev = TwinEvaluator(TARGET, parse_workload(WORKLOAD), SLO_, seed=0, probe_s=60.0, warmup_s=12.0)
    before = ev.requests(2.0)
    ev.requests(500.0)  # needs 30,000 requests: several more blocks
    after = ev.requests(2.0)
    assert np.array_equal(before.arrival_s, after.arrival_s)
    assert np.array_equal(before.prompt_tokens, after.prompt_tokens)
    first = ev.capacity(PARAMS)
    ev.requests(1000.0)
    ev._caps.clear()
    assert ev.capacity(PARAMS).capacity == first.capacity
