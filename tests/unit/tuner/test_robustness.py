"""The recommendation against the twin's own error: the top finished configs re-priced with every
step slower and faster by the measured step-time error, and what tune prints of it."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest
from optuna.trial import TrialState

from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget
from kvpilot.tuner.adapters.robustness import Rerank, best_finished, rerank_within_error
from kvpilot.tuner.core.objective import SLO
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import ATTR_ENGINE
from kvpilot.twin.accuracy import MEASURED, measured_error, step_scale_multipliers
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.steptime import StepTimeModel, params_for
from kvpilot.twin.workload import Workload

A, B, C = EngineParams(1024, 0.9, 64), EngineParams(2048, 0.9, 128), EngineParams(512, 0.8, 32)


def trial(params: EngineParams, value: float, violated: bool = False,
          state: TrialState = TrialState.COMPLETE) -> optuna.trial.FrozenTrial:
    return optuna.trial.create_trial(
        state=state, value=value if state is TrialState.COMPLETE else None,
        user_attrs={ATTR_ENGINE: params.as_spec()}, constraints={"slo": 1.0 if violated else -1.0})


def test_every_step_scales_by_the_factor() -> None:
    gpu = resolve_gpu("H100-80GB")
    p = params_for(gpu)
    slow = replace(p, **{k: getattr(p, k) * f for k, f in step_scale_multipliers(1.1)})
    base, scaled = StepTimeModel(resolve_model("Llama-3.1-8B"), gpu, 1, p), StepTimeModel(
        resolve_model("Llama-3.1-8B"), gpu, 1, slow)
    for tokens, seqs in ((1, 1), (64, 64), (2048, 8)):
        assert scaled.step_time(tokens, seqs, seqs, 1e4, seqs * 500) == pytest.approx(
            1.1 * base.step_time(tokens, seqs, seqs, 1e4, seqs * 500))
    assert slow.frontend_s == p.frontend_s  # the frontend's latency is not a step's


def test_best_finished_keeps_feasible_distinct_configs_best_first() -> None:
    trials = [trial(A, 10.0), trial(B, 12.0), trial(A, 9.0), trial(C, 30.0, violated=True),
              trial(C, 0.0, state=TrialState.FAIL)]
    assert best_finished(trials, 3) == [(B, 12.0), (A, 10.0)]


def test_an_unmeasured_gpu_borrows_the_h100s_error_and_says_so() -> None:
    err, measured = measured_error(resolve_gpu("L40S"))
    assert err is MEASURED["H100-80GB"] and not measured
    lines = Rerank(err, measured, {0.9: [(A, 5.0), (B, 4.0)], 1.1: [(B, 4.0), (A, 3.5)]}).lines(A, 4.5, "req/s")
    assert "no serving runs on this GPU" in lines[0]
    assert "recommended config stays the best" in lines[1] and "faster" in lines[1]
    assert "2048/0.9/128 would be best (4.000 req/s) over the recommended config (3.500)" in lines[2]


def test_rerank_prices_the_candidates_slower_and_faster() -> None:
    target = TwinTarget(model="Llama-3.1-8B", gpu="H100-80GB", max_model_len=4096)
    wl = Workload.parse("chat")
    evaluator = TwinEvaluator(target, wl, SLO(ttft_seconds=0.5, itl_seconds=0.05), probe_s=20.0, warmup_s=4.0)
    nominal = evaluator.evaluate(A).value
    result = rerank_within_error(evaluator, [(A, nominal)])
    (fast, fast_ranked), (slow, slow_ranked) = sorted(result.ranks.items())
    assert fast < 1.0 < slow
    assert slow_ranked[0][1] <= nominal <= fast_ranked[0][1]
