"""Offline runs of the engine twin, in virtual time, and their report.

`simulate(config, workload, duration_s=..., seed=...)` replays a workload through an Engine with
a virtual clock: requests that arrived by the start of a step are queued before it (as vLLM's
engine core adds requests between steps), a step lasts what the step-time model says, and a
step's tokens exist at its end.  The report carries what vLLM's metrics and `vllm bench serve`
would show: TTFT, inter-token latency, end-to-end and queue time percentiles, throughput,
goodput under an SLO, preemptions, KV-cache usage, and histograms with vLLM's bucket edges.

This is the function the tuner calls thousands of times, so the loop keeps to plain Python
on the engine's fast path and leaves the statistics to numpy at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpilot.api import vllm as vllm_facts
from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.scheduler import Request
from kvpilot.twin.workload import RequestBatch, Workload


@dataclass(frozen=True, slots=True)
class SLO:
    ttft_s: float = 0.5
    itl_s: float = 0.05

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft=0.5,itl=0.05` (seconds; either may be left out)."""
        values: dict[str, float] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or key not in ("ttft", "itl"):
                raise ValueError(f"SLO {text!r}: use ttft=SECONDS,itl=SECONDS (e.g. ttft=0.5,itl=0.05)")
            try:
                v = float(value)
            except ValueError:
                raise ValueError(f"SLO {text!r}: {value!r} is not a number of seconds") from None
            if not v > 0:
                raise ValueError(f"SLO {text!r}: {key} must be positive")
            values[key + "_s"] = v
        return cls(**values)


def _stats(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    p50, p90, p99 = np.percentile(x, (50, 90, 99))
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(x.max())}


