"""The gpus goal: a config scored by the GPUs its replicas need for a load (fewer is better), on the
objective, on the twin (TwinEvaluator.gpus) and through `kvpilot tune --offline --goal gpus`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.cli import main
from kvpilot.fleet.regime import gpus_needed
from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget, parse_workload
from kvpilot.tuner.core.objective import GPUS_PENALTY, SLO, Goal, Measurement, better, infeasible, score
from kvpilot.tuner.core.search import _ran
from kvpilot.tuner.core.space import EngineParams

SLO_ = SLO(0.5, 0.05)


def test_the_gpus_goal_is_minimised_and_scores_the_measured_gpus() -> None:
    assert Goal.GPUS.direction == "minimize"
    assert better(Goal.GPUS, 2.0, 3.0) and not better(Goal.GPUS, 3.0, 2.0)
    m = Measurement(ttft_p99=0.3, itl_p99=0.03, request_rate=12.0, capacity=5.0, gpus=3.0)
    out = score(Goal.GPUS, m, SLO_)
    assert (out.value, out.feasible, out.reason) == (3.0, True, "WithinSLO")
    assert out.message == "3.00 GPUs for 12 req/s at 5.000 req/s per replica"


def test_a_config_that_cannot_serve_is_told_the_penalty_not_zero_gpus() -> None:
    # Zero would be the best value a minimised goal can take: the penalty must be the worst.
    out = score(Goal.GPUS, Measurement(ttft_p99=2.0, itl_p99=0.03, request_rate=12.0, capacity=0.0), SLO_)
    assert out.value == GPUS_PENALTY and not out.feasible and out.reason == "SLOUnreachable"
    failed = infeasible(Goal.GPUS, "StartupFailed", "CUDA out of memory")
    assert failed.value == GPUS_PENALTY and not failed.feasible
    assert _ran(Goal.GPUS, 3.0) and not _ran(Goal.GPUS, GPUS_PENALTY)
    with pytest.raises(ValueError, match="Measurement.gpus"):
        score(Goal.GPUS, Measurement(ttft_p99=0.3, itl_p99=0.03, request_rate=12.0, capacity=5.0), SLO_)


def test_the_twin_scores_gpus_from_the_capacity_search_and_the_tensor_parallel_size() -> None:
    workload = parse_workload("prompt=256,output=32")
    params = EngineParams(2048, 0.9, 128)
    one = TwinEvaluator(TwinTarget(model="Llama-3.1-8B", gpu="H100-80GB"), workload, SLO_, probe_s=20.0, warmup_s=4.0)
    out = one.evaluator(Goal.GPUS, 12.0)(params)
    cap = one.evaluate(params).value
    assert out.feasible and cap > 0
    assert out.value == pytest.approx(gpus_needed(12.0, cap))
    assert out.measurement is not None and out.measurement.request_rate == 12.0
    two = TwinEvaluator(TwinTarget(model="Llama-3.1-8B", gpu="H100-80GB", tensor_parallel_size=2), workload, SLO_,
                        probe_s=20.0, warmup_s=4.0)
    cap2 = two.evaluate(params).value
    assert two.gpus(params, 12.0).value == pytest.approx(gpus_needed(12.0, cap2, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="the gpus goal is scored at a request rate > 0, got 0"):
        one.evaluator(Goal.GPUS, 0.0)


def test_offline_tune_with_the_gpus_goal_answers_the_config_needing_fewest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", "--offline", "--goal", "gpus", "--rate", "40", "--trials", "3", "-q", "-o", "json",
            "--workload", "prompt=256,output=32", "--probe-seconds", "20", "--storage", f"sqlite:///{tmp_path}/s.db",
            "--report", ""]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    answer = json.loads(out)
    assert answer["goal"] == "gpus" and answer["unit"] == "GPUs for 40 req/s (lower is better)"
    assert 0 < answer["value"] < GPUS_PENALTY
    assert "GPUs: the replicas' GPUs the load needs" in err


def test_the_gpus_goal_needs_a_positive_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--offline", "--goal", "gpus", "--rate", "0", "-q",
                 "--storage", f"sqlite:///{tmp_path}/s.db"]) == 2
    err = capsys.readouterr().err
    assert "--rate: the gpus goal is scored at an offered load in req/s > 0; got 0" in err and "Traceback" not in err
