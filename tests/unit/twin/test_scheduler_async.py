"""The twin's scheduler under vLLM's asynchronous scheduling, and its free-block queue order.

The same behaviour is checked step by step against vLLM's own scheduler in tests/vllm; these
pin the mechanisms without needing real vLLM.
"""

from __future__ import annotations

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.scheduler import Request, Scheduler


def sched(**kw: object) -> Scheduler:
    args: dict = {"num_gpu_blocks": 64, "block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 1,
                  "enable_prefix_caching": False}
    args.update(kw)
    return Scheduler(**args)


def first_step_of(s: Scheduler, rid: str, limit: int = 50) -> int:
    for k in range(1, limit):
        if any(r.request_id == rid for r in s.step(k).scheduled):
            return k
    raise AssertionError(f"{rid} never scheduled")


def test_a_finishing_request_holds_its_slot_through_one_more_step_only_when_async() -> None:
    for async_scheduling, expected in ((False, 3), (True, 4)):
        s = sched(async_scheduling=async_scheduling)
        s.add(Request("a", 10, 2, 0.0))
        s.add(Request("b", 10, 1, 0.0))
        assert first_step_of(s, "b") == expected
        s.check_invariants()


def test_async_reports_the_finish_at_the_step_of_the_last_token() -> None:
    s = sched(async_scheduling=True)
    s.add(Request("a", 10, 2, 0.0))
    s.step(1)
    finished = s.step(2).finished
    assert [r.request_id for r in finished] == ["a"]
    assert s.only_finishing() and s.requests  # still holds its slot and blocks
    s.flush()
    assert not s.running and not s.requests and s.num_free_blocks() == 63
    s.check_invariants()


def test_engine_goes_idle_after_the_last_token_in_both_modes() -> None:
    model = resolve_model("Qwen2.5-0.5B")
    for async_scheduling in (False, True):
        e = Engine(EngineConfig.resolve(model, resolve_gpu("L4"), max_num_batched_tokens=64, max_num_seqs=4,
                                async_scheduling=async_scheduling))
        e.add_request("a", 100, 3)
        steps = 0
        while e.has_unfinished_requests():
            e.step()
            steps += 1
        assert steps == 4  # two chunks of 64 (the second samples), two decodes


def test_freed_blocks_without_a_hash_are_reused_first_with_prefix_caching() -> None:
    # 10 usable blocks, all held by "a" and "c": a 4-block shared prefix each plus a partial
    # block.  When they finish, the partial blocks (no hash) go to the FRONT of the free queue
    # and the prefix blocks to the back, so "b" (2 blocks) takes the partial ones and both
    # prefixes stay cached.  (At the back, "b" would have evicted one of "a"'s prefix blocks.)
    s = sched(num_gpu_blocks=11, max_num_seqs=4, enable_prefix_caching=True)
    s.add(Request("a", 72, 1, 0.0, "p", 4))
    s.add(Request("c", 72, 1, 0.0, "q", 4))
    finished = s.step(1).finished
    assert len(finished) == 2 and not s.running and s.num_free_blocks() == 10
    s.add(Request("b", 20, 1, 0.0))
    s.step(2)
    assert all((key, j) in s.cache for key in "pq" for j in range(4))
    s.check_invariants()


def test_a_prefix_block_computed_twice_is_cached_twice_and_either_copy_serves_hits() -> None:
    # vLLM caches every computed full block under its hash, even when another block with the
    # same hash is cached already; when one copy is evicted, the other still serves hits.
    s = sched(num_gpu_blocks=4, max_num_batched_tokens=64, max_num_seqs=2, long_prefill_token_threshold=16,
              enable_prefix_caching=True)
    a, b = Request("a", 33, 1, 0.0, "p", 2), Request("b", 33, 1, 0.0, "p", 2)
    s.add(a)
    s.add(b)
    s.step(1)  # a computes block 0; b hits it and computes block 1
    s.step(2)  # a computes its own copy of block 1 (b's stays cached); b is preempted for a block
    assert b.num_preemptions == 1 and len(s.copies[("p", 1)]) == 2
    s.step(3)  # a's last token takes b's copy of block 1 from the free queue: a's copy remains
    s.check_invariants()
    scheduled = s.step(4).scheduled
    assert [(r.request_id, r.sched) for r in scheduled] == [("b", -1)]  # both prefix blocks hit
    s.check_invariants()
