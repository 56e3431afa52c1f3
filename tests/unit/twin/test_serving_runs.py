"""Published GPU serving runs replayed on the twin: rows read into experiments, their workload
rebuilt as inference-perf sent it, and errors against the measured figures."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.offline import drive, request_latencies
from kvpilot.twin.serving_runs import (
    WHOLE_RUN,
    ExperimentError,
    errors,
    median_errors,
    read_experiments,
    run_experiment,
    workload,
)
from kvpilot.twin.workload import RequestBatch

COLUMNS = ["exp_id", "experiment_folder", "model", "hardware", "precision", "tp", "dp", "max_num_batched_tokens",
           "max_num_seqs", "max_model_len", "wl_stages_rate_duration", "wl_num_system_prompts", "wl_users_per_prompt",
           "wl_system_prompt_len", "wl_question_len", "wl_output_len", "stage_index", "actual_e2e_mean_ms",
           "actual_ttft_mean_ms", "actual_ttft_p99_ms", "actual_itl_mean_ms", "notes"]


def write(path: Path, rows: list[dict[str, str]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(r)
    return path


def row(stage: int, **over: str) -> dict[str, str]:
    base = {"exp_id": "1", "experiment_folder": "qwen", "model": "Qwen/Qwen2.5-7B-Instruct", "hardware": "H100",
            "precision": "FP16", "tp": "1", "dp": "", "max_num_batched_tokens": "2048", "max_num_seqs": "128",
            "max_model_len": "", "wl_stages_rate_duration": "[[4.0, 30], [8.0, 30]]", "wl_num_system_prompts": "3",
            "wl_users_per_prompt": "2", "wl_system_prompt_len": "100", "wl_question_len": "400",
            "wl_output_len": "50", "stage_index": str(stage), "actual_e2e_mean_ms": "400",
            "actual_ttft_mean_ms": "30", "actual_ttft_p99_ms": "60", "actual_itl_mean_ms": "7",
            "notes": "total_kv_blocks=20000 cpu_kv_blocks=0"}
    return {**base, **over}


def test_rows_become_one_experiment_with_its_stages(tmp_path: Path) -> None:
    exps = read_experiments(write(tmp_path / "runs.csv", [row(-1), row(0), row(1)]))
    assert len(exps) == 1
    exp = exps[0]
    assert exp.stages == ((4.0, 30.0), (8.0, 30.0)) and exp.num_gpu_blocks == 20000
    assert set(exp.measured) == {WHOLE_RUN, 0, 1} and exp.measured[0]["ttft_mean"] == 30.0


def test_each_users_prompt_recurs_as_a_prefix_cache_hit(tmp_path: Path) -> None:
    exp = read_experiments(write(tmp_path / "runs.csv", [row(-1)]))[0]
    batch, stage = workload(exp, seed=3)
    assert len(batch) == len(stage) and set(stage.tolist()) == {0, 1}
    assert batch.prefix_keys is not None and len(set(batch.prefix_keys)) == 6  # 3 groups x 2 users
    # inference-perf sends the users' prompts in turn: each recurs every 6 requests.
    assert batch.prefix_keys[:6] == batch.prefix_keys[6:12]
    assert (batch.prefix_tokens == batch.prompt_tokens).all()
    # The second stage sends twice as fast as the first.
    assert (stage == 1).sum() > 1.5 * (stage == 0).sum()


def test_data_parallel_engines_each_serve_their_share(tmp_path: Path) -> None:
    single = read_experiments(write(tmp_path / "one.csv", [row(-1)]))[0]
    two = read_experiments(write(tmp_path / "two.csv", [row(-1, dp="2")]))[0]
    assert two.dp == 2
    n1, n2 = len(workload(single, seed=1)[0]), len(workload(two, seed=1)[0])
    assert 0.35 < n2 / n1 < 0.65  # one replica of two sees half the arrivals


def test_a_replay_reports_every_stage_and_its_errors(tmp_path: Path) -> None:
    exp = read_experiments(write(tmp_path / "runs.csv", [row(-1), row(0), row(1)]))[0]
    pred = run_experiment(exp)
    assert set(pred) == {WHOLE_RUN, 0, 1}
    assert 0 < pred[WHOLE_RUN]["ttft_mean"] < pred[WHOLE_RUN]["e2e_mean"]
    errs = errors(pred, exp.measured)
    expected = abs(pred[0]["ttft_mean"] - 30.0) / 30.0 * 100
    assert errs[0]["ttft_mean"] == pytest.approx(expected)
    assert median_errors([errs])["ttft_mean"] == pytest.approx(errs[WHOLE_RUN]["ttft_mean"])


def test_a_row_naming_an_unknown_model_says_which(tmp_path: Path) -> None:
    exp = read_experiments(write(tmp_path / "runs.csv", [row(-1, model="acme/secret-model-9b")]))[0]
    with pytest.raises(ExperimentError, match="acme/secret-model-9b"):
        run_experiment(exp)


def test_a_malformed_row_names_its_line_and_column(tmp_path: Path) -> None:
    path = write(tmp_path / "runs.csv", [row(-1), row(0), row(-1, exp_id="2", max_num_batched_tokens="lots")])
    with pytest.raises(ExperimentError, match=r"line 4: column 'max_num_batched_tokens'"):
        read_experiments(path)


def test_async_scheduling_takes_a_new_request_one_step_later() -> None:
    """A request arriving while a step runs joins the step after next under async scheduling (vLLM
    scheduled the next step when this one started), the next step without it."""
    model, gpu = resolve_model("Llama-3.1-8B"), resolve_gpu("H100-80GB")
    ttfts = {}
    for async_on in (True, False):
        engine = Engine(EngineConfig.resolve(model, gpu, max_num_batched_tokens=2048, async_scheduling=async_on))
        # A long decode keeps the engine busy; the second request arrives in the middle of a step.
        batch = RequestBatch(np.array([0.0, 0.1]), np.array([64, 64]), np.array([400, 4]))
        lat = request_latencies(drive(engine, batch))
        ttfts[async_on] = float(lat.ttft[lat.index == 1][0])
    step = ttfts[False] / 1.5
    assert ttfts[True] - ttfts[False] == pytest.approx(step, rel=0.6)
