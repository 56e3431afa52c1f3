"""Published real-vLLM serving experiments, replayed on the twin.

`read_experiments(csv_path)` reads rows in the columns of the shared `blis_train13_by_stage.csv`
(inference-perf "shared prefix" workloads in Poisson stages, vLLM on GPUs) into `Experiment`s;
`run_experiment(exp)` rebuilds the workload, runs the twin with the row's engine settings and
returns its figures per stage in the measured columns' terms.  `errors` and `median_errors` set
them against the measured ones.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvpilot.twin.engine import Engine, EngineConfig, EngineStartupError
from kvpilot.twin.hardware import GpuSpec, UnknownGpuError, resolve_gpu
from kvpilot.twin.memory import kv_dtype_bytes
from kvpilot.twin.models import ModelSpec, ModelSpecError, resolve_model
from kvpilot.twin.offline import drive, request_latencies
from kvpilot.twin.steptime import StepTimeParams, kernel_params_for, params_for, with_serving
from kvpilot.twin.workload import RequestBatch

# The figures each row measures, in milliseconds (`itl_mean` is TPOT from means:
# (E2E mean - TTFT mean) / (mean output tokens - 1)).
METRICS = ("e2e_mean", "e2e_p90", "e2e_p99", "ttft_mean", "ttft_p90", "ttft_p99", "itl_mean")
WHOLE_RUN = -1  # stage_index of a row summarising the whole run
# Prompts as the server counts them run this much longer than system prompt + question (BOS, and
# random token ids decoded to text and tokenized again): the data's README, from the runs' logs.
PROMPT_TOKEN_FACTOR = 1.05


class ExperimentError(ValueError):
    """A row the twin cannot replay: an unknown model or GPU, or a field it cannot read."""


@dataclass(frozen=True)
class Experiment:
    key: str
    model: str
    hardware: str
    tp: int
    precision: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int | None
    num_gpu_blocks: int | None  # as the run logged it, when the row says
    stages: tuple[tuple[float, float], ...]  # (requests/s, seconds)
    num_groups: int
    users_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    vllm_version: str = ""  # as the row gives it ("" or words: vLLM's current defaults)
    dp: int = 1  # data-parallel engines sharing the load (each simulated as one of dp equal replicas)
    measured: dict[int, dict[str, float]] = field(default_factory=dict)  # stage -> metric -> ms
    published: dict[int, dict[str, float]] = field(default_factory=dict)  # BLIS's predictions

    @property
    def model_family(self) -> str:
        """The model without its quantization suffix: one "model" for leave-one-model-out."""
        return re.sub(r"-fp8(-dynamic)?$", "", self.model.lower().rsplit("/", 1)[-1])

    def model_spec(self) -> ModelSpec:
        spec = resolve_model(self.model)
        if self.precision.upper() == "FP8" and not spec.quantization:
            spec = spec.quantized("fp8")
        return spec

    def gpu(self) -> GpuSpec:
        return resolve_gpu(self.hardware)


def _num(row: dict[str, str], col: str) -> float | None:
    text = (row.get(col) or "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ExperimentError(f"column {col!r} is not a number: {text!r}") from None


def _int(row: dict[str, str], col: str, default: int | None = None) -> int | None:
    x = _num(row, col)
    return default if x is None else int(x)


def _req_int(row: dict[str, str], col: str) -> int:
    x = _int(row, col)
    if x is None:
        raise ExperimentError(f"column {col!r} is empty")
    return x


def read_experiments(path: str | Path) -> list[Experiment]:
    """Experiments from a CSV in the columns of blis_train13_by_stage.csv, in file order."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as exc:
        raise ExperimentError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    out: dict[str, Experiment] = {}
    for n, row in enumerate(rows, start=2):
        key = f"{row.get('exp_id', '')}:{row.get('experiment_folder', '')}"
        try:
            if key not in out:
                out[key] = _experiment(key, row)
            stage = _req_int(row, "stage_index")
            out[key].measured[stage] = {m: v for m in METRICS if (v := _num(row, f"actual_{m}_ms")) is not None}
            blis = {m: v for m in METRICS if (v := _num(row, f"blis_evolved_pred_{m}_ms")) is not None}
            if blis:
                out[key].published[stage] = blis
        except ExperimentError as exc:
            raise ExperimentError(f"{path}, line {n}: {exc}") from None
    return list(out.values())


