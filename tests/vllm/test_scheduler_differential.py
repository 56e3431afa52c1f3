"""The twin's scheduler and vLLM 0.32's own V1 scheduler agree step by step on the same traces.

Per step: the requests scheduled and their token counts, preemptions, resumptions, finishes; for
each scheduling mode (synchronous, vLLM's AsyncScheduler with two batches in flight), with prefix
caching on and off (shared prefixes, pools down to a few blocks), and with
--prefill-schedule-interval as vLLM's data-parallel engine core applies it.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.conformance.reference import VllmScheduler
from harness.conformance.replay import compare_steps, replay_twin
from harness.conformance.traces import FAMILIES, MAX_MODEL_LEN, Trace, random_traces

pytestmark = pytest.mark.vllm


@st.composite
def traces(draw: st.DrawFn, family: str) -> Trace:
    """A trace hypothesis can shrink: knobs first, then requests, then a pool they all fit."""
    is_async = family.startswith("async")
    prefix = family.endswith("-prefix") or (family == "dp-interval" and draw(st.booleans()))
    bs = draw(st.sampled_from((16, 32)))
    budget = draw(st.sampled_from((64, 128, 256, 512, 2048)))
    groups = draw(st.integers(1, 3)) if prefix else 0
    group_len = [draw(st.integers(1, 24)) * bs for _ in range(groups)]
    requests = []
    for i in range(draw(st.integers(1, 24))):
        max_tokens = draw(st.integers(1, 80))
        group = draw(st.one_of(st.none(), st.integers(0, groups - 1))) if groups else None
        own = draw(st.integers(1, 700))
        plen = group_len[group] if group is not None else 0
        prompt = min(plen + own, MAX_MODEL_LEN - max_tokens)
        requests.append({"id": f"r{i}", "arrival_step": draw(st.integers(1, 30)), "prompt_len": prompt,
                         "max_tokens": max_tokens, "prefix_group": group, "prefix_len": min(plen, prompt - 1)})
    biggest = max(-(-(r["prompt_len"] + r["max_tokens"]) // bs) for r in requests)
    config = {
        "block_size": bs, "max_num_batched_tokens": budget,
        "max_num_seqs": min(budget, draw(st.sampled_from((1, 2, 4, 8, 32)))),
        "num_gpu_blocks": biggest + 1 + draw(st.integers(0, 200)),
        "long_prefill_token_threshold": draw(st.sampled_from((0, 16, 48, 200))),
        "enable_prefix_caching": prefix, "async_scheduling": is_async,
        "watermark": draw(st.sampled_from((0.0, 0.0, 0.02))),
        "prefill_schedule_interval": draw(st.integers(2, 4)) if family == "dp-interval" else 1,
    }
    return {"family": family, "config": config, "requests": requests}


def assert_same_steps(ref: VllmScheduler, trace: Trace) -> None:
    cmp = compare_steps(replay_twin(trace), ref.run(trace))
    assert cmp.differing == 0, f"{cmp.differing} of {cmp.steps} steps differ; first at {cmp.first}\ntrace: {trace}"


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_schedules_as_vllm_on_generated_traces(vllm_scheduler: VllmScheduler, family: str) -> None:
    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(trace=traces(family))
    def check(trace: Trace) -> None:
        assert_same_steps(vllm_scheduler, trace)

    check()


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_schedules_as_vllm_on_the_benchmark_traces(vllm_scheduler: VllmScheduler, family: str) -> None:
    # The benchmark's own generator (seed 0): wider pools, longer prompts, more requests.
    for trace in random_traces(family, 40, seed=0):
        assert_same_steps(vllm_scheduler, trace)


def test_async_scheduling_is_checked_against_a_different_loop_than_sync(vllm_scheduler: VllmScheduler) -> None:
    # The two modes really differ on vLLM's side: a finishing request holds its slot one step.
    trace = {"config": {"block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 1, "num_gpu_blocks": 64,
                        "long_prefill_token_threshold": 0, "enable_prefix_caching": False,
                        "async_scheduling": False, "watermark": 0.0, "prefill_schedule_interval": 1},
             "requests": [{"id": "a", "arrival_step": 1, "prompt_len": 10, "max_tokens": 2, "prefix_group": None,
                           "prefix_len": 0},
                          {"id": "b", "arrival_step": 1, "prompt_len": 10, "max_tokens": 1, "prefix_group": None,
                           "prefix_len": 0}]}
    sync = vllm_scheduler.run(trace)
    trace["config"]["async_scheduling"] = True
    asyn = vllm_scheduler.run(trace)
    first_b = [next(s["step"] for s in steps if "b" in s["scheduled"]) for steps in (sync, asyn)]
    assert first_b == [3, 4]
    assert_same_steps(vllm_scheduler, trace)
