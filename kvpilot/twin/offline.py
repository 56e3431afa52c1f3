# Over 500 lines: the virtual-time driver and its report read the same Trace, step by step.
"""Offline runs of the engine twin, in virtual time, and their report.

`drive(engine, batch)` is the one virtual-time loop (the tuner's capacity search drives it with
an early stop); `simulate(config, workload, duration_s=..., seed=...)` replays a workload through
it and reports.  The report carries what vLLM's metrics and `vllm bench serve`
would show: TTFT, inter-token latency, end-to-end and queue time percentiles, throughput,
goodput under an SLO, preemptions, KV-cache usage, and histograms with vLLM's bucket edges.

This is the function the tuner calls thousands of times, so the loop keeps to plain Python
on the engine's fast path and leaves the statistics to numpy at the end.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

from kvpilot.api import vllm as vllm_facts
from kvpilot.api.histogram import cumulative_counts, read_quantile
from kvpilot.api.slo import SLO
from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.frontend import ServingFrontend
from kvpilot.twin.scheduler import Request, StepOutcome
from kvpilot.twin.workload import RequestBatch, Workload


def _stats(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(x, (50, 90, 99))
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(x.max())}


def _histogram(x: np.ndarray, edges: tuple[float, ...]) -> dict[str, Any]:
    """A Prometheus-style cumulative histogram: {"buckets": {le: count}, "count", "sum"}."""
    cum = cumulative_counts(x, edges)
    buckets = dict(zip([*(f"{e:g}" for e in edges), "+Inf"], cum, strict=True))
    return {"buckets": buckets, "count": int(len(x)), "sum": float(np.sum(x))}


@dataclass
class Report:
    """What one offline run measured.  `as_dict()` is the JSON `kvpilot twin run` prints."""

    config: dict[str, Any]
    workload: dict[str, Any]
    seed: int
    slo: SLO
    num_requests: int
    num_completed: int
    num_unfinished: int
    duration_s: float  # the arrival window
    makespan_s: float  # virtual time until the last token
    num_steps: int
    num_gpu_blocks: int
    memory: dict[str, Any]
    ttft_s: dict[str, float]
    itl_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    queue_s: dict[str, float]
    throughput: dict[str, float]
    goodput: dict[str, float]
    num_preemptions: int
    kv_cache_usage: dict[str, float]
    batch: dict[str, float]
    histograms: dict[str, Any] = field(repr=False)
    wall_s: float = 0.0

    # Shortcuts the tuner reads.
    @property
    def ttft_p99(self) -> float:
        return self.ttft_s["p99"]

    @property
    def itl_p99(self) -> float:
        return self.itl_s["p99"]

    @property
    def goodput_rps(self) -> float:
        return self.goodput["requests_per_s"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config, "workload": self.workload, "seed": self.seed,
            "slo": {"ttft_s": self.slo.ttft_seconds, "itl_s": self.slo.itl_seconds},
            "requests": {"total": self.num_requests, "completed": self.num_completed,
                         "unfinished": self.num_unfinished},
            "duration_s": self.duration_s, "makespan_s": self.makespan_s, "num_steps": self.num_steps,
            "num_gpu_blocks": self.num_gpu_blocks, "memory": self.memory,
            "ttft_s": self.ttft_s, "itl_s": self.itl_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
            "queue_s": self.queue_s, "throughput": self.throughput, "goodput": self.goodput,
            "num_preemptions": self.num_preemptions, "kv_cache_usage": self.kv_cache_usage, "batch": self.batch,
            "histograms": self.histograms, "wall_s": self.wall_s,
        }


@dataclass
class Trace:
    """What one virtual-time run produced, before any statistics: the finished requests, each
    step's start and end, when its tokens reached the clients (`delivered`: its end, unless the
    device profile models the serving frontend as a server they wait for), its steady token gaps
    and its other gaps (as step indices), and, for a run stopped early, which p99 had certainly
    missed its SLO."""

    engine: Engine
    batch: RequestBatch
    window_s: float
    done: list[Request]
    starts: list[float]
    ends: list[float]
    steadies: list[int]
    gaps: list[tuple[int, int]]
    delivered: list[float] = field(default_factory=list)
    seen_gaps: list[float] | None = None  # see step_gaps
    in_system: list[int] = field(default_factory=lambda: [0])  # requests running or waiting after each step
    usage_area: float = 0.0
    usage_max: float = 0.0
    tokens_total: int = 0
    stopped: bool = False
    ttft_missed: bool = False
    itl_missed: bool = False


class _MissWatch:
    """`drive`'s early stop: more misses than 1% of what will be observed from `measure_from_s` on
    and that p99 cannot come back under the SLO."""

    __slots__ = ("slo_ttft", "slo_itl", "measure_from_s", "arrivals", "first_measured", "ttft_budget",
                 "itl_budget", "ttft_miss", "itl_miss", "delivered", "seen_gaps")

    def __init__(self, slo: SLO, measure_from_s: float, arrivals: list[float], outputs: list[int],
                 delivered: list[float], seen_gaps: list[float] | None) -> None:
        self.slo_ttft, self.slo_itl = slo.ttft_seconds, slo.itl_seconds
        self.measure_from_s = measure_from_s
        self.arrivals = arrivals
        measured = [i for i in range(len(arrivals)) if arrivals[i] >= measure_from_s]
        self.ttft_budget = int(0.01 * len(measured))
        self.first_measured = bisect_left(arrivals, measure_from_s)
        self.itl_budget = int(0.01 * sum(max(outputs[i] - 1, 0) for i in measured))
        self.ttft_miss = self.itl_miss = 0
        self.delivered = delivered  # when each step's tokens reached the clients
        self.seen_gaps = seen_gaps  # with the frontend as a server: the gap a client read before them

    def observe(self, k: int, outcome: StepOutcome) -> None:
        """Count step k's misses, once the time its tokens reached the clients is known."""
        delivered, slo_itl = self.delivered, self.slo_itl
        seen = delivered[k]
        for req in outcome.scheduled:
            if (req.step_first_token == k and req.arrival_time >= self.measure_from_s
                    and seen - req.arrival_time > self.slo_ttft):
                self.ttft_miss += 1
        if (self.seen_gaps[k] if self.seen_gaps is not None else seen - delivered[k - 1]) > slo_itl:
            self.itl_miss += outcome.num_steady
        for a, b in outcome.gaps:
            if delivered[b] - delivered[a] > slo_itl:
                self.itl_miss += 1

    def count_late(self, now: float, waiting: Iterable[Request], num_added: int, frontend: bool) -> None:
        """Requests still waiting for their first token longer than the SLO are misses already."""
        slo_ttft, measure_from_s = self.slo_ttft, self.measure_from_s
        late = sum(1 for r in waiting if r.arrival_time >= measure_from_s and now - r.arrival_time > slo_ttft)
        if frontend:  # and those the frontend has not handed to the scheduler yet
            late += max(0, bisect_right(self.arrivals, now - slo_ttft, lo=num_added)
                        - max(num_added, self.first_measured))
        if self.ttft_miss + late > self.ttft_budget:
            self.ttft_miss += late

    @property
    def ttft_missed(self) -> bool:
        return self.ttft_miss > self.ttft_budget

    @property
    def itl_missed(self) -> bool:
        return self.itl_miss > self.itl_budget