def _experiment(key: str, row: dict[str, str]) -> Experiment:
    try:
        stages = tuple((float(r), float(d)) for r, d in json.loads(row.get("wl_stages_rate_duration") or ""))
    except (ValueError, TypeError) as exc:
        raise ExperimentError(f"wl_stages_rate_duration is not a list of [rate, seconds]: {exc}") from None
    if not stages or any(r <= 0 or d <= 0 for r, d in stages):
        raise ExperimentError("wl_stages_rate_duration needs stages of positive rate and duration")
    blocks = re.search(r"total_kv_blocks=(\d+)", row.get("notes") or "")
    return Experiment(
        key=key, model=row["model"], hardware=row["hardware"], tp=_int(row, "tp", 1) or 1,
        precision=(row.get("precision") or "").strip(),
        max_num_batched_tokens=_req_int(row, "max_num_batched_tokens"),
        max_num_seqs=_int(row, "max_num_seqs", 256) or 256,
        max_model_len=_int(row, "max_model_len"),
        num_gpu_blocks=int(blocks.group(1)) if blocks else None,
        stages=stages,
        num_groups=_req_int(row, "wl_num_system_prompts"),
        users_per_group=_req_int(row, "wl_users_per_prompt"),
        system_prompt_len=_req_int(row, "wl_system_prompt_len"),
        question_len=_req_int(row, "wl_question_len"),
        output_len=_req_int(row, "wl_output_len"),
        vllm_version=(row.get("vllm_version") or "").strip(),
        dp=max(1, _int(row, "dp", 1) or 1),
    )


def workload(exp: Experiment, seed: int = 0, time_scale: float = 1.0) -> tuple[RequestBatch, np.ndarray]:
    """The run's requests and the stage each was sent in.  inference-perf's shared-prefix load
    makes groups x users prompts (a group's system prompt, then the user's own question) and sends
    them in turn, so every user's prompt recurs and, once computed, is a prefix-cache hit up to its
    last full block; arrivals are Poisson at each stage's rate.  `time_scale` < 1 shortens every
    stage (a quicker, noisier run: the calibration's search uses it)."""
    rng = np.random.default_rng(seed)
    arrivals, stage_of = [], []
    t0 = 0.0
    for s, (rate, dur) in enumerate(exp.stages):
        rate /= exp.dp  # vLLM's data-parallel front end spreads requests evenly over its engines
        dur *= time_scale
        gaps = rng.exponential(1.0 / rate, size=int(rate * dur * 1.5) + 16)
        t = t0 + np.cumsum(gaps)
        t = t[t < t0 + dur]
        arrivals.append(t)
        stage_of.append(np.full(len(t), s))
        t0 += dur
    arrival = np.concatenate(arrivals)
    n = len(arrival)
    users = exp.num_groups * exp.users_per_group
    prompt = round((exp.system_prompt_len + exp.question_len) * PROMPT_TOKEN_FACTOR)
    order = rng.permutation(users)  # inference-perf shuffles its prompts once
    user = order[np.arange(n) % users]
    batch = RequestBatch(arrival, np.full(n, prompt, np.int64), np.full(n, exp.output_len, np.int64),
                         [f"u{u}" for u in user.tolist()], np.full(n, prompt, np.int64))
    return batch, np.concatenate(stage_of)


