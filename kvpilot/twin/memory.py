"""KV-cache sizing as vLLM does it at start-up, and the start-up errors it raises.

vLLM (V1 worker, `determine_available_memory` + `kv_cache_utils`):

    requested  = gpu_memory_utilization x total GPU memory          (per instance, per rank)
    available  = requested - weights - activation peak - non-torch   (or --kv-cache-memory-bytes)
                 - CUDA-graph estimate                                (vLLM >= 0.21)
    blocks     = available // (2 x block_size x kv_heads/rank x head_dim x kv dtype bytes x layers)

The activation peak is the larger of a profiling forward pass of `max_num_batched_tokens` tokens
and the sampler's warm-up over min(`max_num_seqs`, tokens) rows of full-vocabulary logits, so a
larger token budget (or, for large vocabularies, more sequences) leaves fewer blocks.  How big the
warm-up is depends on the model runner that runs it (`profile_for_vllm`): model runner V1 warms up
vLLM's top-k/top-p sampler, whose PyTorch path sorted the whole vocabulary until 0.17 (about ten
fp32 copies of the logits at its peak; FlashInfer's kernel far fewer) and since 0.17 masks them in a
Triton kernel (four copies); model runner V2, vLLM's default for dense
models since 0.25 (Qwen3 since 0.22, Llama and Mistral since 0.23), samples the dummy batch without
top-k, top-p or logprobs, so its peak is the logits and their fp32 copy.  Since vLLM 0.21 the
CUDA-graph memory estimate also comes out of the budget.  At tensor parallelism above 1 the NCCL
communicators and custom all-reduce buffers exist before vLLM measures free memory, so they count
against the free-memory check, not the budget; the collectives of the profiling run add non-torch
memory inside it.
Start-up fails, with vLLM's wording, when the GPU has less free memory than requested, when
nothing is left for the cache, or when the cache cannot hold one `max_model_len` sequence.

The constants that are not model shapes live in `MemoryProfile`; `FITTED_PROFILE` holds values
fitted to published vLLM start-up logs (`benchmarks/twin_memory.py` prints the fit and its errors
on `benchmarks/data/vllm_startup_logs.jsonl`), and `DEFAULT_PROFILE` is the profile of the vLLM
release the twin stands for (`kvpilot.api.vllm.VLLM_VERSION`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvpilot.api import vllm
from kvpilot.twin.hardware import GiB, GpuSpec
from kvpilot.twin.models import ModelSpec

# Fitted by benchmarks/twin_memory.py; the comments say what each term is, the data says how big.
# Memory outside PyTorch's allocator that grows during the profiling run (cuBLAS workspaces...).
NON_TORCH_BYTES = int(0.13 * GiB)
# More of it per rank when tensor parallel: NCCL buffers set up by the profiling run's collectives.
NCCL_BYTES = int(0.41 * GiB)
# NCCL communicators and custom all-reduce buffers allocated before vLLM snapshots free memory.
TP_STARTUP_BYTES = int(0.93 * GiB)
# Model runner V1's sampler warm-up holds about this many fp32 [rows x vocab] tensors at its peak
# on vLLM's PyTorch top-k/top-p path: logits, probabilities, sorted values and int64 indices of the
# sort, logprobs.
SAMPLER_FP32_COPIES = 9.7
# The same warm-up where FlashInfer's top-k/top-p kernel samples (no full-vocabulary sort).
FLASHINFER_SAMPLER_FP32_COPIES = 2.5
# Model runner V1 since vLLM 0.17 (vllm/v1/sample/ops/topk_topp_sampler.py): top-k/top-p run in a
# Triton kernel (vLLM #33538, pivot search, no full-vocabulary sort) for batches of 8 or more.  The
# warm-up then holds the 16-bit logits `compute_logits` returns (0.5), their fp32 copy the sampler
# works on (1, masked in place), the softmax probabilities (1) and `random_sample`'s exponential
# noise (1), plus the kernel's fp32 [programs x vocab] scratch, one row per SM up to the batch (about
# 0.5 of a copy at vLLM's default 256 sequences on an A100).  Read from vLLM 0.17-0.19's source.
V1_TRITON_SAMPLER_FP32_COPIES = 4.0
# Model runner V2 (vllm/v1/worker/gpu/sample/sampler.py): the dummy batch asks for no top-k, top-p,
# min-p or logprobs, so the warm-up holds the 16-bit logits `compute_logits` returns and the fp32
# copy the sampler works on.  Read from vLLM's source, not fitted: no training log runs V2.
V2_SAMPLER_FP32_COPIES = 1.5
# vLLM's CUDA-graph memory estimate (default capture sizes), per decoder layer.
CUDA_GRAPH_BYTES_PER_LAYER = int(0.52 * GiB / 36)

# vLLM releases where its start-up accounting changed (release notes; PR numbers in vLLM's repo).
CUDA_GRAPH_IN_BUDGET_SINCE = (0, 21)  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS on by default
TRITON_TOP_K_TOP_P_SINCE = (0, 17)  # model runner V1's top-k/top-p in Triton (#33538), no sort
# Model runner V2 became the default for dense models in steps: Qwen3 (0.22 release notes), then
# Llama and Mistral (#43458, 0.23), then every dense model (#44443, 0.25).
V2_MODEL_RUNNER_SINCE: tuple[tuple[tuple[str, ...], tuple[int, int]], ...] = (
    (("qwen3",), (0, 22)),
    (("llama", "mistral"), (0, 23)),
    ((), (0, 25)),
)


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """The terms of vLLM's start-up accounting that are not model shapes, in bytes per rank."""

    non_torch_bytes: int = NON_TORCH_BYTES
    tp_non_torch_bytes: int = NCCL_BYTES
    tp_startup_bytes: int = TP_STARTUP_BYTES
    sampler_fp32_copies: float = SAMPLER_FP32_COPIES
    cuda_graph_bytes_per_layer: int = CUDA_GRAPH_BYTES_PER_LAYER
    # vLLM >= 0.21 takes its CUDA-graph estimate out of the KV budget (before, graphs were
    # captured after sizing, into the headroom above the budget).
    cuda_graph_in_budget: bool = True

    def non_torch(self, tp: int) -> int:
        return self.non_torch_bytes + (self.tp_non_torch_bytes if tp > 1 else 0)

    def held_at_startup(self, tp: int) -> int:
        return self.tp_startup_bytes if tp > 1 else 0

    def cuda_graph(self, model: ModelSpec) -> int:
        return self.cuda_graph_bytes_per_layer * model.num_hidden_layers if self.cuda_graph_in_budget else 0


