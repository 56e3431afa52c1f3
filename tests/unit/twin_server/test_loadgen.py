"""The load generator's bookkeeping: windows, exact fractions, percentiles, argument checks."""

from __future__ import annotations

from fractions import Fraction

import pytest

from harness.twin_process import free_port
from kvpilot.loadgen import LoadResult, RequestRecord, make_prompt, percentile, run_load_sync


def record(i: int, start: float, ttft: float | None, itls: list[float], ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, start=start, ok=ok, status=200 if ok else 503, ttft=ttft, itls=itls,
                         e2e=(ttft or 0) + sum(itls), output_chunks=len(itls) + 1 if ok else 0,
                         error=None if ok else "HTTP 503")


@pytest.fixture
def result() -> LoadResult:
    return LoadResult(records=[
        record(0, 0.0, 0.2, [0.01, 0.02]),
        record(1, 1.0, 0.6, [0.05, 0.07]),
        record(2, 2.0, 0.4, [0.03]),
        record(3, 3.0, None, [], ok=False),
    ], duration_s=4.0)


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)


def test_exact_ttft_fractions_count_failures_as_misses(result):
    assert result.fraction_ttft_at_most(0.5) == Fraction(2, 4)
    assert result.fraction_ttft_at_most(0.5, failures_count=False) == Fraction(2, 3)
    assert result.fraction_ttft_at_most(0.5, start_s=1.0, end_s=3.0) == Fraction(1, 2)
    assert result.fraction_ttft_at_most(0.5, start_s=10.0) is None


def test_exact_itl_fractions_over_every_gap(result):
    assert result.itls() == [0.01, 0.02, 0.05, 0.07, 0.03]
    assert result.fraction_itl_at_most(0.05) == Fraction(4, 5)
    assert result.fraction_itl_at_most(0.025, start_s=0.0, end_s=1.0) == Fraction(1, 1)


def test_summary(result):
    s = result.summary()
    assert (s["requests"], s["succeeded"], s["failed"]) == (4, 3, 1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.4) and s["ttft_s"]["max"] == pytest.approx(0.6)


def test_prompts_are_deterministic():
    assert make_prompt(3, 10) == make_prompt(3, 10) != make_prompt(4, 10)
    assert len(make_prompt(3, 10).split()) == 10


@pytest.mark.parametrize("kwargs", [{}, {"rate": 1.0, "concurrency": 2}, {"rate": 0.0}, {"concurrency": 0}])
def test_exactly_one_mode(kwargs):
    with pytest.raises(ValueError):
        run_load_sync("http://127.0.0.1:9", num_requests=1, **kwargs)


def test_unreachable_server_is_recorded_as_failures_not_raised():
    # nothing listens on a port just released: every request fails fast, the run still ends
    result = run_load_sync(f"http://127.0.0.1:{free_port()}", num_requests=3, concurrency=2,
                           max_duration_s=10)
    assert len(result.records) == 3 and not result.succeeded()
    assert all(r.error for r in result.records)


def test_cancelling_a_run_cancels_its_requests():
    import asyncio

    from aiohttp import web

    from kvpilot.loadgen import run_load

    async def main() -> tuple[int, int]:
        started = asyncio.Event()
        hanging = 0

        async def hang(request: web.Request) -> web.StreamResponse:
            nonlocal hanging
            hanging += 1
            started.set()
            await asyncio.sleep(3600)
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/completions", hang)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            run = asyncio.create_task(run_load(f"http://127.0.0.1:{port}", num_requests=5, concurrency=5))
            await asyncio.wait_for(started.wait(), 10)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            ours = ("_one_request", "open_loop", "closed_loop", "worker")
            others = [t for t in asyncio.all_tasks() if not t.done()
                      and getattr(t.get_coro(), "__name__", "") in ours]
            return hanging, len(others)
        finally:
            await runner.cleanup()

    hanging, left = asyncio.run(main())
    assert hanging >= 1 and left == 0