def engine_config(exp: Experiment, params: StepTimeParams | None = None) -> EngineConfig:
    """The row's engine: its model, GPU, TP, token budget and sequence cap; a KV cache of the blocks
    the run logged (else vLLM's memory plan at its default utilisation)."""
    try:
        model, gpu = exp.model_spec(), exp.gpu()
    except (ModelSpecError, UnknownGpuError) as exc:
        raise ExperimentError(str(exc)) from None
    kv_bytes = None
    mml = exp.max_model_len or model.max_position_embeddings
    if exp.num_gpu_blocks:
        kv_bytes = exp.num_gpu_blocks * 16 * model.kv_bytes_per_token(exp.tp, kv_dtype_bytes("auto", model))
        mml = min(mml, exp.num_gpu_blocks * 16)  # vLLM refuses a max_model_len its cache cannot hold
    return EngineConfig.resolve(
        model, gpu, max_num_batched_tokens=exp.max_num_batched_tokens, max_num_seqs=exp.max_num_seqs,
        max_model_len=mml, kv_cache_memory_bytes=kv_bytes, tensor_parallel_size=exp.tp,
        async_scheduling=_async_default(exp.vllm_version), step_time_params=params or params_for(gpu))


def planned_blocks(exp: Experiment, max_model_len: int = 8192) -> int:
    """The KV-cache blocks vLLM's memory plan gives the row's engine at its default memory
    utilisation (the runs did not set it), to set against the blocks the run logged."""
    model, gpu = exp.model_spec(), exp.gpu()
    config = EngineConfig.resolve(model, gpu, max_num_batched_tokens=exp.max_num_batched_tokens,
                                  max_num_seqs=exp.max_num_seqs, tensor_parallel_size=exp.tp,
                                  max_model_len=min(exp.max_model_len or max_model_len, model.max_position_embeddings))
    return config.memory_plan().num_gpu_blocks


def run_experiment(exp: Experiment, params: StepTimeParams | None = None, seed: int = 0,
                   time_scale: float = 1.0) -> dict[int, dict[str, float]]:
    """The twin's figures for each stage and the whole run (WHOLE_RUN), in ms, as the row measures them."""
    config = engine_config(exp, params)
    try:
        engine = Engine(config)
    except EngineStartupError as exc:
        raise ExperimentError(f"the twin refuses the engine: {exc}") from None
    batch, stage = workload(exp, seed, time_scale)
    trace = drive(engine, batch, max_sim_time_s=float(batch.arrival_s[-1]) * 3 + 600)
    lat = request_latencies(trace)
    sent_stage = stage[lat.index]
    out = {WHOLE_RUN: _figures(lat.ttft, lat.e2e, lat.num_output)}
    if len(exp.stages) == 1:
        out[0] = out[WHOLE_RUN]
    else:
        for s in range(len(exp.stages)):
            m = sent_stage == s
            out[s] = _figures(lat.ttft[m], lat.e2e[m], lat.num_output[m])
    return out


def _figures(ttft: np.ndarray, e2e: np.ndarray, n_out: np.ndarray) -> dict[str, float]:
    if not len(ttft):
        return {}
    ms = 1e3
    p = np.percentile
    itl = (e2e.mean() - ttft.mean()) / max(n_out.mean() - 1, 1.0)
    return {
        "e2e_mean": float(e2e.mean() * ms), "e2e_p90": float(p(e2e, 90) * ms), "e2e_p99": float(p(e2e, 99) * ms),
        "ttft_mean": float(ttft.mean() * ms), "ttft_p90": float(p(ttft, 90) * ms),
        "ttft_p99": float(p(ttft, 99) * ms), "itl_mean": float(itl * ms),
    }


