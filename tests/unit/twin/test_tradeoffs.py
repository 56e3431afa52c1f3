"""The trade-offs the tuner relies on, on fixed workloads and seeds."""

from __future__ import annotations

import pytest

from kvpilot.twin.engine import Engine, EngineConfig, EngineStartupError
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.offline import simulate
from kvpilot.twin.workload import Workload

BASE = EngineConfig.resolve(resolve_model("meta-llama/Llama-3.1-8B-Instruct"), resolve_gpu("H100-80GB"),
                    max_model_len=8192, max_num_seqs=256)


def test_smaller_token_budget_lowers_p99_itl_and_raises_p99_ttft() -> None:
    # Long prompts arriving while others decode: big chunks stall the decodes.
    wl = Workload.parse("poisson:rate=6,prompt=lognormal/2000/0.5,output=64..256")
    small = simulate(BASE.with_(max_num_batched_tokens=512), wl, duration_s=60, seed=3)
    large = simulate(BASE.with_(max_num_batched_tokens=8192), wl, duration_s=60, seed=3)
    assert small.num_unfinished == large.num_unfinished == 0
    assert small.itl_p99 < large.itl_p99
    assert small.ttft_p99 > large.ttft_p99


def test_lower_gpu_memory_utilization_fewer_blocks_more_preemptions() -> None:
    wl = Workload.parse("poisson:rate=8,prompt=1000..3000,output=500..1500")
    low = simulate(BASE.with_(gpu_memory_utilization=0.3), wl, duration_s=60, seed=3)
    high = simulate(BASE.with_(gpu_memory_utilization=0.9), wl, duration_s=60, seed=3)
    assert low.num_gpu_blocks < high.num_gpu_blocks
    assert low.num_preemptions > high.num_preemptions
    assert low.kv_cache_usage["max"] == pytest.approx(1.0, abs=0.01)


def test_too_high_gpu_memory_utilization_fails_startup() -> None:
    with pytest.raises(EngineStartupError, match="less than desired GPU memory utilization"):
        Engine(BASE.with_(gpu_memory_utilization=0.995))
    with pytest.raises(EngineStartupError):
        simulate(BASE.with_(gpu_memory_utilization=0.995), Workload.parse("poisson:rate=1"), duration_s=1)


def test_higher_load_raises_latency() -> None:
    light = simulate(BASE, Workload.parse("poisson:rate=2"), duration_s=60, seed=1)
    heavy = simulate(BASE, Workload.parse("poisson:rate=40"), duration_s=60, seed=1)
    assert heavy.itl_s["p50"] > light.itl_s["p50"]
    assert heavy.throughput["output_tokens_per_s"] > light.throughput["output_tokens_per_s"]


def test_tensor_parallel_speeds_up_a_70b_model() -> None:
    wl = Workload.parse("poisson:rate=2,prompt=512,output=128")
    cfg = EngineConfig.resolve(resolve_model("Llama-3.1-70B"), resolve_gpu("H100-80GB"), max_model_len=8192)
    tp4 = simulate(cfg.with_(tensor_parallel_size=4), wl, duration_s=30, seed=0)
    tp8 = simulate(cfg.with_(tensor_parallel_size=8), wl, duration_s=30, seed=0)
    assert tp8.itl_s["p50"] < tp4.itl_s["p50"]


def test_faster_gpu_serves_faster() -> None:
    wl = Workload.parse("poisson:rate=2,prompt=512,output=128")
    cfg = BASE.with_(max_num_batched_tokens=2048)
    a100 = simulate(cfg.with_(gpu=resolve_gpu("A100-80GB")), wl, duration_s=30, seed=0)
    h200 = simulate(cfg.with_(gpu=resolve_gpu("H200")), wl, duration_s=30, seed=0)
    assert h200.itl_s["p50"] < a100.itl_s["p50"]
    assert h200.ttft_s["p50"] < a100.ttft_s["p50"]
