"""The signals reader against a real Prometheus scraping two real `kvpilot twin serve` processes.

A Poisson load generator drives both twins; it records every request's TTFT and every
inter-token gap exactly (as clients clock them), and each twin logs its own TTFT per request.
Over a window that holds the whole run:

* the reader's p99 TTFT lies in the bucket that holds the twin's own exact p99 TTFT (what the
  histogram observed), and the p99 ITL in the bucket that holds the exact p99 of the gaps the
  load generator measured;
* the TTFT and ITL burn rates Prometheus computes match the exact error ratios of the requests
  and gaps the load generator saw, within 5%.

histogram_quantile picks the bucket where the cumulative count first reaches q * count, that is
the bucket of the observation of nearest rank ceil(q * n): the exact p99 here is that
observation.  SLO thresholds are chosen from the bucket edges after the run (they are only
query parameters) in a valley of each distribution, with 10-90% of the values above.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import statistics
import time

import pytest

from harness.prometheus import PrometheusServer
from harness.twin_process import twin_server
from kvpilot.api import vllm
from kvpilot.loadgen import LoadResult, run_load
from kvpilot.slo import promql
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.promql import Selector
from kvpilot.slo.signals import NoData, read_signals
from kvpilot.tuner.adapters.prometheus import PrometheusSignals, estimate_workload
from kvpilot.tuner.core.objective import SLO

pytestmark = pytest.mark.integration

JOB = "twin"
RATE_PER_TWIN = 5.0  # requests/s, Poisson
REQUESTS_PER_TWIN = 80
# An 8B model on an A10G: steps of tens of milliseconds, so the client's clock jitter on a busy
# CI machine (a few ms) is small against the latencies, and ITL spreads over several buckets.
TWIN_ARGS = ("--model", "Llama-3.1-8B", "--gpu", "A10G", "--max-model-len", "4096",
             "--max-num-batched-tokens", "512", "--max-num-seqs", "16")
OBJECTIVE = 0.99


def nearest_rank(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def bucket_of(value: float, edges: tuple[float, ...]) -> tuple[float, float]:
    """(lower, upper] of the histogram bucket holding `value` (le is inclusive)."""
    i = bisect.bisect_left(edges, value)
    lower = 0.0 if i == 0 else edges[i - 1]
    upper = edges[i] if i < len(edges) else math.inf
    return lower, upper


def valley_edge(values: list[float], edges: tuple[float, ...]) -> float:
    """A bucket edge with 10-90% of the values above it and as few as possible close to it.

    Client and server clock the same gap a few milliseconds apart; an edge in a valley of the
    distribution makes the comparison test the bucket arithmetic, not that jitter.
    """
    n = len(values)
    usable = [e for e in edges if 0.1 <= sum(v > e for v in values) / n <= 0.9]
    assert usable, f"no edge splits the values usefully: {sorted(values)[:: max(1, n // 10)]}"
    return min(usable, key=lambda e: (sum(abs(v - e) <= 0.15 * e for v in values),
                                      abs(sum(v > e for v in values) / n - 0.35)))


def twin_ttfts(twin) -> list[float]:  # type: ignore[no-untyped-def]
    return [float(r["ttft_s"]) for r in twin.log_records() if r.get("msg") == "request finished"]


async def _drive(urls: list[str]) -> list[LoadResult]:
    return list(
        await asyncio.gather(
            *(
                run_load(url, num_requests=REQUESTS_PER_TWIN, rate=RATE_PER_TWIN, seed=11 + i,
                         prompt_words=400, max_tokens=24, max_duration_s=90)
                for i, url in enumerate(urls)
            )
        )
    )


def test_reader_matches_what_the_load_generator_measured(tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = TWIN_ARGS
    with (
        twin_server(*args, log_dir=tmp_path, log_level="debug") as a,
        twin_server(*args, log_dir=tmp_path, log_level="debug") as b,
        PrometheusServer([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"], job=JOB) as prom,
    ):
        prom.wait_for_targets_up(2)
        sel = Selector.for_job(JOB)
        slo = SloTarget(namespace="local", name="twins", objective=OBJECTIVE, selector=sel)
        # Series exist (at zero) from the first scrape: before the load, there is no data, not zero latency.
        prom.wait_for(f"{vllm.METRIC_TTFT}_count{sel}")
        with pytest.raises(NoData):
            read_signals(sel, "30s", slo=slo, prometheus_url=prom.url)

        started = time.time()
        results = asyncio.run(_drive([a.base_url, b.base_url]))
        records = [r for res in results for r in res.records]
        ok = [r for r in records if r.ok]
        assert len(ok) == len(records) == 2 * REQUESTS_PER_TWIN, [r.error for r in records if not r.ok][:3]

        # Wait until both twins' final counts are scraped; evaluate at the newest of those samples.
        # The e2e count moves when a request finishes, so a scrape holding all of them also holds every
        # inter-token gap; the TTFT count is complete long before the last tokens and would let a scrape
        # from before the end through.
        count_q = f"sum({vllm.METRIC_E2E}_count{sel})"
        deadline = time.monotonic() + 20
        while float((prom.query(count_q) or [{"value": [0, "0"]}])[0]["value"][1]) < len(ok):
            assert time.monotonic() < deadline, "Prometheus did not scrape the final counts"
            time.sleep(0.2)
        at = max(float(r["value"][1]) for r in prom.query(f"timestamp({vllm.METRIC_E2E}_count{sel})"))
        window = f"{math.ceil(at - started) + 5}s"  # starts before the first request

        client_ttfts = [r.ttft for r in ok if r.ttft is not None]
        client_itls = [g for r in ok for g in r.itls]
        server_ttfts = twin_ttfts(a) + twin_ttfts(b)
        assert len(server_ttfts) == len(ok)
        ttft_edge = valley_edge(server_ttfts, vllm.TTFT_BUCKETS)
        itl_edge = valley_edge(client_itls, vllm.ITL_BUCKETS)
        slo = SloTarget(namespace="local", name="twins", ttft_seconds=ttft_edge, itl_seconds=itl_edge,
                        objective=OBJECTIVE, selector=sel)

        snap = read_signals(sel, window, slo=slo, prometheus_url=prom.url, at=at)
        # The warm start's estimate of the same load (its window ends now, after the last scrape).
        est = estimate_workload(PrometheusSignals(prom.url, selector=sel, slo=SLO()),
                                window_s=math.ceil(time.time() - started) + 5)

    # The sample count: every request, once (the window's end is a scrape, so no extrapolation past it).
    assert snap.samples == pytest.approx(len(ok), rel=0.03)
    assert snap.itl_samples == pytest.approx(len(client_itls), rel=0.03)

    exact_ttft_p99 = nearest_rank(server_ttfts, 0.99)
    assert snap.ttft_p99_seconds is not None
    lo, hi = bucket_of(exact_ttft_p99, vllm.TTFT_BUCKETS)
    assert lo <= snap.ttft_p99_seconds <= hi, (snap.ttft_p99_seconds, exact_ttft_p99, (lo, hi))

    exact_itl_p99 = nearest_rank(client_itls, 0.99)
    assert snap.itl_p99_seconds is not None
    lo, hi = bucket_of(exact_itl_p99, vllm.ITL_BUCKETS)
    assert lo <= snap.itl_p99_seconds <= hi, (snap.itl_p99_seconds, exact_itl_p99, (lo, hi))

    budget = 1 - OBJECTIVE
    exact_ttft_ratio = sum(t > ttft_edge for t in server_ttfts) / len(server_ttfts)
    client_ttft_ratio = sum(t > ttft_edge for t in client_ttfts) / len(client_ttfts)
    exact_itl_ratio = sum(g > itl_edge for g in client_itls) / len(client_itls)
    assert snap.ttft_burn_rate == pytest.approx(exact_ttft_ratio / budget, rel=0.05)
    assert snap.itl_burn_rate == pytest.approx(exact_itl_ratio / budget, rel=0.05)

    # The estimate's lengths have the mean the load sent (its usage counts), not the one of the
    # bucket midpoints the quantiles are interpolated from (~400-token prompts read a median of 350).
    sent = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    assert len(sent) == len(ok), "a response without its usage counts"
    sent_outputs = [r.completion_tokens or r.output_chunks for r in ok]
    for median, sigma, mean in ((est.prompt_median, est.prompt_sigma, statistics.fmean(sent)),
                                (est.output_median, est.output_sigma, statistics.fmean(sent_outputs))):
        assert median * math.exp(sigma * sigma / 2) == pytest.approx(mean, rel=0.03), (median, sigma, mean)

    # The rest of the snapshot is present and plausible.
    assert snap.time == at and snap.window == window
    assert snap.request_rate is not None and snap.request_rate > 0
    assert snap.generation_token_rate is not None and snap.prompt_token_rate is not None
    assert snap.generation_token_rate * promql.duration_seconds(window) == pytest.approx(
        sum(r.completion_tokens or r.output_chunks for r in ok), rel=0.05
    )
    assert snap.kv_cache_usage is not None and 0 <= snap.kv_cache_usage <= 1
    assert snap.preemption_rate is not None and snap.preemption_rate >= 0
    print(
        f"\nrequests={len(ok)} window={window} ttft_p99 prom={snap.ttft_p99_seconds:.4f} exact={exact_ttft_p99:.4f} "
        f"itl_p99 prom={snap.itl_p99_seconds:.4f} exact={exact_itl_p99:.4f} "
        f"ttft_burn prom={snap.ttft_burn_rate:.2f} exact={exact_ttft_ratio / budget:.2f} "
        f"client-clocked={client_ttft_ratio / budget:.2f} (T={ttft_edge}) "
        f"itl_burn prom={snap.itl_burn_rate:.2f} exact={exact_itl_ratio / budget:.2f} (T={itl_edge})"
    )
