"""The Engine API step by step: chunking, budgets, preemption, prefix caching, validation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.steptime import params_for

SMALL = resolve_model("Qwen2.5-0.5B")


def engine(blocks: int = 200, **kw) -> Engine:
    bs = kw.get("block_size", 16)
    kw.setdefault("max_model_len", (blocks - 1) * bs)
    return Engine(EngineConfig.resolve(SMALL, resolve_gpu("L4"),
                               kv_cache_memory_bytes=blocks * bs * SMALL.kv_bytes_per_token(), **kw))


def drain(e: Engine, limit: int = 10000) -> list:
    outs = []
    while e.has_unfinished_requests():
        outs.append(e.step())
        assert len(outs) < limit
    return outs


def test_prompt_is_chunked_into_the_budget_and_then_decodes_one_token_per_step() -> None:
    e = engine(max_num_batched_tokens=32, max_num_seqs=4)
    assert e.num_gpu_blocks == 200
    e.add_request("a", prompt_tokens=100, max_tokens=3, arrival_time=0.0)
    outs = drain(e)
    seen = [(o.outputs[0].num_computed_prompt_tokens, o.outputs[0].new_token_count, o.num_scheduled_tokens)
            for o in outs]
    assert seen == [(32, 0, 32), (64, 0, 32), (96, 0, 32), (100, 1, 4), (100, 1, 1), (100, 1, 1)]
    assert outs[-1].outputs[0].finished and outs[-1].outputs[0].finish_reason == "length"
    assert all(o.duration_s > 0 for o in outs)
    # A 32-token prefill chunk costs at least what a single decode does.
    assert outs[0].duration_s >= outs[-1].duration_s


def test_running_requests_are_served_before_waiting_ones() -> None:
    e = engine(max_num_batched_tokens=64, max_num_seqs=8)
    e.add_request("a", 100, 5)
    e.step()  # a: 64 of 100
    e.add_request("b", 100, 5)
    out = e.step()
    sched = {o.request_id: o.num_computed_prompt_tokens for o in out.outputs}
    assert sched == {"a": 100, "b": 28}  # a finishes its prompt first, b gets the rest of the budget


def test_max_num_seqs_bounds_the_running_set() -> None:
    e = engine(max_num_batched_tokens=256, max_num_seqs=2)
    for i in range(5):
        e.add_request(f"r{i}", 10, 4)
    out = e.step()
    assert out.num_running == 2 and out.num_waiting == 3
    assert sorted(o.request_id for o in out.outputs) == ["r0", "r1"]  # first come, first served
    drain(e)


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    e = engine(max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=64)
    e.add_request("a", 300, 2)
    e.add_request("b", 300, 2)
    out = e.step()
    assert out.num_scheduled_tokens == 128
    assert [o.num_computed_prompt_tokens for o in out.outputs] == [64, 64]


def test_adaptive_long_prefill_threshold_floors_the_cap_at_a_fair_share_of_the_budget() -> None:
    # --long-prefill-token-threshold-adaptive: max(64, 512 // 2 eligible requests) = 256 each.
    e = engine(max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=64,
               long_prefill_token_threshold_adaptive=True)
    e.add_request("a", 300, 2)
    e.add_request("b", 300, 2)
    out = e.step()
    assert [o.num_computed_prompt_tokens for o in out.outputs] == [256, 256]
    # Alone, a request is not capped at all (nobody to starve).
    e2 = engine(max_num_batched_tokens=512, max_num_seqs=8, long_prefill_token_threshold=64,
                long_prefill_token_threshold_adaptive=True)
    e2.add_request("a", 300, 2)
    assert e2.step().num_scheduled_tokens == 300


def test_newest_running_request_is_preempted_and_recomputed() -> None:
    # 20 usable-ish blocks of 16 tokens: three requests of 64 prompt tokens each need 4 blocks to
    # start and grow by a block every 16 tokens.
    e = engine(blocks=21, max_num_batched_tokens=512, max_num_seqs=8)
    for i in range(3):
        e.add_request(f"r{i}", 64, 100)
    preempted_at = None
    victims: set[str] = set()
    running_before: list[str] = []
    for step in range(400):
        running_before = [r.request_id for r in e.scheduler.running]
        out = e.step()
        if out.num_preemptions and preempted_at is None:
            preempted_at = step
            waiting_now = [r.request_id for r in e.scheduler.waiting]
            victims = set(running_before) & set(waiting_now)
            # No new admissions in a step that preempted.
            assert all(o.request_id in running_before for o in out.outputs)
        if not e.has_unfinished_requests():
            break
    assert preempted_at is not None
    assert victims == {running_before[-1]} or victims <= set(running_before[1:])
    assert "r0" not in victims  # the oldest request keeps running
    assert not e.has_unfinished_requests()
    assert e.scheduler.num_preemptions_total >= 1


def test_reserve_full_isl_waits_for_room_for_the_whole_prompt() -> None:
    e = engine(blocks=40, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=600)
    e.add_request("big", 400, 150)  # will hold 25+ blocks
    for _ in range(8):
        e.step()
    e.add_request("next", 300, 1)  # 19 blocks for the full prompt: does not fit beside "big"
    out = e.step()
    assert "next" not in {o.request_id for o in out.outputs}
    assert out.num_waiting == 1
    e2 = engine(blocks=40, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=600)
    e2.scheduler.reserve_full_isl = False
    e2.add_request("big", 400, 150)
    for _ in range(8):
        e2.step()
    e2.add_request("next", 300, 1)
    assert "next" in {o.request_id for o in e2.step().outputs}  # its first chunk fits


def test_prefix_cache_hits_skip_the_shared_prefix() -> None:
    e = engine(max_num_batched_tokens=1024, max_num_seqs=8)
    e.add_request("a", 300, 1, prefix_key="sys", prefix_tokens=200)
    drain(e)
    e.add_request("b", 300, 1, prefix_key="sys", prefix_tokens=200)
    out = e.step()
    # 200 // 16 = 12 full blocks = 192 tokens come from the cache.
    assert out.num_scheduled_tokens == 300 - 192
    e2 = engine(max_num_batched_tokens=1024, max_num_seqs=8, enable_prefix_caching=False)
    e2.add_request("a", 300, 1, prefix_key="sys", prefix_tokens=200)
    drain(e2)
    e2.add_request("b", 300, 1, prefix_key="sys", prefix_tokens=200)
    assert e2.step().num_scheduled_tokens == 300


def test_abort_frees_blocks_and_unknown_ids_are_ignored() -> None:
    e = engine(max_num_batched_tokens=256, max_num_seqs=8)
    e.add_request("a", 200, 50)
    e.add_request("b", 20, 50)
    e.step()
    assert e.kv_cache_usage() > 0
    e.abort_request("a")
    e.abort_request("b")
    e.abort_request("nope")
    assert not e.has_unfinished_requests()
    assert e.kv_cache_usage() == 0.0
    e.scheduler.check_invariants()


def test_add_request_validation_uses_vllm_wording() -> None:
    e = engine(blocks=100, max_model_len=1000)
    with pytest.raises(ValueError, match="maximum context length is 1000 tokens"):
        e.add_request("x", 900, 200)
    with pytest.raises(ValueError, match="at least one token"):
        e.add_request("x", 0, 10)
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request("x", 10, 0)
    e.add_request("x", 10, 10)
    with pytest.raises(ValueError, match="already running"):
        e.add_request("x", 10, 10)


def test_unreferenced_prefix_blocks_are_evicted_when_the_pool_runs_short() -> None:
    e = engine(blocks=40, max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=600)
    e.add_request("a", 200, 1, prefix_key="sys", prefix_tokens=160)  # caches 10 prefix blocks
    drain(e)
    assert len(e.scheduler.cache) == 10 and e.scheduler.num_evictable() == 10
    e.add_request("big", 560, 1)  # needs 35 of the 39 usable blocks: evicts 6 cached ones
    drain(e)
    e.scheduler.check_invariants()
    assert len(e.scheduler.cache) == 4
    # vLLM frees a request's blocks tail first, so eviction took prefix blocks 9..4: 0..3 still hit.
    assert sorted(k[1] for k in e.scheduler.cache) == [0, 1, 2, 3]
    e.add_request("b", 200, 1, prefix_key="sys", prefix_tokens=160)
    out = e.step()
    assert out.num_scheduled_tokens == 200 - 16 * 4
    drain(e)
    e.scheduler.check_invariants()


def test_prefix_caching_lowers_ttft_on_a_shared_system_prompt() -> None:
    from kvpilot.twin.offline import simulate

    cfg = EngineConfig.resolve(resolve_model("Llama-3.1-8B"), resolve_gpu("H100-80GB"), max_model_len=8192,
                       max_num_batched_tokens=2048, max_num_seqs=256)
    wl = "poisson:rate=8,prompt=200,output=50,prefix=3000,prefixes=2"
    on = simulate(cfg, wl, duration_s=30, seed=0)
    off = simulate(cfg.with_(enable_prefix_caching=False), wl, duration_s=30, seed=0)
    assert on.batch["prefix_cache_hit_rate"] > 0.8
    assert off.batch["prefix_cache_hit_rate"] == 0.0
    assert on.ttft_s["p50"] < off.ttft_s["p50"]


def test_prefill_schedule_interval_admits_new_requests_every_nth_step() -> None:
    # As vLLM's data-parallel engine core: steps count from when the engine went busy (step 1 is
    # on the cadence), and off the cadence new prefills wait while some request decodes.
    e = engine(max_num_batched_tokens=256, max_num_seqs=16, prefill_schedule_interval=3)
    seen: set[str] = set()
    admitted = []
    for step in range(1, 10):
        e.add_request(f"r{step}", 8, 20)
        ids = {o.request_id for o in e.step().outputs}
        if ids - seen:
            admitted.append((step, sorted(ids - seen)))
        seen |= ids
    assert admitted == [(1, ["r1"]), (4, ["r2", "r3", "r4"]), (7, ["r5", "r6", "r7"])]


def test_prefill_schedule_interval_holds_running_prefill_chunks_too() -> None:
    e = engine(max_num_batched_tokens=64, max_num_seqs=16, prefill_schedule_interval=2)
    e.add_request("decoder", 8, 50)
    e.step()  # step 1, on the cadence: admitted, samples its first token
    e.step()  # step 2: decodes
    e.add_request("long", 200, 5)
    out = e.step()  # step 3, on the cadence: "long" starts, chunked to what the budget leaves
    assert {o.request_id: o.num_computed_prompt_tokens for o in out.outputs} == {"decoder": 8, "long": 63}
    out = e.step()  # step 4, off the cadence: the chunk waits, the decode goes on
    assert [o.request_id for o in out.outputs] == ["decoder"]
    out = e.step()  # step 5: the next chunk
    assert {o.request_id: o.num_computed_prompt_tokens for o in out.outputs}["long"] == 126


def test_watermark_holds_blocks_back_only_while_requests_run() -> None:
    # vLLM applies the watermark only when something is already running; a prompt that needs
    # more than (pool - watermark) blocks must still start on an idle engine, not wait forever.
    e = engine(blocks=100, max_num_batched_tokens=2048, max_num_seqs=8, watermark=0.5)
    e.add_request("long", 1200, 2)  # 75 blocks of the 99 usable: more than 99 - 50
    out = e.step()
    assert [o.request_id for o in out.outputs] == ["long"]
    # With "long" running, a newcomer that fits the free blocks but not the watermark waits.
    e.add_request("next", 300, 2)  # 19 blocks; 99 - 76 = 23 free, 23 - 50 < 19
    out = e.step()
    assert "next" not in {o.request_id for o in out.outputs} and out.num_waiting == 1
    drain(e)
    e.scheduler.check_invariants()


def _preempt_then_readmit(enable_prefix_caching: bool) -> tuple[int, int]:
    """A (160-token prompt) and B (144) fill 19 of 20 usable blocks; A's first decode block
    preempts B.  Returns (preemptions, tokens B is scheduled when admitted again)."""
    e = engine(blocks=21, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=320,
               enable_prefix_caching=enable_prefix_caching)
    e.add_request("A", 160, 20)
    e.add_request("B", 144, 5)
    assert {o.request_id for o in e.step().outputs} == {"A", "B"}
    out = e.step()
    assert out.num_preemptions == 1 and [o.request_id for o in out.outputs] == ["A"]
    while True:
        e.scheduler.check_invariants()
        out = e.step()
        if any(o.request_id == "B" for o in out.outputs):
            drain(e)
            e.scheduler.check_invariants()
            return e.scheduler.num_preemptions_total, out.num_scheduled_tokens


def test_a_preempted_request_recomputes_only_its_evicted_blocks() -> None:
    # vLLM keeps a preempted request's computed full blocks in the prefix cache (freed tail
    # first); A's growth to 12 blocks evicts B's last block, so B re-hits 8 blocks (128 tokens)
    # and recomputes 145 - 128 = 17 tokens (its prompt and its first output token).
    assert _preempt_then_readmit(True) == (1, 17)
    # Without prefix caching it recomputes everything.
    assert _preempt_then_readmit(False) == (1, 145)


def test_cached_prefix_blocks_age_in_the_same_queue_as_every_freed_block() -> None:
    # vLLM's free queue is least-recently-freed first over all blocks: a prefix cached long ago
    # is evicted before blocks freed after it, even blocks nobody can hit again.
    e = engine(blocks=41, max_num_batched_tokens=1024, max_num_seqs=8, max_model_len=600)
    e.add_request("old", 160, 1, prefix_key="sys", prefix_tokens=160)  # caches 10 prefix blocks
    drain(e)
    e.add_request("filler", 480, 1)  # 30 blocks: the 30 never-used ones, then freed after "old"
    drain(e)
    e.add_request("big", 400, 1)  # 25 blocks: the 10 of the prefix go first, then 15 of filler's
    drain(e)
    assert len(e.scheduler.cache) == 0
    e.add_request("again", 160, 1, prefix_key="sys", prefix_tokens=160)
    assert e.step().num_scheduled_tokens == 160  # nothing left to hit
    e.scheduler.check_invariants()


def test_aborting_a_preempted_request_leaves_its_cached_blocks_evictable() -> None:
    e = engine(blocks=21, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=320)
    e.add_request("A", 160, 20)
    e.add_request("B", 144, 5)
    e.step()
    assert e.step().num_preemptions == 1  # B is back in the queue, its 9 blocks cached
    assert [r.request_id for r in e.scheduler.waiting] == ["B"]
    old_key = e.scheduler.waiting[0].own_key
    e.abort_request("B")
    e.scheduler.check_invariants()
    assert not e.scheduler.waiting and e.scheduler.num_evictable() == 9
    drain(e)  # A grows into B's old blocks, evicting them
    e.scheduler.check_invariants()
    assert e.scheduler.num_free_blocks() == e.scheduler.usable_blocks
    e.add_request("B", 144, 5)  # the id is free again and starts from scratch
    assert e.step().num_scheduled_tokens == 144
    # A request that reuses an id never hits blocks its namesake left cached.
    assert e.scheduler.running[0].own_key != old_key


def _decode_durations(step_jitter: float, steps: int = 400) -> list[float]:
    """Step times of one steady batch (8 requests decoding), so every step costs the model the same."""
    params = replace(params_for(resolve_gpu("L4")), step_jitter=step_jitter)
    e = engine(max_num_batched_tokens=256, max_num_seqs=8, step_time_params=params)
    for i in range(8):
        e.add_request(f"r{i}", prompt_tokens=16, max_tokens=steps + 2)
    e.step()  # the eight prompts
    return [e.step().duration_s for _ in range(steps)]


def test_step_jitter_is_a_seeded_lognormal_factor_of_mean_one() -> None:
    plain = _decode_durations(0.0)
    assert max(plain) / min(plain) < 1.05  # the same batch costs the model (nearly) the same every step
    jittered = _decode_durations(0.3)
    assert jittered == _decode_durations(0.3)  # the same draws in every engine: runs stay reproducible
    factors = np.array(jittered) / np.array(plain)
    assert abs(factors.mean() - 1.0) < 0.05  # the mean step, so throughput, is the model's
    assert 0.25 < np.log(factors).std() < 0.35
    # The tail is what the knob is for: the 99th-percentile step is about exp(2.33 * 0.3) = 2x the median.
    assert np.quantile(factors, 0.99) / np.median(factors) > 1.6