def _histogram(x: np.ndarray, edges: tuple[float, ...]) -> dict[str, Any]:
    """A Prometheus-style cumulative histogram: {"buckets": {le: count}, "count", "sum"}."""
    s = np.sort(x)
    cum = np.searchsorted(s, np.asarray(edges), side="right")
    buckets = {f"{e:g}": int(c) for e, c in zip(edges, cum, strict=True)}
    buckets["+Inf"] = int(len(s))
    return {"buckets": buckets, "count": int(len(s)), "sum": float(s.sum())}


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
            "slo": {"ttft_s": self.slo.ttft_s, "itl_s": self.slo.itl_s},
            "requests": {"total": self.num_requests, "completed": self.num_completed,
                         "unfinished": self.num_unfinished},
            "duration_s": self.duration_s, "makespan_s": self.makespan_s, "num_steps": self.num_steps,
            "num_gpu_blocks": self.num_gpu_blocks, "memory": self.memory,
            "ttft_s": self.ttft_s, "itl_s": self.itl_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
            "queue_s": self.queue_s, "throughput": self.throughput, "goodput": self.goodput,
            "num_preemptions": self.num_preemptions, "kv_cache_usage": self.kv_cache_usage, "batch": self.batch,
            "histograms": self.histograms, "wall_s": self.wall_s,
        }


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
    virtual time.

    Raises EngineStartupError (as vLLM would at start-up) for a configuration that cannot start.
    Prompt + output lengths are clipped to `max_model_len` (the output is shortened), as a
    benchmark client would size its requests.  The run stops at `max_sim_time_s` of virtual
    time (default: 3x the arrival window + 300 s); requests unfinished by then are counted in
    `num_unfinished` and are not good.
    """
    wall0 = time.perf_counter()
    if isinstance(workload, str):
        workload = Workload.parse(workload)
    slo = slo or SLO()
    engine = Engine(config)
    batch = workload if isinstance(workload, RequestBatch) else workload.generate(
        duration_s=duration_s, num_requests=num_requests, seed=seed)
    mml = engine.max_model_len
    arrivals = batch.arrival_s.tolist()
    prompts = np.minimum(batch.prompt_tokens, mml - 1)
    outputs = np.maximum(1, np.minimum(batch.output_tokens, mml - prompts)).tolist()
    prompts = prompts.tolist()
    keys = batch.prefix_keys
    ptoks = batch.prefix_tokens.tolist() if batch.prefix_tokens is not None else None
    n = len(arrivals)
    window = duration_s if duration_s is not None else (arrivals[-1] if n else 0.0)
    limit = max_sim_time_s if max_sim_time_s is not None else 3.0 * window + 300.0

    sched = engine.scheduler
    add = sched.add
    bs = config.block_size
    run = engine._run_step
    usable = sched.usable_blocks or 1
    # Indexed by engine step; steps count from 1, so index 0 is a placeholder.
    starts: list[float] = [0.0]
    ends: list[float] = [0.0]
    steadies: list[int] = [0]
    gaps: list[tuple[int, int]] = []
    done: list[Request] = []
    usage_area = 0.0
    usage_max = 0.0
    tokens_total = 0
    now = 0.0
    i = 0
    while True:
        while i < n and arrivals[i] <= now:
            if keys is not None and keys[i] and ptoks is not None:
                pk = keys[i]
                pb = min(ptoks[i], prompts[i]) // bs
                add(Request(str(i), prompts[i], outputs[i], arrivals[i], pk if pb else None, pb))
            else:
                add(Request(str(i), prompts[i], outputs[i], arrivals[i]))
            i += 1
        if not (sched.running or sched.waiting):
            if i >= n:
                break
            now = arrivals[i]
            continue
        if now >= limit:
            break
        duration, _scheduled, finished, _pre, tokens, steady, g = run()
        starts.append(now)
        now += duration
        ends.append(now)
        steadies.append(steady)
        tokens_total += tokens
        if g:
            gaps.extend(g)
        u = 1.0 - sched.num_free / usable
        usage_area += u * duration
        if u > usage_max:
            usage_max = u
        if finished:
            done.extend(finished)

    return _report(engine, config, workload, batch, seed, slo, window, n, done, starts, ends, steadies, gaps,
                   usage_area, usage_max, tokens_total, wall0)


def _report(engine: Engine, config: EngineConfig, workload: Workload | RequestBatch, batch: RequestBatch, seed: int,
            slo: SLO, window: float, n: int, done: list[Request], starts_l: list[float], ends_l: list[float],
            steadies_l: list[int], gaps_l: list[tuple[int, int]], usage_area: float, usage_max: float,
            tokens_total: int, wall0: float) -> Report:
    starts = np.asarray(starts_l, dtype=float)  # [0] is a placeholder (steps count from 1)
    ends = np.asarray(ends_l, dtype=float)
    makespan = float(ends[-1])
    busy = float((ends - starts).sum())
    m = len(done)
    arrival = np.fromiter((r.arrival_time for r in done), float, m)
    s_sched = np.fromiter((r.step_scheduled for r in done), np.int64, m)
    s_first = np.fromiter((r.step_first_token for r in done), np.int64, m)
    s_last = np.fromiter((r.step_last_token for r in done), np.int64, m)
    n_out = np.fromiter((r.num_output for r in done), np.int64, m)
    n_prompt = np.fromiter((r.prompt_tokens for r in done), np.int64, m)
    ttft = ends[s_first] - arrival if m else np.zeros(0)
    e2e = ends[s_last] - arrival if m else np.zeros(0)
    queue = starts[s_sched] - arrival if m else np.zeros(0)
    prefill = ends[s_first] - starts[s_sched] if m else np.zeros(0)
    decode = e2e - ttft
    multi = n_out > 1
    tpot = decode[multi] / (n_out[multi] - 1)

    steady = np.asarray(steadies_l, dtype=np.int64)
    step_itl = np.diff(ends, prepend=0.0)
    itl_parts = [np.repeat(step_itl, steady)]
    if gaps_l:
        g = np.asarray(gaps_l, dtype=np.int64)
        itl_parts.append(ends[g[:, 1]] - ends[g[:, 0]])
    itl = np.concatenate(itl_parts)

    good_mask = ttft <= slo.ttft_s
    req_tpot = np.zeros(m)
    req_tpot[multi] = tpot
    good_mask &= req_tpot <= slo.itl_s
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
            "ttft_attainment": float((ttft <= slo.ttft_s).mean()) if m else 1.0,
            "itl_attainment": float((itl <= slo.itl_s).mean()) if len(itl) else 1.0,
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


__all__ = ["SLO", "Report", "simulate"]