class _Sends:
    """A request batch as `drive` sends it: plain lists, prompt + output lengths clipped to
    `max_model_len` (the output is shortened), as a benchmark client sizes its requests."""

    __slots__ = ("arrivals", "prompts", "outputs", "prefix_keys", "prefix_tokens", "block_size")

    def __init__(self, batch: RequestBatch, max_model_len: int, block_size: int) -> None:
        prompts = np.minimum(batch.prompt_tokens, max_model_len - 1)
        self.outputs: list[int] = np.maximum(1, np.minimum(batch.output_tokens, max_model_len - prompts)).tolist()
        self.prompts: list[int] = prompts.tolist()
        self.arrivals: list[float] = batch.arrival_s.tolist()
        self.prefix_keys = batch.prefix_keys
        self.prefix_tokens = batch.prefix_tokens.tolist() if batch.prefix_tokens is not None else None
        self.block_size = block_size

    def request(self, i: int) -> Request:
        """The i-th request, as the engine's scheduler takes it."""
        keys, prefix_tokens, prompt_tokens = self.prefix_keys, self.prefix_tokens, self.prompts[i]
        if keys is not None and keys[i] and prefix_tokens is not None:
            prefix_blocks = min(prefix_tokens[i], prompt_tokens) // self.block_size
            return Request(str(i), prompt_tokens, self.outputs[i], self.arrivals[i],
                           keys[i] if prefix_blocks else None, prefix_blocks)
        return Request(str(i), prompt_tokens, self.outputs[i], self.arrivals[i])


