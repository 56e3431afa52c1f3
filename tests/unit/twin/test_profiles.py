"""Device profiles: a measured device (a CPU here) for the twin, read from JSON with errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import GiB
from kvpilot.twin.models import resolve_model
from kvpilot.twin.offline import step_gaps
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


def _served_trace(step_time: dict[str, float], arrivals: list[float], prompts: list[int],
                  outputs: list[int]) -> Any:
    import numpy as np

    from kvpilot.twin.offline import drive
    from kvpilot.twin.workload import RequestBatch

    profile = DeviceProfile.from_dict({"device": CPU, "step_time": step_time})
    config = EngineConfig(model=resolve_model("Qwen/Qwen2.5-7B-Instruct"), gpu=profile.device,
                          max_num_batched_tokens=1024, max_num_seqs=16, max_model_len=4096,
                          gpu_memory_utilization=None, kv_cache_memory_bytes=GiB, block_size=128,
                          async_scheduling=False, step_time_params=profile.step_time)
    return drive(Engine(config), RequestBatch(np.array(arrivals), np.array(prompts), np.array(outputs)))


def _ttfts(trace: Any) -> list[float]:
    done = sorted(trace.done, key=lambda r: r.arrival_time)
    return [trace.delivered[r.step_first_token] - r.arrival_time for r in done]


def test_without_frontend_costs_tokens_reach_clients_at_the_step_ends() -> None:
    trace = _served_trace({}, [0.0, 0.1], [300, 40], [4, 6])
    assert trace.delivered is trace.ends  # every GPU preset: nothing is added, nothing is copied


def test_the_frontend_admits_a_burst_one_request_at_a_time() -> None:
    """frontend_request_s: requests sent together wait for the frontend to admit each in turn, so the
    k-th reaches the scheduler k admissions after the send, and its TTFT grows with k."""
    cost = 0.5  # longer than the steps here, so the engine takes them one by one
    base = _ttfts(_served_trace({}, [0.0] * 4, [16] * 4, [2] * 4))
    ttft = _ttfts(_served_trace({"frontend_request_s": cost}, [0.0] * 4, [16] * 4, [2] * 4))
    assert all(t >= (k + 1) * cost for k, t in enumerate(sorted(ttft)))
    assert sorted(ttft)[-1] - sorted(base)[-1] >= 3 * cost


def test_a_longer_prompt_takes_the_frontend_longer_to_admit() -> None:
    """frontend_prompt_token_s: a prompt is admitted in its per-request cost plus its length times
    the per-token cost, so of two requests sent together the second waits for the first's whole
    prompt, and a long prompt's TTFT grows by its tokens' admission."""
    per_token = 0.01
    short = _ttfts(_served_trace({"frontend_prompt_token_s": per_token}, [0.0], [16], [2]))
    long = _ttfts(_served_trace({"frontend_prompt_token_s": per_token}, [0.0], [400], [2]))
    plain_long = _ttfts(_served_trace({}, [0.0], [400], [2]))
    assert long[0] - plain_long[0] >= 400 * per_token
    assert long[0] - short[0] >= (400 - 16) * per_token
    # Sent together, the short request behind the long one is admitted only after the long prompt.
    pair = _served_trace({"frontend_prompt_token_s": per_token}, [0.0, 0.0], [400, 16], [2, 2])
    behind = next(r for r in pair.done if r.prompt_tokens == 16)
    assert pair.delivered[behind.step_first_token] >= (400 + 16) * per_token


def test_streaming_delays_what_clients_see_not_the_engines_steps() -> None:
    """frontend_token_s: a step's tokens reach the clients once the frontend has streamed them; the
    engine core does not wait for it, so the steps are those of a run without the cost."""
    args = ([0.0] * 8, [40] * 8, [6] * 8)
    plain = _served_trace({}, *args)
    slow = _served_trace({"frontend_token_s": 1.0}, *args)  # 1 s a token: far above a step here
    assert slow.ends == pytest.approx(plain.ends)
    assert all(d >= e for d, e in zip(slow.delivered[1:], slow.ends[1:], strict=True))
    # The first step samples the eight first tokens: the clients see them eight seconds after it.
    assert slow.delivered[1] == pytest.approx(plain.ends[1] + 8.0)


def test_a_frontend_behind_the_engine_streams_the_steps_that_waited_in_one_round() -> None:
    """Steps that end while the frontend is busy wait and go out together, one event per request
    (vLLM's RequestOutputCollector merges what a stream has not sent yet): the round costs
    frontend_token_s once per request in it, not once per token, plus frontend_step_s per step, and a
    client reading k tokens at once counts k gaps of a k-th of its wait."""
    args = ([0.0] * 8, [40] * 8, [6] * 8)
    plain = _served_trace({}, *args)
    slow = _served_trace({"frontend_token_s": 1.0, "frontend_step_s": 0.25}, *args)
    decodes = list(range(2, len(plain.ends)))
    assert len(decodes) == 5 and plain.ends[-1] < plain.ends[1] + 8.25  # all end while the first streams
    first = plain.ends[1] + 0.25 + 8.0
    assert slow.delivered[1] == pytest.approx(first)
    # One round for the five decode steps: 5 x 0.25 s of steps and 8 requests' tokens, not 5 x 8.
    assert [slow.delivered[k] for k in decodes] == pytest.approx([first + 1.25 + 8.0] * 5)
    gaps = step_gaps(slow)
    assert gaps[decodes] == pytest.approx([(1.25 + 8.0) / 5] * 5)
    # Each request's stream: its first token, then five gaps that add up to the round's wait.
    steady = np.repeat(gaps, np.asarray(slow.steadies, dtype=np.int64))
    assert len(steady) == 8 * 5 and steady.sum() == pytest.approx(8 * (1.25 + 8.0))


def test_a_frontend_that_keeps_up_streams_every_step_on_its_own() -> None:
    """Costs below the step time: no step waits, each is delivered alone at its end plus its cost."""
    args = ([0.0] * 8, [40] * 8, [6] * 8)
    plain = _served_trace({}, *args)
    cost = 1e-4
    fast = _served_trace({"frontend_token_s": cost}, *args)
    assert fast.delivered[1:] == pytest.approx([e + 8 * cost for e in plain.ends[1:]])
    assert step_gaps(fast)[2:] == pytest.approx(np.diff(plain.ends[1:]))


def test_the_engine_takes_each_new_request_in_before_its_next_step() -> None:
    """engine_request_s: requests that reached the engine since the last step make the next step
    that much longer each (vLLM's engine core decodes and hashes them between steps), and a step
    after no arrival is not charged."""
    cost = 0.05
    args = ([0.0] * 4 + [30.0], [40] * 5, [6] * 5)

    def durations(trace: Any) -> tuple[np.ndarray, int]:
        late = next(r for r in trace.done if r.arrival_time == 30.0)
        return np.asarray(trace.ends) - np.asarray(trace.starts), late.step_scheduled

    plain, k = durations(_served_trace({}, *args))
    taken, k_taken = durations(_served_trace({"engine_request_s": cost}, *args))
    assert k_taken == k and k > 6  # the first four had finished: the late one starts a step of its own
    extra = taken - plain
    assert extra[1] == pytest.approx(4 * cost)  # the four sent together, taken in before the first step
    assert extra[k] == pytest.approx(cost)
    assert np.allclose(np.delete(extra, [1, k]), 0.0)


def test_an_arrival_holds_up_the_tokens_streaming_behind_it() -> None:
    """One server: a request the frontend admits while another streams delays that stream's next
    token by the admission, which is how a lone arrival shows in p99 ITL."""
    cost = 2.0  # longer than a step (~0.9 s on this slow device): the admission spans a step's end
    alone = _served_trace({"frontend_request_s": cost}, [0.0], [16], [40])
    shared = _served_trace({"frontend_request_s": cost}, [0.0, 5.0], [16, 16], [40, 2])
    first = min(shared.done, key=lambda r: r.arrival_time)
    gaps = [shared.delivered[k] - shared.delivered[k - 1]
            for k in range(first.step_first_token + 1, first.step_last_token + 1)]
    alone_gaps = [alone.delivered[k] - alone.delivered[k - 1] for k in range(2, len(alone.delivered))]
    assert max(gaps) >= max(alone_gaps) + cost / 2


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
        {"device": CPU, "step_time": {"cpu_overhead_s": 0.004, "frontend_s": 0.02, "frontend_request_s": 0.01,
                                      "frontend_token_s": 1e-4}}))
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["Qwen/Qwen2.5-7B-Instruct", "--device-profile", str(tmp_path / "p.json"),
                              "--kv-cache-memory-bytes", "1Gi"])
    offline = engine_config_from_args(args).step_time_params
    served = engine_config_from_args(args, real_frontend=True).step_time_params
    assert offline is not None and (offline.frontend_s, offline.frontend_request_s, offline.frontend_token_s) == \
        (0.02, 0.01, 1e-4)
    assert served is not None and not served.frontend_queues and served.frontend_s == 0.0
    assert served.cpu_overhead_s == 0.004  # the rest of the profile stands