def errors(predicted: dict[int, dict[str, float]], measured: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Absolute percentage error of each predicted figure that was measured, by stage."""
    out: dict[int, dict[str, float]] = {}
    for stage, figs in measured.items():
        pred = predicted.get(stage, {})
        out[stage] = {m: abs(pred[m] - v) / v * 100 for m, v in figs.items() if m in pred and v > 0}
    return out


def median_errors(per_run: Iterable[dict[int, dict[str, float]]], stage: int | None = WHOLE_RUN) -> dict[str, float]:
    """The median over runs of each metric's error, on the whole-run rows (or every row: stage=None)."""
    pooled: dict[str, list[float]] = {m: [] for m in METRICS}
    for errs in per_run:
        for s, figs in errs.items():
            if stage is None or s == stage:
                for m, v in figs.items():
                    pooled[m].append(v)
    return {m: float(np.median(v)) if v else math.nan for m, v in pooled.items()}




# --- calibration of the serving constants --------------------------------------------------------

# The step-time constants that real GPU serving decides and per-kernel profiles do not: the engine's
# per-step host time left over once async scheduling overlaps it with the GPU, the launch floor of a
# small fused kernel inside a CUDA graph, decode attention's share of HBM bandwidth, a CUDA-graph
# decode step's weight streaming against the profiles' one GEMM at a time, and the fused MoE
# kernel's.  `frontend_s` (HTTP, tokenizing, streaming) shifts every TTFT and E2E by itself and
# changes nothing else, so it is chosen over FRONTEND_GRID_MS without running anything again.
SERVING_GRID: dict[str, tuple[float, ...]] = {
    "cpu_overhead_s": (1e-4, 3e-4),
    "elementwise_floor_s": (1.5e-6, 3e-6),
    "attn_decode_eff": (0.6, 0.8),
    "gemm_memory_scale": (1.0, 1.05),
    "moe_memory_eff": (0.7, 0.85, 1.0),
}
FRONTEND_GRID_MS = tuple(float(ms) for ms in range(16))
FIT_METRICS = ("e2e_mean", "ttft_mean", "ttft_p99", "itl_mean")
_SHIFTED = ("e2e_mean", "e2e_p90", "e2e_p99", "ttft_mean", "ttft_p90", "ttft_p99")


@dataclass
class FitResult:
    best: dict[str, float]
    cv_choice: dict[str, dict[str, float]]
    cv_errors: list[dict[int, dict[str, float]]]


def _shift(pred: dict[int, dict[str, float]], frontend_ms: float) -> dict[int, dict[str, float]]:
    return {s: {m: v + frontend_ms if m in _SHIFTED else v for m, v in figs.items()} for s, figs in pred.items()}


def _loss(pairs: Sequence[tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]]) -> float:
    """The sum over FIT_METRICS of the median absolute error over every row: the figure the twin is
    judged by, so that one row (a base model whose outputs ended early at EOS) cannot steer it."""
    errs = [errors(pred, measured) for pred, measured in pairs]
    med = median_errors(errs, stage=None)
    return float(sum(med[m] for m in FIT_METRICS))


def _with_frontend(pairs: Sequence[tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]]
                   ) -> tuple[float, float]:
    """The frontend latency (ms, from FRONTEND_GRID_MS) that best fits, and the loss with it: it
    shifts every TTFT and E2E by itself and changes nothing else, so no run is repeated."""
    return min((_loss([(_shift(p, ms), m) for p, m in pairs]), ms) for ms in FRONTEND_GRID_MS)[::-1]