def drive(engine: Engine, batch: RequestBatch, *, window_s: float | None = None, max_sim_time_s: float | None = None,
          stop_on_miss: SLO | None = None, measure_from_s: float = 0.0) -> Trace:
    """Serve a request batch through `engine` on a virtual clock: requests that arrived by the start
    of a step are queued before it (as vLLM's engine core adds requests between steps), a step lasts
    what the step-time model says, and a step's tokens exist at its end.  A request arrives at the
    engine `frontend_s` (of the step-time constants) after it is sent.  Where the constants model the
    serving frontend as a server (`ServingFrontend`), requests wait for it to admit them and each
    step's tokens for it to stream them, in time order; TTFT and token gaps are then read at the
    clients (`Trace.delivered`), not at the step ends.

    Prompt + output lengths are clipped to `max_model_len` (the output is shortened), as a benchmark
    client sizes its requests.  The run stops at `max_sim_time_s` of virtual time (default: 3x the
    arrival window + 300 s).  With `stop_on_miss`, it also stops as soon as more than 1% of the
    TTFTs or token gaps observed from `measure_from_s` on (a warm-up excluded) already missed the
    SLO: that p99 cannot come back under it, and over-capacity runs, whose queues grow without
    bound, are the slow ones.
    """
    sends = _Sends(batch, engine.max_model_len, engine.config.block_size)
    arrivals, num_requests = sends.arrivals, len(batch)
    window = window_s if window_s is not None else (arrivals[-1] if num_requests else 0.0)
    limit = max_sim_time_s if max_sim_time_s is not None else 3.0 * window + 300.0
    scheduler, run_step, add = engine.scheduler, engine.run_step, engine.scheduler.add
    lag, usable = engine.config.async_scheduling, scheduler.usable_blocks or 1
    # Indexed by engine step; steps count from 1, so index 0 is a placeholder.
    trace = Trace(engine, batch, float(window), [], [0.0], [0.0], [0], [])
    starts, ends, steadies, gaps, done = trace.starts, trace.ends, trace.steadies, trace.gaps, trace.done
    params = engine.step_model.params
    frontend = ServingFrontend(params, arrivals, sends.prompts) if params.frontend_queues else None
    if frontend is not None:
        ready, num_admitted = frontend.ready, 0
        trace.delivered, trace.seen_gaps = frontend.delivered, frontend.seen_gaps
    else:  # every request's ready time is known: its send plus the frontend's latency (frontend_s)
        delay = params.frontend_s
        ready, num_admitted = [a + delay for a in arrivals] if delay else arrivals, num_requests
        trace.delivered = ends
    watch = None if stop_on_miss is None else _MissWatch(
        stop_on_miss, measure_from_s, arrivals, sends.outputs, trace.delivered, trace.seen_gaps)
    if frontend is not None and watch is not None:
        frontend.observe = watch.observe
    in_system = trace.in_system
    usage_area, usage_max, tokens_total, now = 0.0, 0.0, 0, 0.0
    num_added = 0  # requests handed to the scheduler, in send order
    while True:
        if frontend is not None:
            frontend.catch_up(now)
            num_admitted = frontend.num_admitted
        # Async scheduling: the step about to run was scheduled when the previous one started, so it
        # takes in only the requests that had reached the engine by then (vLLM's engine core reads its
        # input queue between schedule() calls); an idle engine schedules what arrives at once.
        cutoff = starts[-1] if lag and ends[-1] == now and (scheduler.running or scheduler.waiting) else now
        while num_added < num_admitted and ready[num_added] <= cutoff:
            add(sends.request(num_added))
            num_added += 1
        if not (scheduler.running or scheduler.waiting):
            if frontend is not None and frontend.pending:  # no step will join the waiting round
                frontend.close_round(frontend.round_start)  # it is streamed when the server frees
                continue
            if num_added >= num_requests:
                break
            # Idle: on to the next request's readiness (its send, where the frontend has not seen it yet).
            now = ready[num_added] if num_added < num_admitted else arrivals[num_added]
            continue
        if now >= limit:
            break
        outcome = run_step()
        duration = outcome.duration_s
        starts.append(now)
        now += duration
        ends.append(now)
        k = len(ends) - 1
        if frontend is not None:
            frontend.stream(k, now, outcome)
        steadies.append(outcome.num_steady)
        in_system.append(len(scheduler.running) + len(scheduler.waiting))
        tokens_total += outcome.total_num_scheduled_tokens
        new_gaps = outcome.gaps
        if new_gaps:
            gaps.extend(new_gaps)
        usage = 1.0 - scheduler.num_free / usable
        usage_area += usage * duration
        if usage > usage_max:
            usage_max = usage
        finished = outcome.finished
        if finished:
            done.extend(finished)
        if watch is not None and now >= measure_from_s:
            if frontend is not None and frontend.pending:  # its misses are known once its round is streamed
                frontend.pending_obs.append((k, outcome))
            else:
                watch.observe(k, outcome)
            if not k % 32:
                watch.count_late(now, scheduler.waiting, num_added, frontend is not None)
            if watch.ttft_missed or watch.itl_missed:
                trace.stopped = True
                trace.ttft_missed, trace.itl_missed = watch.ttft_missed, watch.itl_missed
                break
    if frontend is not None:
        frontend.finish()
    trace.usage_area, trace.usage_max, trace.tokens_total = usage_area, usage_max, tokens_total
    return trace


