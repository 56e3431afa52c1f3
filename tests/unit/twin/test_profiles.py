"""Device profiles: a measured device (a CPU here) for the twin, read from JSON with errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import GiB
from kvpilot.twin.models import resolve_model
from kvpilot.twin.profiles import DeviceProfile, DeviceProfileError
from kvpilot.twin.steptime import StepTimeModel

CPU = {"name": "cpu", "total_memory_bytes": 24 * GiB, "bf16_flops": 1.5e12, "hbm_bandwidth": 20e9}


def test_a_profile_round_trips_and_prices_steps_with_its_own_constants(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"device": CPU, "step_time": {"cpu_overhead_s": 0.004}, "source": "here"}))
    profile = DeviceProfile.load(path)
    assert profile.device.bf16_flops == 1.5e12 and profile.step_time.cpu_overhead_s == 0.004
    profile.write(tmp_path / "again.json")
    assert DeviceProfile.load(tmp_path / "again.json") == profile
    model = resolve_model("meta-llama/Llama-3.1-8B-Instruct")
    slow = StepTimeModel(model, profile.device, 1, profile.step_time).step_time(1, 1, 1, 0.0, 100)
    fast = StepTimeModel(model, profile.device, 1, profile.step_time.__class__()).step_time(1, 1, 1, 0.0, 100)
    assert slow - fast == pytest.approx(0.004 - profile.step_time.__class__().cpu_overhead_s)


def test_an_engine_runs_on_a_profiled_device_with_a_fixed_kv_cache() -> None:
    profile = DeviceProfile.from_dict({"device": CPU})
    config = EngineConfig(model=resolve_model("Qwen/Qwen2.5-7B-Instruct"), gpu=profile.device,
                          max_num_batched_tokens=256, max_num_seqs=8, max_model_len=4096,
                          gpu_memory_utilization=None, kv_cache_memory_bytes=GiB, block_size=128,
                          async_scheduling=False, step_time_params=profile.step_time)
    engine = Engine(config)
    assert engine.num_gpu_blocks * 128 * config.model.kv_bytes_per_token() <= GiB
    engine.add_request("a", 300, 4)
    steps = 0
    while engine.has_unfinished_requests():
        assert engine.step().duration_s > 0
        steps += 1
    assert steps == 2 + 3  # 300 prompt tokens in chunks of 256, then three more decodes


def test_a_profiles_frontend_latency_delays_every_request_and_adds_to_ttft_not_itl() -> None:
    """frontend_s (a served engine's HTTP/IPC/SSE latency) holds each request back before the scheduler
    sees it; with it 0, as for every GPU preset, the run is the same as without the field."""
    import numpy as np

    from kvpilot.twin.offline import drive
    from kvpilot.twin.workload import RequestBatch

    def run(frontend_s: float) -> tuple[list[float], list[float]]:
        profile = DeviceProfile.from_dict({"device": CPU, "step_time": {"frontend_s": frontend_s}})
        config = EngineConfig(model=resolve_model("Qwen/Qwen2.5-7B-Instruct"), gpu=profile.device,
                              max_num_batched_tokens=256, max_num_seqs=8, max_model_len=4096,
                              gpu_memory_utilization=None, kv_cache_memory_bytes=GiB, block_size=128,
                              async_scheduling=False, step_time_params=profile.step_time)
        batch = RequestBatch(np.array([0.0, 0.05, 2.0]), np.array([300, 40, 100]), np.array([4, 6, 3]))
        trace = drive(Engine(config), batch)
        ends = trace.ends
        done = sorted(trace.done, key=lambda r: r.arrival_time)
        return ([ends[r.step_first_token] - r.arrival_time for r in done],
                [e - s for s, e in zip(trace.starts, ends, strict=True)])

    ttft0, steps0 = run(0.0)
    ttft, steps = run(0.02)
    assert ttft == pytest.approx([t + 0.02 for t in ttft0])
    assert steps == pytest.approx(steps0)  # alone at the engine, each request sees the same steps


def test_a_profiles_frontend_token_cost_bounds_a_step_from_below() -> None:
    """frontend_token_s: a step's tokens reach the clients no faster than the frontend streams them."""
    profile = DeviceProfile.from_dict({"device": CPU, "step_time": {"frontend_token_s": 1.0}})
    model = resolve_model("Qwen/Qwen2.5-7B-Instruct")  # ~0.8 s a decode step on this slow device
    with_cost = StepTimeModel(model, profile.device, 1, profile.step_time)
    without = StepTimeModel(model, profile.device, 1, profile.step_time.__class__())
    chunk = (500, 1, 0, 500 * 250.5, 0)  # a prefill chunk that samples nothing: engine-bound
    assert with_cost.step_time(*chunk) == without.step_time(*chunk)
    assert without.step_time(8, 8, 8, 0.0, 800) < 8.0
    assert with_cost.step_time(8, 8, 8, 0.0, 800) == 8.0  # eight tokens to stream: frontend-bound


@pytest.mark.parametrize(("data", "message"), [
    ([], "JSON object"),
    ({"device": {**CPU, "bf16_flops": "fast"}}, "device.bf16_flops: must be a non-negative number"),
    ({"device": {k: v for k, v in CPU.items() if k != "hbm_bandwidth"}}, "device.hbm_bandwidth: required"),
    ({"device": CPU, "step_time": {"cpu_overhead": 1}}, "step_time.cpu_overhead: unknown field"),
    ({"device": CPU, "step_time": {"cpu_overhead_s": True}}, "step_time.cpu_overhead_s: must be"),
    ({"device": {**CPU, "name": 3}}, "device.name: must be a string"),
])
def test_a_bad_profile_is_refused_naming_the_field(data: object, message: str) -> None:
    with pytest.raises(DeviceProfileError, match=message):
        DeviceProfile.from_dict(data)


def test_an_unreadable_profile_says_so(tmp_path: Path) -> None:
    with pytest.raises(DeviceProfileError, match="cannot read"):
        DeviceProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(DeviceProfileError, match="not JSON"):
        DeviceProfile.load(tmp_path / "bad.json")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from kvpilot.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_twin_run_simulates_the_profiled_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.json").write_text(json.dumps({"device": CPU, "step_time": {"cpu_overhead_s": 0.004}}))
    args = ["twin", "run", "Qwen/Qwen2.5-7B-Instruct", "--workload", "poisson:rate=2", "--num-requests", "20",
            "--kv-cache-memory-bytes", "1Gi", "--block-size", "128", "--max-model-len", "4096", "--no-histograms"]
    code, out, _ = run_cli([*args, "--device-profile", str(tmp_path / "p.json")], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["config"]["gpu"] == "cpu"
    # every step pays the profile's 4 ms of overhead, so no token gap is shorter
    assert report["itl_s"]["p50"] >= 0.004
    code, _, err = run_cli([*args, "--device-profile", str(tmp_path / "p.json"), "--gpu", "L4"], capsys)
    assert code == 2 and "--device-profile and --gpu" in err


def test_twin_serve_leaves_out_the_profiles_frontend_terms_its_own_frontend_is_real(tmp_path: Path) -> None:
    import argparse

    from kvpilot.twin.flags import add_engine_arguments, engine_config_from_args

    (tmp_path / "p.json").write_text(json.dumps(
        {"device": CPU, "step_time": {"cpu_overhead_s": 0.004, "frontend_s": 0.02, "frontend_token_s": 1e-4}}))
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["Qwen/Qwen2.5-7B-Instruct", "--device-profile", str(tmp_path / "p.json"),
                              "--kv-cache-memory-bytes", "1Gi"])
    offline = engine_config_from_args(args).step_time_params
    served = engine_config_from_args(args, real_frontend=True).step_time_params
    assert offline is not None and (offline.frontend_s, offline.frontend_token_s) == (0.02, 1e-4)
    assert served is not None and (served.frontend_s, served.frontend_token_s) == (0.0, 0.0)
    assert served.cpu_overhead_s == 0.004  # the rest of the profile stands
