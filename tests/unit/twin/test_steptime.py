"""The step-time model and its calibration."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvpilot.twin.calibration.fit import nelder_mead
from kvpilot.twin.calibration.layers import load_profiles, relative_errors
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.steptime import (
    StepTimeModel,
    kernel_params_for,
    params_for,
    per_layer_linear_time,
    prefill_pairs,
)

PROFILES = Path(__file__).resolve().parents[3] / "benchmarks" / "data" / "vidur-profiles"
LLAMA8 = resolve_model("Llama-3.1-8B")
H100 = resolve_gpu("H100-80GB")


def test_linear_time_grows_with_tokens_and_has_a_floor() -> None:
    m = StepTimeModel(LLAMA8, H100)
    times = [m.linear_time(t) for t in (1, 16, 256, 1024, 4096, 16384)]
    assert times == sorted(times)
    # Weight-bound at one token: about the weights over the bandwidth, plus launch floors.
    weights_s = 2 * 32 * LLAMA8.layer_params() / H100.hbm_bandwidth
    assert weights_s < times[0] < 2 * weights_s
    # Compute-bound at 16k tokens: within 2x of the FLOP roofline.
    flops_s = 2 * 16384 * 32 * LLAMA8.layer_params() / H100.bf16_flops
    assert flops_s < times[-1] < 2 * flops_s


def test_attention_grows_with_context() -> None:
    m = StepTimeModel(LLAMA8, H100)
    short = m.step_time(64, 64, 64, 0.0, 64 * 100)
    long = m.step_time(64, 64, 64, 0.0, 64 * 8000)
    assert long > short
    assert m.step_time(2048, 1, 1, prefill_pairs(2048, 6000), 0) > m.step_time(2048, 1, 1, prefill_pairs(2048, 0), 0)


def test_tensor_parallel_trades_linear_time_for_all_reduce() -> None:
    model = resolve_model("Llama-3.1-70B")
    tp2, tp8 = StepTimeModel(model, H100, 2), StepTimeModel(model, H100, 8)
    assert tp8.linear_time(4096) < tp2.linear_time(4096)
    assert tp8.allreduce_time(4096) > 0 and StepTimeModel(LLAMA8, H100, 1).allreduce_time(4096) == 0


def test_breakdown_adds_up_to_step_time() -> None:
    m = StepTimeModel(resolve_model("Qwen2.5-32B"), resolve_gpu("H200"), 2)
    args = (3000, 40, 40, prefill_pairs(2961, 100), 39 * 1500)
    b = m.breakdown(*args)
    parts = sum(v for k, v in b.items() if k not in ("total_ms", "per_layer_linear_ms"))
    assert b["total_ms"] == pytest.approx(parts)
    assert b["total_ms"] == pytest.approx(m.step_time(*args) * 1e3)
    assert b["per_layer_linear_ms"] == pytest.approx(
        per_layer_linear_time(m.model, m.gpu, 2, 3000) * 1e3)


def test_unmeasured_architectures_get_the_generic_constants() -> None:
    assert params_for(resolve_gpu("L40S")) is params_for(resolve_gpu("L4"))
    assert params_for(resolve_gpu("A100-80GB")) != params_for(resolve_gpu("H100-80GB"))


def test_nelder_mead_finds_a_quadratic_minimum() -> None:
    best = nelder_mead(lambda x: float(((x - np.array([1.0, -2.0, 0.5])) ** 2).sum()), np.zeros(3), iters=2000)
    assert np.allclose(best, [1.0, -2.0, 0.5], atol=1e-3)


@pytest.mark.skipif(not PROFILES.is_dir(), reason=f"Vidur profiles not found at {PROFILES}")
def test_stored_constants_meet_the_calibration_goal() -> None:
    profiles = load_profiles(PROFILES)
    assert profiles
    for p in profiles:
        err = relative_errors(p, kernel_params_for(p.gpu))
        assert np.median(err) <= 0.07, p.name
        assert err.max() <= 0.30, p.name


def test_threads_sharing_a_step_time_table_all_read_the_same_times() -> None:
    """The in-cluster tuner prices steps in several threads: a table two of them grow at once must
    still hold each token count's time exactly once, in order."""
    import threading

    from kvpilot.twin import steptime

    model, gpu = resolve_model("Qwen2.5-0.5B"), resolve_gpu("L4")
    params = replace(steptime.params_for(gpu), cpu_overhead_s=0.000123)  # a key no other test has built
    reference = StepTimeModel(model, gpu, 1, replace(params, cpu_overhead_s=0.000124))
    barrier = threading.Barrier(8)
    errors: list[str] = []

    def worker(seed: int) -> None:
        stm = StepTimeModel(model, gpu, 1, params)
        barrier.wait()
        for tokens in (9000 + seed, 20000 + 7 * seed, 41000 + seed, 90000):
            if stm.linear_time(tokens) != reference.linear_time(tokens):
                errors.append(f"thread {seed}: tokens {tokens}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    table = StepTimeModel(model, gpu, 1, params)._linear
    assert table == reference._linear[:len(table)]