def parse_version(version: str) -> tuple[int, ...]:
    """'0.33.0' -> (0, 33, 0); what follows the numbers ('0.28.1rc1', '0.31.0+cu130') is ignored."""
    m = re.match(r"\d+(?:\.\d+)+", version.strip().removeprefix("v"))
    if m is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return tuple(int(part) for part in m.group().split("."))


def runs_model_runner_v2(version: tuple[int, ...], model_name: str) -> bool:
    """Whether vLLM `version` profiles this dense model on model runner V2 by default."""
    name = model_name.lower().rsplit("/", 1)[-1]  # a config.json's "_name_or_path" may carry the org
    return any(version >= since and (not families or name.startswith(families))
               for families, since in V2_MODEL_RUNNER_SINCE)


def profile_for_vllm(version: tuple[int, ...], model_name: str = "", *, flashinfer_sampler: bool = False,
                     base: MemoryProfile | None = None,
                     flashinfer_fp32_copies: float = FLASHINFER_SAMPLER_FP32_COPIES) -> MemoryProfile:
    """The start-up terms of vLLM `version` for this model: which sampler the profiling run warms up,
    and whether the CUDA-graph estimate comes out of the budget.  `base` gives the fitted constants
    (its sampler copies are model runner V1's sort-based PyTorch sampler, before 0.17)."""
    base = FITTED_PROFILE if base is None else base
    if runs_model_runner_v2(version, model_name):
        copies = V2_SAMPLER_FP32_COPIES
    elif flashinfer_sampler:
        copies = flashinfer_fp32_copies
    elif version >= TRITON_TOP_K_TOP_P_SINCE:
        copies = V1_TRITON_SAMPLER_FP32_COPIES
    else:
        copies = base.sampler_fp32_copies
    return replace(base, sampler_fp32_copies=copies, cuda_graph_in_budget=version >= CUDA_GRAPH_IN_BUDGET_SINCE)


# The constants fitted on the training logs (model runner V1's PyTorch sampler, graphs in the budget).
FITTED_PROFILE = MemoryProfile()
# The vLLM release the twin stands for; every preset is a dense model, so the model does not matter.
DEFAULT_PROFILE = profile_for_vllm(parse_version(vllm.VLLM_VERSION))