def fit_serving(exps: Sequence[Experiment], *, time_scale: float = 0.5, seed: int = 0,
                log: Callable[[str], object] = lambda _: None) -> FitResult:
    """Choose the serving constants from SERVING_GRID (and frontend_s) that best match `exps`, and
    the same choice made without each model's rows, judged on that model (leave-one-model-out).
    Each experiment is run once per distinct setting (an MoE constant does not change a dense run)."""
    keys = list(SERVING_GRID)
    combos = [dict(zip(keys, vals, strict=True)) for vals in itertools.product(*SERVING_GRID.values())]
    cache: dict[tuple[str, tuple[float, ...]], dict[int, dict[str, float]]] = {}

    def predict(exp: Experiment, combo: dict[str, float], scale: float) -> dict[int, dict[str, float]]:
        moe = exp.model_spec().is_moe
        sig = tuple(v for k, v in combo.items() if moe or not k.startswith("moe_"))
        key = (f"{exp.key}@{scale}", sig)
        if key not in cache:
            gpu = exp.gpu()
            cache[key] = run_experiment(exp, with_serving(kernel_params_for(gpu), {**combo, "frontend_s": 0.0}),
                                         seed, scale)
        return cache[key]

    usable = []
    for exp in exps:
        try:
            engine_config(exp)
            usable.append(exp)
        except ExperimentError as exc:
            log(f"  left out {exp.key}: {exc}")

    def choose(train: list[Experiment]) -> dict[str, float]:
        best: tuple[float, dict[str, float]] = (math.inf, {})
        for combo in combos:
            pairs = [(predict(e, combo, time_scale), e.measured) for e in train]
            fe, loss = _with_frontend(pairs)
            if loss < best[0]:
                best = (loss, {**combo, "frontend_s": round(fe / 1e3, 5)})
        log(f"  chosen on {len(train)} experiments: loss {best[0]:.4f} {best[1]}")
        return best[1]

    best = choose(usable)
    families = sorted({e.model_family for e in usable})
    cv_choice, cv_errors = {}, []
    for fam in families:
        chosen = choose([e for e in usable if e.model_family != fam])
        cv_choice[fam] = chosen
        combo = {k: v for k, v in chosen.items() if k != "frontend_s"}
        for e in usable:
            if e.model_family == fam:
                pred = _shift(predict(e, combo, 1.0), chosen["frontend_s"] * 1e3)
                cv_errors.append(errors(pred, e.measured))
    return FitResult(best, cv_choice, cv_errors)


# --- exact per-request traces ----------------------------------------------------------------------

@dataclass
class TraceRun:
    """One load point of a published trace: its requests and engine, and what was measured."""

    name: str
    model: str
    gpu: str
    tp: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_gpu_blocks: int
    async_scheduling: bool
    served: bool  # through vLLM's HTTP server (False: in-process AsyncLLM, no frontend latency)
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    shared_prefix_tokens: int
    measured: dict[str, float]


# vLLM turned async scheduling on by default for GPUs in 0.14 (release notes); earlier releases
# schedule each step after the previous one's output is processed.
ASYNC_SCHEDULING_DEFAULT_SINCE = (0, 14)


def _async_default(version: str) -> bool:
    """Whether the vLLM release a run names schedules asynchronously by default ("likely v0.15.1 era"
    reads as 0.15; a version that cannot be read is taken as a current release: on)."""
    m = re.search(r"(\d+)\.(\d+)", version)
    return m is None or (int(m.group(1)), int(m.group(2))) >= ASYNC_SCHEDULING_DEFAULT_SINCE


def read_guidellm_runs(summary_csv: Path, root: Path) -> list[TraceRun]:
    """The GuideLLM sweeps' load points, each from its per-request records."""
    runs = []
    with open(summary_csv, newline="") as f:
        for row in csv.DictReader(f):
            folder = root / row["local_trace"]
            idx, strategy = row["benchmark_index"], row["strategy"]
            path = folder / f"bench{idx}_{strategy}_requests.csv"
            with open(path, newline="") as g:
                recs = list(csv.DictReader(g))
            start = np.array([float(r["request_start_time"]) for r in recs])
            order = np.argsort(start)
            start = start[order] - start.min()
            prompt = np.array([int(r["prompt_tokens"]) for r in recs])[order]
            out = np.array([int(r["output_tokens"]) for r in recs])[order]
            ttft = np.array([float(r["ttft_ms"]) / 1e3 for r in recs])[order]
            e2e = np.array([float(r["latency_s"]) for r in recs])[order]
            kv_tokens = int(re.sub(r"\D", "", row["gpu_kv_cache_tokens"]))
            prefix = int(json.loads(row["workload"]).get("prefix_tokens", 0))
            runs.append(TraceRun(
                name=f"{row['run']} #{idx} {strategy} {float(row['target_rate_rps'] or 0):.2f}/s",
                model=row["model"], gpu="H100-80GB", tp=int(row["tp"]),
                max_num_batched_tokens=int(row["max_num_batched_tokens"]), max_num_seqs=int(row["max_num_seqs"]),
                max_model_len=int(row["max_model_len"]), num_gpu_blocks=kv_tokens // 16,
                async_scheduling=_async_default(row["vllm_version"]), served=True,
                arrival_s=start, prompt_tokens=prompt, output_tokens=out, shared_prefix_tokens=prefix,
                measured=_figures(ttft, e2e, out)))
    return runs