def step_gaps(trace: Trace) -> np.ndarray:
    """The gap a client reads before each step's tokens, by step: the time since the previous
    delivery of tokens, or, where the frontend streamed several steps' tokens in one round, that
    round's gap spread over its steps (a client reading k tokens in one event counts k gaps of a
    k-th of its wait, as vLLM's benchmark clients do)."""
    if trace.seen_gaps is not None:
        return np.asarray(trace.seen_gaps, dtype=float)
    return np.diff(np.asarray(trace.delivered, dtype=float), prepend=0.0)


def _p99(x: np.ndarray, independent: int, confidence: float | None) -> float:
    """The p99 of `x`; with `confidence`, an upper confidence bound of it: the quantile at
    0.99 + z * sqrt(0.99 * 0.01 / n) for n independent observations (the order statistic's
    normal approximation), so a p99 measured on a finite run is not read as better than it is."""
    if not len(x):
        return 0.0
    q = 0.99
    if confidence is not None and independent > 0:
        q = min(0.99 + NormalDist().inv_cdf(confidence) * math.sqrt(0.99 * 0.01 / independent), 1.0)
    return float(np.quantile(x, q))


def observed_samples(trace: Trace, measure_from_s: float = 0.0) -> tuple[np.ndarray, np.ndarray, int]:
    """The TTFTs of the requests that arrived from `measure_from_s` on (those still running with a
    first token included), the token gaps that ended from then on, and how many engine steps those
    gaps came from."""
    ends = np.asarray(trace.delivered, dtype=float)
    reqs = [r for r in trace.done if r.arrival_time >= measure_from_s]
    live = [r for r in trace.engine.scheduler.running if r.arrival_time >= measure_from_s and r.step_first_token]
    firsts = np.fromiter((ends[r.step_first_token] - r.arrival_time for r in (*reqs, *live)), float)
    step_itl = step_gaps(trace)
    keep = ends >= measure_from_s
    parts = [np.repeat(step_itl[keep], np.asarray(trace.steadies, dtype=np.int64)[keep])]
    if trace.gaps:
        g = np.asarray(trace.gaps, dtype=np.int64)
        gap_ends = ends[g[:, 1]]
        parts.append((gap_ends - ends[g[:, 0]])[gap_ends >= measure_from_s])
    return firsts, np.concatenate(parts), int(keep.sum())


