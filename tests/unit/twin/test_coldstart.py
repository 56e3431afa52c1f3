"""The twin's start-up model, and reading a real start-up from vLLM's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.twin.coldstart import predict_cold_start, read_startup_log
from kvpilot.twin.memory import weight_bytes_per_rank
from kvpilot.twin.models import resolve_model

# The start-up lines of a real vLLM 0.11.0 server log (CodeLlama-34B on an H100, shared/data/gpu-serving).
LOG = Path(__file__).parent / "data" / "vllm-0.11-startup-codellama-34b.log"


def test_a_real_start_up_is_read_by_part_and_the_parts_add_up_to_the_log():
    start = read_startup_log(LOG.read_text())
    assert start.process_s == pytest.approx(17.101)
    assert start.weights_s == 57.66 and start.compile_s == 20.63 and start.graphs_s == 6.0
    # First line at 10:08:43.120, the API server at 10:10:33.762.
    assert start.total_s == pytest.approx(110.642, abs=1e-3)


def test_a_log_cut_before_the_server_started_names_what_is_missing():
    text = "\n".join(line for line in LOG.read_text().splitlines() if "API server" not in line)
    with pytest.raises(ValueError, match="Starting vLLM API server"):
        read_startup_log(text)


def test_the_model_reproduces_the_calibration_start_up():
    model = resolve_model("codellama/CodeLlama-34b-Instruct-hf")
    assert weight_bytes_per_rank(model, 1) / 2**30 == pytest.approx(62.86, abs=0.05)  # "Model loading took 62.8571 GiB"
    predicted = predict_cold_start(model, startup_probe_period_s=0.0)
    assert predicted.total_s == pytest.approx(read_startup_log(LOG.read_text()).total_s, rel=0.05)


def test_the_parts_move_as_vllm_does():
    small, big = resolve_model("Llama-3.1-8B"), resolve_model("Llama-3.1-70B")
    assert predict_cold_start(big).weights_s > 8 * predict_cold_start(small).weights_s
    assert predict_cold_start(big, tensor_parallel_size=4).weights_s == pytest.approx(
        predict_cold_start(big).weights_s / 4, rel=1e-3)  # vLLM pads the vocabulary per rank
    assert predict_cold_start(small, compile_cached=True).compile_s < predict_cold_start(small).compile_s
    eager = predict_cold_start(small, enforce_eager=True)
    assert eager.compile_s == 0 and eager.graphs_s == 0
    assert predict_cold_start(small, weights_gib_per_s=2.16).weights_s == pytest.approx(
        predict_cold_start(small).weights_s / 2)
    fp8 = resolve_model("Llama-3.1-8B").quantized("fp8")
    assert weight_bytes_per_rank(fp8, 1) < 0.6 * weight_bytes_per_rank(small, 1)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        predict_cold_start(resolve_model("Llama-3.1-8B"), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="weights_gib_per_s"):
        predict_cold_start(resolve_model("Llama-3.1-8B"), weights_gib_per_s=0)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "import sys; from kvpilot.cli import main; sys.exit(main())",
                           "twin", "startup", *args], capture_output=True, text=True, timeout=60)


def test_the_cli_prints_the_model_and_a_log_by_part():
    out = _cli("--model", "Llama-3.1-8B", "--tp", "2")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["seconds"] == pytest.approx(sum(report["parts"].values()), abs=0.05)
    assert set(report["parts"]) == {"process", "weights", "compile", "profile", "graphs", "server"}
    logged = json.loads(_cli("--log", str(LOG)).stdout)
    assert logged["source"] == "log" and logged["seconds"] == pytest.approx(110.64, abs=0.01)
    bad = _cli("--model", "Llama-3.1-8B", "--weights-gib-per-s", "-1")
    assert bad.returncode == 2 and "--weights-gib-per-s must be > 0" in bad.stderr
