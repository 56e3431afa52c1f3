"""Property tests of the V1 scheduler's invariants, driving the Engine API step by step."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model

SMALL = resolve_model("Qwen2.5-0.5B")
BLOCK_BYTES_16 = 16 * SMALL.kv_bytes_per_token()

request_st = st.tuples(
    st.integers(0, 30),  # arrival step
    st.integers(1, 300),  # prompt tokens
    st.integers(1, 40),  # max tokens
    st.sampled_from([None, "sys-a", "sys-b"]),  # shared prefix
    st.integers(0, 200),  # prefix tokens
    st.one_of(st.none(), st.integers(0, 60)),  # abort at this step (waiting, running or preempted)
)


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    blocks = draw(st.integers(30, 120))
    budget = draw(st.integers(16, 512))
    seqs = draw(st.integers(1, min(budget, 24)))
    config = EngineConfig.resolve(
        SMALL, resolve_gpu("L4"),
        kv_cache_memory_bytes=blocks * block_size * SMALL.kv_bytes_per_token(),
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_model_len=(blocks - 1) * block_size,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 24, 100])),
        long_prefill_token_threshold_adaptive=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.6])),
    )
    requests = draw(st.lists(request_st, min_size=1, max_size=25))
    return config, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_scheduler_invariants(scenario) -> None:
    config, requests = scenario
    engine = Engine(config)
    sched = engine.scheduler
    pending = sorted(
        [(step, f"r{i}", p, m, key, pt) for i, (step, p, m, key, pt, _) in enumerate(requests)], key=lambda r: r[0]
    )
    aborts = {f"r{i}": at for i, (*_, at) in enumerate(requests) if at is not None}
    aborted: set[str] = set()
    mml = engine.max_model_len
    arrival: dict[str, float] = {}
    first_sched: dict[str, float] = {}
    first_token: dict[str, float] = {}
    tokens: dict[str, int] = {}
    max_tokens: dict[str, int] = {}
    finished: set[str] = set()
    now = 0.0
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, p, m, key, pt = pending.pop(0)
            p = min(p, mml - 1)
            m = min(m, mml - p)
            engine.add_request(rid, p, m, now, prefix_key=key, prefix_tokens=pt)
            arrival[rid], max_tokens[rid], tokens[rid] = now, m, 0
        for rid, at in aborts.items():
            if at == step and rid in arrival and rid not in finished:
                engine.abort_request(rid)
                aborted.add(rid)
                sched.check_invariants()
        out = engine.step()
        end = now + out.duration_s
        # The token budget is never exceeded; no more than max_num_seqs run.
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert out.num_running <= config.max_num_seqs
        assert 0.0 <= out.kv_cache_usage <= 1.0
        # Blocks are never over-allocated, and cover every computed token.
        sched.check_invariants()
        for r in sched.running:
            assert r.num_blocks * config.block_size >= r.num_computed
        assert sum(o.num_computed_prompt_tokens >= 0 for o in out.outputs) == len(out.outputs)
        for o in out.outputs:
            rid = o.request_id
            assert rid not in finished, "a finished request was scheduled again"
            assert rid not in aborted, "an aborted request was scheduled again"
            assert o.new_token_count in (0, 1)
            first_sched.setdefault(rid, now)
            if o.new_token_count:
                assert o.num_computed_prompt_tokens == o.num_prompt_tokens  # never from a partial prefill
                tokens[rid] += 1
                first_token.setdefault(rid, end)
            if o.finished:
                assert o.finish_reason == "length"
                finished.add(rid)
        now = end
        step += 1
        assert step < 20000, "the engine stopped making progress"
    # Every request not aborted finished with exactly max_tokens tokens: none lost, none twice.
    assert finished == set(arrival) - aborted
    assert {r: tokens[r] for r in finished} == {r: max_tokens[r] for r in finished}
    for rid in finished:
        queue = first_sched[rid] - arrival[rid]
        ttft = first_token[rid] - arrival[rid]
        assert ttft >= queue >= 0.0
    assert sched.num_free == sched.usable_blocks  # everything given back


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2000), st.integers(1, 2000), st.integers(0, 4))
def test_offline_run_accounts_for_every_request(prompt_hi: int, output_hi: int, seed: int) -> None:
    from kvpilot.twin.offline import simulate
    from kvpilot.twin.workload import Workload

    config = EngineConfig.resolve(SMALL, resolve_gpu("L4"), max_model_len=4096, kv_cache_memory_bytes=2000 * BLOCK_BYTES_16,
                          max_num_batched_tokens=512, max_num_seqs=64)
    report = simulate(config, Workload.parse(f"gamma:rate=20,cv=3,prompt=1..{prompt_hi},output=1..{output_hi}"),
                      num_requests=40, seed=seed)
    assert report.num_completed == report.num_requests == 40
    assert report.ttft_s["p50"] <= report.e2e_s["p50"] + 1e-12
    assert report.queue_s["max"] <= report.ttft_s["max"] + 1e-12
    assert report.histograms["vllm:time_to_first_token_seconds"]["count"] == 40
