"""A CPU's device profile fitted on a served vLLM: `kvpilot twin calibrate`.

The twin has no preset for a CPU, so it gets a profile fitted on observations of the served engine
as clients meet it (benchmarks/twin_vs_vllm.py --calibrate measures them through vLLM's HTTP API and
writes them as JSON):

    {"peaks": {"bf16_flops": ..., "hbm_bandwidth": ..., "threads": ...},   # measured with vLLM's torch
     "budget": 1024,                                  # the server's --max-num-batched-tokens
     "step_jitter": {"sigma": ..., "steps": ..., "p50_to_p99": ...},       # `step_jitter` of vLLM's step log
     "observations": [{"kind": "decode" | "prefill" | "burst" | "mixed", "seconds": ..., "all": [...],
                       "n": ..., "prompt": ..., "steps": [[tokens, requests, prefill_pairs, kv_tokens], ...],
                       "stat": ..., "tokens": ..., "meter": {<vLLM's counters and CPU seconds>}}, ...]}

`calibrate` fits the twin's step-time constants (`FITTED`) to the observations (Nelder-Mead on their logs,
`kvpilot.twin.calibration.fit`), the frontend server's four costs measured from the meters where the
observations have them (`frontend_costs`), and the step jitter from vLLM's own log; `report` prints the
fit's error on every observation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvpilot.twin.calibration.fit import fit_loss, log_error_loss
from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import GiB, GpuSpec
from kvpilot.twin.models import ModelSpec
from kvpilot.twin.offline import drive, step_gaps
from kvpilot.twin.profiles import DeviceProfile, read_json
from kvpilot.twin.steptime import StepTimeModel, StepTimeParams
from kvpilot.twin.workload import RequestBatch

# The served engine's flags, in the calibration and in the twin that is fitted to it.
KV_CACHE_GIB = 1.0
MAX_NUM_SEQS = 64
MAX_MODEL_LEN = 4096
BLOCK_SIZE = 128  # vLLM's default block size on CPU
CAL_BUDGET = 1024  # --max-num-batched-tokens
# A burst's requests' prompt tokens.
BURST_PROMPT = 16
# A mixed observation's prompt arrives MIXED_AT s after its decoders, which ask for MIXED_DECODE_TOKENS each.
MIXED_AT = 0.15
MIXED_DECODE_TOKENS = 160
# The constants the fit moves (the shape constants of the GEMM roofline keep their calibrated values).
FITTED: tuple[str, ...] = (
    "gemm_compute_eff", "gemm_memory_eff", "gemm_floor_s", "elementwise_floor_s", "attn_prefill_eff",
    "attn_decode_eff", "attn_floor_s", "cpu_overhead_s", "cpu_per_request_s", "engine_request_s", "frontend_s",
    "frontend_request_s", "frontend_step_s", "frontend_token_s")


class CalibrationError(ValueError):
    """Observations that cannot be fitted; the message says why."""


Z99 = 2.3263478740408408  # the standard normal's 0.99 quantile


def step_jitter(steps: list[tuple[int, int, int, float]], min_steps: int = 20) -> dict[str, float]:
    """The spread of one batch's step time, from vLLM's own log of the decode batches: each steady
    decode step's log time less the median of its batch size's (groups of `min_steps` or more), and
    the lognormal sigma whose 99th percentile is theirs (the tail is what the p99 token gap sees)."""
    groups: dict[int, list[float]] = {}
    for ctx_reqs, _, gen_reqs, elapsed in steps:
        if ctx_reqs == 0 and gen_reqs > 0 and elapsed > 0:
            groups.setdefault(gen_reqs, []).append(float(np.log(elapsed)))
    z = np.concatenate([np.asarray(v) - np.median(v) for v in groups.values() if len(v) >= min_steps] or [np.zeros(0)])
    if len(z) < 100:
        return {"sigma": 0.0, "steps": float(len(z))}
    return {"sigma": float(np.quantile(z, 0.99) / Z99), "steps": float(len(z)),
            "p50_to_p99": float(np.exp(np.quantile(z, 0.99)))}


def cpu_device(peaks: dict[str, float]) -> GpuSpec:
    # The host's memory stands in for the GPU's (the KV cache is sized by VLLM_CPU_KVCACHE_SPACE).
    return GpuSpec("vllm-cpu (this host)", 24 * GiB, float(peaks["bf16_flops"]), float(peaks["hbm_bandwidth"]),
                   0.0, architecture="cpu")


def twin_config(model: Any, device: GpuSpec, params: StepTimeParams, budget: int) -> EngineConfig:
    """The twin engine of the replay and the calibration: the flags real vLLM gets, on the fitted device."""
    return EngineConfig(model=model, gpu=device, max_num_batched_tokens=budget,
                        max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=None,
                        kv_cache_memory_bytes=int(KV_CACHE_GIB * GiB), block_size=BLOCK_SIZE,
                        async_scheduling=False, step_time_params=params)


def simulate(model: Any, device: GpuSpec, params: StepTimeParams, o: dict[str, Any]) -> float:
    """A burst or mixed observation as the twin serves it (offline.drive, the frontend as a server),
    read as it is read from vLLM's streams."""
    config = twin_config(model, device, params, CAL_BUDGET)
    n = int(o["n"])
    if o["kind"] == "mixed":
        batch = RequestBatch(np.array([0.0] * n + [MIXED_AT]), np.array([BURST_PROMPT] * n + [int(o["prompt"])]),
                             np.array([MIXED_DECODE_TOKENS] * n + [2]))
        trace = drive(Engine(config), batch, max_sim_time_s=1e6)
        seen = np.asarray(trace.delivered)
        long = next(r for r in trace.done if r.arrival_time == MIXED_AT)
        # Every decoder decodes in every step here: their gaps are the gaps between steps' deliveries,
        # a round's spread over its steps as _token_times spreads a chunk's tokens.
        gaps = step_gaps(trace)[1:]
        ends = seen[1:]
        inside = (ends > MIXED_AT) & (ends <= seen[long.step_first_token] + 1e-9)
        return float(np.max(gaps[inside], initial=0.0))
    batch = RequestBatch(np.zeros(n), np.full(n, int(o["prompt"])), np.full(n, int(o["tokens"])))
    trace = drive(Engine(config), batch, max_sim_time_s=1e6)
    at = trace.delivered
    if o["stat"] == "makespan":
        return float(max(at[r.step_last_token] for r in trace.done))
    return float(np.median([at[r.step_first_token] for r in trace.done]))