class EngineStartupError(Exception):
    """The engine cannot start with this configuration (vLLM raises at start-up and exits).

    The message is vLLM's; a memory failure also carries its numbers, in bytes, so nothing in
    this process has to read them back out of the text:
      kind "kv_short"  the KV cache cannot hold one max_model_len sequence: `needed` vs `available`
      kind "no_cache"  nothing is left for the KV cache: `requested`, `weights`, `activation`, `non_torch`
      kind "gpu_short" the GPU itself is short (weights, an allocation, the asked fraction): `needed` vs `available`
      kind "config"    a setting vLLM refuses before it looks at memory
    """

    def __init__(self, message: str, *, kind: str = "config", needed: float | None = None,
                 available: float | None = None, requested: float | None = None, weights: float | None = None,
                 activation: float | None = None, non_torch: float | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.needed, self.available = needed, available
        self.requested, self.weights, self.activation, self.non_torch = requested, weights, activation, non_torch


def kv_dtype_bytes(kv_cache_dtype: str, model: ModelSpec) -> int:
    if kv_cache_dtype == "auto":
        return model.dtype_bytes
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype in ("bfloat16", "float16", "half"):
        return 2
    if kv_cache_dtype == "float32":
        return 4
    raise EngineStartupError(f"Unknown kv cache dtype: {kv_cache_dtype!r}")


def _padded_vocab(vocab: int, tp: int) -> int:
    # vLLM pads the vocab-parallel embedding to a multiple of 64 per rank.
    pad = 64 * tp
    return -(-vocab // pad) * pad


def weight_bytes_per_rank(model: ModelSpec, tp: int) -> int:
    """Weights on one rank: the decoder layers' linear weights at the model's weight bytes (FP8: 1,
    plus a 4-byte scale per output channel), every expert of an MoE layer sharded by tensor
    parallelism, the embeddings, LM head and norms at 16 bits."""
    h, b, wb = model.hidden_size, model.dtype_bytes, model.weight_bytes
    kv_heads = model.kv_heads_per_rank(tp)
    qkv_n = model.q_size // tp + 2 * kv_heads * model.head_dim
    attn = h * qkv_n + (model.q_size // tp) * h
    m = 3 if model.gated_mlp else 2
    dense = m * h * (model.intermediate_size // tp)
    experts = m * h * (model.num_experts * (model.moe_intermediate_size // tp)
                       + model.shared_expert_intermediate_size // tp)
    linear = (model.num_hidden_layers * attn + model.num_dense_layers * dense + model.num_moe_layers * experts) * wb
    if model.weight_bytes < model.dtype_bytes:  # per-channel scales of the quantized weights
        linear += 4 * model.num_hidden_layers * (qkv_n + h + m * h)
    router = model.num_moe_layers * h * model.num_experts * b
    emb = _padded_vocab(model.vocab_size, tp) // tp * h
    head = 0 if model.tie_word_embeddings else emb
    return linear + router + b * (2 * h * model.num_hidden_layers + emb + head + h)


def sampler_peak_bytes(model: ModelSpec, num_tokens: int, num_seqs: int,
                       fp32_copies: float | None = None) -> int:
    """The sampler warm-up of the profiling run: one row of fp32 logits per sequence, gathered over
    the whole vocabulary on every rank (so tensor parallelism does not shrink it).  `fp32_copies`
    defaults to the twin's vLLM (`DEFAULT_PROFILE`)."""
    copies = DEFAULT_PROFILE.sampler_fp32_copies if fp32_copies is None else fp32_copies
    return int(min(num_seqs, num_tokens) * model.vocab_size * 4 * copies)


def forward_peak_bytes(model: ModelSpec, tp: int, num_tokens: int) -> int:
    """The profiling forward pass of `num_tokens` tokens; the MLP intermediate dominates (for an MoE
    layer, its top-k experts' rows of it)."""
    # gate_up output (2i), activation output (i), residual + hidden + qkv/attention scratch.
    inter = model.intermediate_size // tp if model.num_dense_layers else 0
    if model.is_moe:
        inter = max(inter, model.num_experts_per_tok * (model.moe_intermediate_size // tp))
    return num_tokens * model.dtype_bytes * (3 * inter + 4 * model.hidden_size)


def activation_peak_bytes(model: ModelSpec, tp: int, num_tokens: int, num_seqs: int,
                          sampler_fp32_copies: float | None = None) -> int:
    """Peak PyTorch memory of vLLM's profiling run: the larger of the forward pass and the sampler
    warm-up; the forward pass's intermediates are freed before the sampler runs."""
    return max(forward_peak_bytes(model, tp, num_tokens),
               sampler_peak_bytes(model, num_tokens, num_seqs, sampler_fp32_copies))


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    total_bytes: int
    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    kv_cache_bytes: int
    block_bytes: int  # one block, all layers, one rank
    num_gpu_blocks: int
    block_size: int
    cuda_graph_bytes: int = 0  # the CUDA-graph estimate taken out of the budget

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def max_concurrency(self, tokens_per_request: int) -> float:
        return self.kv_cache_tokens / max(1, tokens_per_request)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "total_gib": round(self.total_bytes / GiB, 3),
            "requested_gib": round(self.requested_bytes / GiB, 3),
            "weights_gib": round(self.weights_bytes / GiB, 3),
            "activation_peak_gib": round(self.activation_peak_bytes / GiB, 3),
            "non_torch_gib": round(self.non_torch_bytes / GiB, 3),
            "cuda_graph_gib": round(self.cuda_graph_bytes / GiB, 3),
            "kv_cache_gib": round(self.kv_cache_bytes / GiB, 3),
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_tokens": self.kv_cache_tokens,
        }


def plan_memory(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    tensor_parallel_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    kv_cache_dtype: str = "auto",
    gpu_memory_utilization: float | None = vllm.DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_cache_memory_bytes: int | None = None,
    profile: MemoryProfile = DEFAULT_PROFILE,
) -> MemoryPlan:
    """Size the KV cache as vLLM does, or raise EngineStartupError with vLLM's message."""
    tp = tensor_parallel_size
    total = gpu.total_memory_bytes
    free_at_start = total - gpu.cuda_context_bytes - profile.held_at_startup(tp)
    weights = weight_bytes_per_rank(model, tp)
    activation = activation_peak_bytes(model, tp, max_num_batched_tokens, max_num_seqs,
                                       profile.sampler_fp32_copies)
    non_torch = profile.non_torch(tp)
    cuda_graph = profile.cuda_graph(model)
    # What the budget loses besides the cache; vLLM counts the graph estimate with the peak.
    fixed = weights + activation + non_torch + cuda_graph
    block_bytes = block_size * model.kv_bytes_per_token(tp, kv_dtype_bytes(kv_cache_dtype, model))

    if weights > free_at_start:
        raise EngineStartupError(
            f"CUDA out of memory while loading the model weights: they need {weights / GiB:.2f} GiB per GPU "
            f"and GPU 0 has a total capacity of {total / GiB:.2f} GiB of which {free_at_start / GiB:.2f} GiB "
            "is free. Increase --tensor-parallel-size or use a GPU with more memory.",
            kind="gpu_short", needed=weights, available=free_at_start,
        )
    if kv_cache_memory_bytes is not None:
        requested = fixed + kv_cache_memory_bytes
        available = kv_cache_memory_bytes
        if requested > free_at_start:
            raise EngineStartupError(
                f"CUDA out of memory. Tried to allocate {kv_cache_memory_bytes / GiB:.2f} GiB for the KV cache. "
                f"GPU 0 has a total capacity of {total / GiB:.2f} GiB of which "
                f"{(free_at_start - fixed) / GiB:.2f} GiB is free. "
                "Decrease --kv-cache-memory-bytes.",
                kind="gpu_short", needed=kv_cache_memory_bytes, available=free_at_start - fixed,
            )
    else:
        util = vllm.DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
        requested = int(util * total)
        if requested > free_at_start:
            raise EngineStartupError(
                f"Free memory on device cuda:0 ({free_at_start / GiB:.2f}/{total / GiB:.2f} GiB) on startup is "
                f"less than desired GPU memory utilization ({util}, {requested / GiB:.2f} GiB). Decrease GPU "
                "memory utilization or reduce GPU memory used by other processes.",
                kind="gpu_short", needed=requested, available=free_at_start,
            )
        available = requested - fixed
    if available <= 0:
        # The graph estimate is reported inside the non-torch figure: like it, it does not grow
        # with the token budget, which is how the tuner reads these numbers.
        raise EngineStartupError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            f"initializing the engine. (requested {requested / GiB:.2f} GiB; model weights take "
            f"{weights / GiB:.2f} GiB; PyTorch activation peak memory takes {activation / GiB:.2f} GiB; "
            f"non-torch memory takes {(non_torch + cuda_graph) / GiB:.2f} GiB, of which CUDA graphs "
            f"{cuda_graph / GiB:.2f} GiB)",
            kind="no_cache", requested=requested, weights=weights, activation=activation,
            non_torch=non_torch + cuda_graph,
        )
    num_blocks = available // block_bytes
    tokens = num_blocks * block_size
    if max_model_len > tokens:
        needed = -(-max_model_len // block_size) * block_bytes
        raise EngineStartupError(
            f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can "
            f"be stored in KV cache ({tokens}). To serve at least one request with the model's max seq len, "
            f"{needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({available / GiB:.2f} GiB). Try increasing `gpu_memory_utilization` or decreasing "
            "`max_model_len` when initializing the engine.",
            kind="kv_short", needed=needed, available=available,
        )
    return MemoryPlan(total, requested, weights, activation, non_torch, available, block_bytes, num_blocks, block_size,
                      cuda_graph)