def read_llmservingsim_run(summary_csv: Path, root: Path) -> list[TraceRun]:
    """LLMServingSim's exact trace (in-process AsyncLLM: no HTTP), measured figures from its summary."""
    runs = []
    with open(summary_csv, newline="") as f:
        for row in csv.DictReader(f):
            folder = root / row["local_trace"]
            recs = [json.loads(line) for line in (folder / "requests.jsonl").read_text().splitlines() if line.strip()]
            arr = np.array([r["arrival_time"] for r in recs])
            order = np.argsort(arr)
            n_out = float(row["mean_output_tokens"])
            e2e, ttft = float(row["e2e_mean_ms"]), float(row["ttft_mean_ms"])
            runs.append(TraceRun(
                name=f"{row['run']} ({row['num_requests']} requests)", model=row["model"], gpu=row["gpu"],
                tp=int(row["tp"]), max_num_batched_tokens=int(row["max_num_batched_tokens"]),
                max_num_seqs=int(row["max_num_seqs"]), max_model_len=int(row["max_model_len"]),
                num_gpu_blocks=int(row["num_gpu_blocks"]), async_scheduling=_async_default(row["vllm_version"]),
                served=False, arrival_s=arr[order] - arr.min(),
                prompt_tokens=np.array([r["input_toks"] for r in recs])[order],
                output_tokens=np.array([r["output_toks"] for r in recs])[order], shared_prefix_tokens=0,
                measured={"e2e_mean": e2e, "e2e_p90": float(row["e2e_p90_ms"]), "e2e_p99": float(row["e2e_p99_ms"]),
                          "ttft_mean": ttft, "ttft_p90": float(row["ttft_p90_ms"]),
                          "ttft_p99": float(row["ttft_p99_ms"]), "itl_mean": (e2e - ttft) / max(n_out - 1, 1)}))
    return runs


def run_trace(run: TraceRun, params: StepTimeParams | None = None) -> dict[str, float]:
    """The twin's figures for a trace's requests, sent at their recorded times."""
    try:
        model, gpu = resolve_model(run.model), resolve_gpu(run.gpu)
    except (ModelSpecError, UnknownGpuError) as exc:
        raise ExperimentError(str(exc)) from None
    p = params or params_for(gpu)
    if not run.served:
        p = replace(p, frontend_s=0.0)
    block = 16 * model.kv_bytes_per_token(run.tp)
    config = EngineConfig.resolve(
        model, gpu, max_num_batched_tokens=run.max_num_batched_tokens, max_num_seqs=run.max_num_seqs,
        max_model_len=run.max_model_len, kv_cache_memory_bytes=run.num_gpu_blocks * block,
        tensor_parallel_size=run.tp, async_scheduling=run.async_scheduling, step_time_params=p)
    try:
        engine = Engine(config)
    except EngineStartupError as exc:
        raise ExperimentError(f"the twin refuses the engine: {exc}") from None
    n = len(run.arrival_s)
    keys: list[str | None] | None = [f"prefix{run.shared_prefix_tokens}"] * n if run.shared_prefix_tokens else None
    batch = RequestBatch(run.arrival_s, run.prompt_tokens, run.output_tokens, keys,
                         np.full(n, run.shared_prefix_tokens, np.int64) if keys else None)
    lat = request_latencies(drive(engine, batch, max_sim_time_s=float(run.arrival_s[-1]) * 3 + 600))
    return _figures(lat.ttft, lat.e2e, lat.num_output)


__all__ = ["METRICS", "SERVING_GRID", "WHOLE_RUN", "Experiment", "ExperimentError", "FitResult", "TraceRun",
           "engine_config", "errors", "planned_blocks", "fit_serving", "median_errors", "read_experiments", "read_guidellm_runs",
           "read_llmservingsim_run", "run_experiment", "run_trace", "workload"]