def predict(model: Any, device: GpuSpec, params: StepTimeParams, obs: list[dict[str, Any]]) -> np.ndarray:
    """Each observation's seconds as the twin has them.  A decode gap (the mean over a batch's stream):
    its step's time (the engine's step_time, every scheduled request sampling), or the frontend's
    cost of a step where that is longer (its cost per token is paid once per round of steps).  A lone prompt's
    TTFT: its admission, the engine's intake of it, its prefill steps, the streaming of its token, and
    the frontend's latency.
    A burst or a mixed step: served by the twin."""
    stm = StepTimeModel(model, device, 1, params)
    out = []
    for o in obs:
        if o["kind"] in ("burst", "mixed"):
            out.append(simulate(model, device, params, o))
            continue
        steps = [stm.step_time(int(t), int(n), int(n), p, int(kv)) for t, n, p, kv in o["steps"]]
        if o["kind"] == "decode":
            # A frontend slower than the engine streams several steps' tokens at once (offline.drive's
            # output rounds), so a long batch's mean gap is the step's unless a step's own cost is more.
            out.append(max(sum(steps), params.frontend_step_s))
        else:
            out.append(sum(steps) + params.engine_request_s + params.frontend_s + params.frontend_request_s
                       + params.frontend_step_s + params.frontend_token_s
                       + params.frontend_prompt_token_s * int(o["prompt"]))
    return np.array(out)


