"""The search space: ranges from the spec, the tokens >= seqs rule, clipping, the benchmark grid."""

from __future__ import annotations

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.tuner.core.space import EngineParams, SearchSpace, SpaceError


def test_defaults_match_the_design_space() -> None:
    s = SearchSpace()
    assert s.max_num_batched_tokens == (256, 16384)
    assert s.gpu_memory_utilization == (0.70, 0.95)
    assert s.max_num_seqs == (64, 1024)


def test_from_camel_case_dict_and_missing_ranges_keep_defaults() -> None:
    s = SearchSpace.from_spec({"maxNumBatchedTokens": [512, 8192]})
    assert s.max_num_batched_tokens == (512, 8192)
    assert s.max_num_seqs == (64, 1024)


@pytest.mark.parametrize(
    ("space", "path"),
    [
        ({"maxNumBatchedTokens": [4096, 512]}, "spec.tuning.space.maxNumBatchedTokens"),
        ({"gpuMemoryUtilization": [0.5, 1.2]}, "spec.tuning.space.gpuMemoryUtilization"),
        ({"maxNumSeqs": [0, 8]}, "spec.tuning.space.maxNumSeqs"),
        ({"maxNumSeqs": "lots"}, "spec.tuning.space.maxNumSeqs"),
        # No config can start: the largest budget is below the smallest sequence cap.
        ({"maxNumBatchedTokens": [32, 64], "maxNumSeqs": [128, 256]}, "spec.tuning.space.maxNumBatchedTokens"),
    ],
)
def test_bad_space_names_the_field(space: dict, path: str) -> None:
    with pytest.raises(SpaceError) as err:
        SearchSpace.from_spec(space)
    assert err.value.path == path
    assert path in str(err.value)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    tok=st.tuples(st.integers(1, 20000), st.integers(1, 20000)),
    seqs=st.tuples(st.integers(1, 2000), st.integers(1, 2000)),
)
def test_tokens_never_below_seqs(seed: int, tok: tuple[int, int], seqs: tuple[int, int]) -> None:
    lo_t, hi_t = sorted(tok)
    lo_s, hi_s = sorted(seqs)
    if lo_t == hi_t or lo_s == hi_s or hi_t < lo_s:
        return
    space = SearchSpace(max_num_batched_tokens=(lo_t, hi_t), max_num_seqs=(lo_s, hi_s))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    for _ in range(10):
        trial = study.ask(space.distributions())
        p = space.resolve(trial.params)
        assert p.max_num_batched_tokens >= p.max_num_seqs
        assert lo_s <= p.max_num_seqs <= hi_s
        assert 0.70 <= p.gpu_memory_utilization <= 0.95
        study.tell(trial, 0.0)


def test_clamp_keeps_the_raw_draw_but_applies_a_valid_engine() -> None:
    space = SearchSpace()
    p = space.resolve({"maxNumBatchedTokens": 300, "gpuMemoryUtilization": 0.8, "maxNumSeqs": 700})
    assert p == EngineParams(700, 0.8, 700)


def test_clip_brings_an_outside_engine_into_the_space() -> None:
    space = SearchSpace()
    p = space.clip(EngineParams(100_000, 0.99, 8))
    assert space.contains(p)
    assert p == EngineParams(16384, 0.95, 64)


def test_grid_is_the_benchmark_grid() -> None:
    grid = list(SearchSpace().grid())
    # 7 budgets x 6 fractions x 5 caps, less the tokens < seqs corners (256<512,1024; 512<1024).
    assert len(grid) == 7 * 6 * 5 - 3 * 6
    assert all(p.max_num_batched_tokens >= p.max_num_seqs for p in grid)
    assert EngineParams(2048, 0.9, 256) in grid


def test_digest_changes_with_the_space() -> None:
    assert SearchSpace().digest() == SearchSpace().digest()
    assert SearchSpace().digest() != SearchSpace(max_num_seqs=(32, 1024)).digest()


def test_flags_are_vllm_flags() -> None:
    assert EngineParams(2048, 0.9, 256).as_flags() == [
        "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256",
    ]


def test_pow2_resolution_draws_grid_points_only() -> None:
    space = SearchSpace(scale="pow2", util_step=0.05)
    grid = set(space.grid())
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(50):
        trial = study.ask(space.distributions())
        assert space.resolve(trial.params) in grid
        study.tell(trial, 0.0)
    assert space.raw_params(EngineParams(3000, 0.92, 200)) == {
        "log2maxNumSeqs": 8, "gpuMemoryUtilization": 0.9, "log2maxNumBatchedTokens": 12,
    }