def observed_p99(trace: Trace, measure_from_s: float = 0.0, *,
                 confidence: float | None = None) -> tuple[float, float]:
    """(p99 TTFT, p99 inter-token latency) of the requests that arrived from `measure_from_s` on;
    inf for a p99 that the run stopped early on (it had certainly missed its SLO).  With
    `confidence` (e.g. 0.95), upper confidence bounds of the two p99s: TTFTs are one observation
    per request, but every token gap of a step has that step's length, so the token gaps count as
    one independent observation per engine step."""
    firsts, itl, steps = observed_samples(trace, measure_from_s)
    ttft = np.inf if trace.ttft_missed else _p99(firsts, len(firsts), confidence)
    if trace.itl_missed:
        return ttft, np.inf
    return ttft, _p99(itl, steps, confidence)


def read_p99(trace: Trace, measure_from_s: float = 0.0) -> tuple[float, float]:
    """(p99 TTFT, p99 inter-token latency) as the live tuner reads them: `histogram_quantile(0.99,
    ...)` over vLLM's bucket edges (`kvpilot.api.histogram`), not the samples' own p99.  Inside a
    bucket the two differ by up to the bucket's width (a p99 ITL anywhere in 10-25 ms reads by how
    the gaps split around the rank), and a prediction of the live objective must differ from it by
    the engine, not by the reading.  A run stopped early reads inf on the axis it missed."""
    firsts, itl, _ = observed_samples(trace, measure_from_s)
    ttft = np.inf if trace.ttft_missed else _read99(firsts, vllm_facts.TTFT_BUCKETS)
    if trace.itl_missed:
        return ttft, np.inf
    return ttft, _read99(itl, vllm_facts.ITL_BUCKETS)


@dataclass(frozen=True)
class Latencies:
    """Each finished request's send time, TTFT and end-to-end latency (seconds, at the clients),
    output tokens, and its index in the batch."""

    index: np.ndarray
    arrival: np.ndarray
    ttft: np.ndarray
    e2e: np.ndarray
    num_output: np.ndarray


def request_latencies(trace: Trace) -> Latencies:
    done, m = trace.done, len(trace.done)
    seen = np.asarray(trace.delivered, dtype=float)
    arrival = np.fromiter((r.arrival_time for r in done), float, m)
    s_first = np.fromiter((r.step_first_token for r in done), np.int64, m)
    s_last = np.fromiter((r.step_last_token for r in done), np.int64, m)
    return Latencies(
        index=np.fromiter((int(r.request_id) for r in done), np.int64, m),
        arrival=arrival,
        ttft=seen[s_first] - arrival if m else np.zeros(0),
        e2e=seen[s_last] - arrival if m else np.zeros(0),
        num_output=np.fromiter((r.num_output for r in done), np.int64, m),
    )


def _read99(x: np.ndarray, edges: tuple[float, ...]) -> float:
    return read_quantile(0.99, x, edges) if len(x) else 0.0


def simulate(
    config: EngineConfig,
    workload: Workload | RequestBatch | str,
    *,
    duration_s: float | None = None,
    num_requests: int | None = None,
    seed: int = 0,
    slo: SLO | None = None,
    max_sim_time_s: float | None = None,
) -> Report:
    """Run a workload (a Workload, its spec string, or a RequestBatch) through the twin in
    virtual time (`drive`) and report on it.

    Raises EngineStartupError (as vLLM would at start-up) for a configuration that cannot start.
    Requests unfinished when the run stops are counted in `num_unfinished` and are not good.
    """
    wall0 = time.perf_counter()
    if isinstance(workload, str):
        workload = Workload.parse(workload)
    slo = slo or SLO()
    engine = Engine(config)
    batch = workload if isinstance(workload, RequestBatch) else workload.generate(
        duration_s=duration_s, num_requests=num_requests, seed=seed)
    trace = drive(engine, batch, window_s=duration_s, max_sim_time_s=max_sim_time_s)
    return _report(trace, config, workload, seed, slo, wall0)