# The frontend's costs, each the CPU seconds of one unit of a vLLM counter (COUNTERS).
COST_OF = {"requests": "frontend_request_s", "steps": "frontend_step_s", "tokens": "frontend_token_s",
           "prompt_tokens": "frontend_prompt_token_s"}


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one is held at 0 and the rest refitted."""
    free = np.ones(a.shape[1], dtype=bool)
    while True:
        x = np.zeros(a.shape[1])
        x[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (x >= 0).all():
            return x
        free &= x > 0


def frontend_costs(obs: list[dict[str, Any]]) -> dict[str, float] | None:
    """The frontend server's costs measured, not fitted: the CPU seconds the API server and this client
    (one core's two processes) spent over each metered block of calibration requests, regressed on
    vLLM's own counts of requests, steps, generated and prompt tokens in it, plus a per-second term
    for what they spend idle and a per-block one (the /metrics read that closes it), in relative
    errors, so each block counts alike.  None without meters (a served.json measured before them)."""
    rows = [o["meter"] for o in obs if "meter" in o]
    if len(rows) < 2 * (len(COST_OF) + 2):
        return None
    a = np.array([[r[k] for k in COST_OF] + [r["wall_s"], 1.0] for r in rows])
    b = np.array([r["api_server_s"] + r["client_s"] for r in rows])
    x = _nnls(a / b[:, None], np.ones(len(b)))
    costs = {COST_OF[k]: float(f"{v:.4g}") for k, v in zip(COST_OF, x[:len(COST_OF)], strict=True)}
    costs["idle"], costs["per_block"] = float(f"{x[-2]:.4g}"), float(f"{x[-1]:.4g}")
    costs["median_error"] = float(np.median(np.abs(a @ x / b - 1.0)))
    return costs


def fit_params(model: Any, device: GpuSpec, obs: list[dict[str, Any]],
               measured_costs: dict[str, float] | None = None) -> StepTimeParams:
    """The constants in FITTED minimising the mean |log error| of the observations
    (kvpilot.twin.calibration.fit's Nelder-Mead on their logs, efficiencies capped at 1), from floors
    sized for a CPU.  With `measured_costs` (frontend_costs), the frontend server's costs are those
    and the fit moves the rest."""
    start = StepTimeParams(cpu_overhead_s=2e-3, gemm_floor_s=2e-5, elementwise_floor_s=1e-5, attn_floor_s=2e-5,
                           engine_request_s=2e-4, frontend_s=5e-3, frontend_request_s=3e-3, frontend_step_s=2e-4,
                           frontend_token_s=5e-5)
    fitted: tuple[str, ...] = FITTED
    if measured_costs:
        start = replace(start, **{k: measured_costs[k] for k in COST_OF.values()})
        fitted = tuple(k for k in FITTED if k not in COST_OF.values())
    measured = np.array([o["seconds"] for o in obs])
    params = start
    for _ in range(3):  # restarts: the simplex of 11 constants stalls before the minimum
        params = fit_loss(lambda p: log_error_loss(predict(model, device, p, obs), measured), params, fitted,
                          iters=2000)
    return replace(params, **{k: float(f"{getattr(params, k):.4g}") for k in fitted})




@dataclass(frozen=True)
class Calibration:
    """A fitted profile and what it was fitted on."""

    profile: DeviceProfile
    model: ModelSpec
    observations: list[dict[str, Any]]  # those with a finite time: the ones fitted
    costs: dict[str, float] | None = None  # the frontend's costs as measured (frontend_costs); None: fitted
    jitter: dict[str, float] = field(default_factory=dict)  # the observations' step_jitter


def load_observations(path: str | Path) -> dict[str, Any]:
    """A calibration's observations, as benchmarks/twin_vs_vllm.py --calibrate writes them."""
    data = read_json(path, "observations", CalibrationError)
    if not (isinstance(data, dict) and isinstance(data.get("peaks"), dict)
            and isinstance(data.get("observations"), list)):
        raise CalibrationError(f"observations {path}: a JSON object with 'peaks' and 'observations' is expected "
                               "(benchmarks/twin_vs_vllm.py --calibrate writes one)")
    return data


def calibrate(measured: dict[str, Any], model: ModelSpec, *, source: str,
              fit_frontend: bool = False) -> Calibration:
    """The device profile fitted on `measured` (load_observations) for `model`, the model they were
    measured on.  The frontend server's costs are measured from the observations' meters unless
    `fit_frontend` (or the observations have none), then fitted to the latencies with the rest."""
    device = cpu_device(measured["peaks"])
    obs = [o for o in measured["observations"] if np.isfinite(o["seconds"])]
    if not obs:
        raise CalibrationError("no observation measured a time")
    # The constants are fitted on medians and means, the jitter (mean 1) is measured apart.
    jitter = measured.get("step_jitter", {})
    costs = None if fit_frontend else frontend_costs(obs)
    params = replace(fit_params(model, device, obs, costs), step_jitter=round(float(jitter.get("sigma", 0.0)), 4))
    return Calibration(DeviceProfile(device, params, source=source), model, obs, costs, jitter)


def report(cal: Calibration, out: TextIO = sys.stdout) -> None:
    """The fit: the measured costs, the peaks, the fitted constants, and the error on every observation."""
    device, params, costs, jitter = cal.profile.device, cal.profile.step_time, cal.costs, cal.jitter
    if costs:
        print("frontend costs measured (API server + client CPU over vLLM's counts, median |error| "
              f"{costs['median_error']:.1%}): " + ", ".join(f"{k} {costs[k] * 1e6:.1f} us" for k in COST_OF.values())
              + f"; idle {costs['idle']:.1%} of a core", file=out)
    print(f"peaks: {device.bf16_flops / 1e9:.1f} GFLOP/s bf16, {device.hbm_bandwidth / 1e9:.1f} GB/s", file=out)
    print("fitted:", {k: getattr(params, k) for k in FITTED}, file=out)
    print(f"step jitter (vLLM's own log of {jitter.get('steps', 0):.0f} decode steps): sigma {params.step_jitter:g}"
          + (f", p99 / median {jitter['p50_to_p99']:.2f}" if "p50_to_p99" in jitter else ""), file=out)
    # Errors as fitted, without the step jitter: the observations are medians, and a burst or mixed step
    # served once with it is one draw (a mixed step's longest gap read 8.1 and 4.2 ms with it, 5.7 and
    # 6.3 without, against vLLM's 6.9 and 6.9).
    obs = cal.observations
    pred = predict(cal.model, device, replace(params, step_jitter=0.0), obs)
    errs = np.abs(pred / np.array([o["seconds"] for o in obs]) - 1.0)
    for o, e, p in zip(obs, errs, pred, strict=True):
        what = (f"decode {o['n']:>2} x {o['prompt']:>4}" if o["kind"] == "decode" else
                f"burst {o['n']:>2} x {o['tokens']:>2} {o['stat']}" if o["kind"] == "burst" else
                f"mixed {o['n']:>2} + {o['prompt']:>4}" if o["kind"] == "mixed" else f"TTFT {o['prompt']:>4}")
        print(f"  {what:<18} vLLM {o['seconds'] * 1e3:7.2f} ms  twin {p * 1e3:7.2f} ms  {e:5.1%}", file=out)
    for kind in ("decode", "prefill", "burst", "mixed"):
        k = np.array([o["kind"] == kind for o in obs])
        if not k.any():
            continue
        print(f"{kind}: median |error| {np.median(errs[k]):.1%}, max {np.max(errs[k]):.1%} ({k.sum()} observations)",
              file=out)