def _report(trace: Trace, config: EngineConfig, workload: Workload | RequestBatch, seed: int, slo: SLO,
            wall0: float) -> Report:
    engine, batch, window, done = trace.engine, trace.batch, trace.window_s, trace.done
    n = len(batch)
    usage_area, usage_max, tokens_total = trace.usage_area, trace.usage_max, trace.tokens_total
    starts = np.asarray(trace.starts, dtype=float)  # [0] is a placeholder (steps count from 1)
    ends = np.asarray(trace.ends, dtype=float)
    seen = np.asarray(trace.delivered, dtype=float)  # when each step's tokens reached the clients
    makespan = float(seen[-1])
    busy = float((ends - starts).sum())
    m = len(done)
    lat = request_latencies(trace)
    arrival, ttft, e2e, n_out = lat.arrival, lat.ttft, lat.e2e, lat.num_output
    s_sched = np.fromiter((r.step_scheduled for r in done), np.int64, m)
    s_first = np.fromiter((r.step_first_token for r in done), np.int64, m)
    n_prompt = np.fromiter((r.prompt_tokens for r in done), np.int64, m)
    queue = starts[s_sched] - arrival if m else np.zeros(0)
    prefill = ends[s_first] - starts[s_sched] if m else np.zeros(0)
    decode = e2e - ttft
    multi = n_out > 1
    tpot = decode[multi] / (n_out[multi] - 1)

    steady = np.asarray(trace.steadies, dtype=np.int64)
    step_itl = step_gaps(trace)
    itl_parts = [np.repeat(step_itl, steady)]
    if trace.gaps:
        g = np.asarray(trace.gaps, dtype=np.int64)
        itl_parts.append(seen[g[:, 1]] - seen[g[:, 0]])
    itl = np.concatenate(itl_parts)

    good_mask = ttft <= slo.ttft_seconds
    req_tpot = np.zeros(m)
    req_tpot[multi] = tpot
    good_mask &= req_tpot <= slo.itl_seconds
    good = int(good_mask.sum())
    span = makespan if makespan > 0 else 1.0
    out_tokens = int(n_out.sum())
    in_tokens = int(n_prompt.sum())
    sched = engine.scheduler
    num_steps = len(ends) - 1
    hist = {
        vllm_facts.METRIC_TTFT: _histogram(ttft, vllm_facts.TTFT_BUCKETS),
        vllm_facts.METRIC_ITL: _histogram(itl, vllm_facts.ITL_BUCKETS),
        vllm_facts.METRIC_E2E: _histogram(e2e, vllm_facts.REQUEST_LATENCY_BUCKETS),
        vllm_facts.METRIC_QUEUE: _histogram(queue, vllm_facts.REQUEST_LATENCY_BUCKETS),
        vllm_facts.METRIC_PREFILL: _histogram(prefill, vllm_facts.REQUEST_LATENCY_BUCKETS),
        vllm_facts.METRIC_DECODE: _histogram(decode, vllm_facts.REQUEST_LATENCY_BUCKETS),
    }
    wl = workload.describe() if isinstance(workload, Workload) else {"arrival": "batch", "requests": len(batch)}
    return Report(
        config=config.as_dict(),
        workload=wl,
        seed=seed,
        slo=slo,
        num_requests=n,
        num_completed=m,
        num_unfinished=n - m,
        duration_s=float(window),
        makespan_s=makespan,
        num_steps=num_steps,
        num_gpu_blocks=engine.num_gpu_blocks,
        memory=engine.memory.as_dict(),
        ttft_s=_stats(ttft),
        itl_s=_stats(itl),
        tpot_s=_stats(tpot),
        e2e_s=_stats(e2e),
        queue_s=_stats(queue),
        throughput={
            "requests_per_s": m / span,
            "output_tokens_per_s": out_tokens / span,
            "total_tokens_per_s": (out_tokens + in_tokens) / span,
        },
        goodput={
            "requests_per_s": good / span,
            "good_fraction": good / n if n else 1.0,
            "ttft_attainment": float((ttft <= slo.ttft_seconds).mean()) if m else 1.0,
            "itl_attainment": float((itl <= slo.itl_seconds).mean()) if len(itl) else 1.0,
        },
        num_preemptions=sched.num_preemptions_total,
        kv_cache_usage={"mean": usage_area / busy if busy else 0.0, "max": usage_max},
        batch={
            "mean_tokens_per_step": tokens_total / num_steps if num_steps else 0.0,
            "busy_fraction": busy / span if makespan else 0.0,
            "prefix_cache_hit_rate": (sched.prefix_hit_tokens / sched.prefix_query_tokens
                                      if sched.prefix_query_tokens else 0.0),
        },
        histograms=hist,
        wall_s=time.perf_counter() - wall0,
    )


__all__ = ["SLO", "Latencies", "Report", "Trace", "drive", "request_latencies", "observed_p99", "observed_samples", "read_p99", "simulate"]
