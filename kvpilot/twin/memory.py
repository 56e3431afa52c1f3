"""KV-cache sizing as vLLM does it at start-up, and the start-up errors it raises.

vLLM (V1 worker, `determine_available_memory` + `kv_cache_utils`):

    requested  = gpu_memory_utilization x total GPU memory          (per instance, per rank)
    available  = requested - weights - activation peak - non-torch   (or --kv-cache-memory-bytes)
    blocks     = available // (2 x block_size x kv_heads/rank x head_dim x kv dtype bytes x layers)

The activation peak is that of a profiling forward pass of `max_num_batched_tokens` tokens (and
a sampler pass over `max_num_seqs` rows of logits), so a larger token budget leaves fewer blocks.
Start-up fails, with vLLM's wording, when the GPU has less free memory than requested, when
nothing is left for the cache, or when the cache cannot hold one `max_model_len` sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.api import vllm
from kvpilot.twin.hardware import GiB, GpuSpec
from kvpilot.twin.models import ModelSpec

# Memory outside PyTorch's allocator that vLLM's profiler sees grow during start-up: cuBLAS
# workspaces and CUDA graphs, plus NCCL buffers when tensor parallel.  Typical of vLLM logs.
NON_TORCH_BYTES = int(0.25 * GiB)
NCCL_BYTES = int(0.35 * GiB)


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
    h, b = model.hidden_size, model.dtype_bytes
    kv_heads = model.kv_heads_per_rank(tp)
    qkv = h * (model.q_size // tp + 2 * kv_heads * model.head_dim)
    o = (model.q_size // tp) * h
    mlp = (3 if model.gated_mlp else 2) * h * (model.intermediate_size // tp)
    per_layer = qkv + o + mlp + 2 * h
    emb = _padded_vocab(model.vocab_size, tp) // tp * h
    head = 0 if model.tie_word_embeddings else emb
    return b * (model.num_hidden_layers * per_layer + emb + head + h)


def activation_peak_bytes(model: ModelSpec, tp: int, num_tokens: int, num_seqs: int) -> int:
    """Peak PyTorch memory of vLLM's profiling run: the larger of the forward pass of
    `num_tokens` tokens (MLP intermediate dominates) and the sampler over `num_seqs` rows."""
    b = model.dtype_bytes
    i = model.intermediate_size // tp
    # gate_up output (2i), activation output (i), residual + hidden + qkv/attention scratch.
    forward = num_tokens * b * (3 * i + 4 * model.hidden_size)
    # fp32 logits gathered over the whole vocab, and the sampler's softmax/probabilities copies.
    sampler = min(num_seqs, num_tokens) * model.vocab_size * 4 * 3
    return max(forward, sampler)


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
) -> MemoryPlan:
    """Size the KV cache as vLLM does, or raise EngineStartupError with vLLM's message."""
    tp = tensor_parallel_size
    total = gpu.total_memory_bytes
    free_at_start = total - gpu.cuda_context_bytes
    weights = weight_bytes_per_rank(model, tp)
    activation = activation_peak_bytes(model, tp, max_num_batched_tokens, max_num_seqs)
    non_torch = NON_TORCH_BYTES + (NCCL_BYTES if tp > 1 else 0)
    block_bytes = block_size * model.kv_bytes_per_token(tp, kv_dtype_bytes(kv_cache_dtype, model))

    if weights > free_at_start:
        raise EngineStartupError(
            f"CUDA out of memory while loading the model weights: they need {weights / GiB:.2f} GiB per GPU "
            f"and GPU 0 has a total capacity of {total / GiB:.2f} GiB of which {free_at_start / GiB:.2f} GiB "
            "is free. Increase --tensor-parallel-size or use a GPU with more memory.",
            kind="gpu_short", needed=weights, available=free_at_start,
        )
    if kv_cache_memory_bytes is not None:
        requested = weights + activation + non_torch + kv_cache_memory_bytes
        available = kv_cache_memory_bytes
        if requested > free_at_start:
            raise EngineStartupError(
                f"CUDA out of memory. Tried to allocate {kv_cache_memory_bytes / GiB:.2f} GiB for the KV cache. "
                f"GPU 0 has a total capacity of {total / GiB:.2f} GiB of which "
                f"{(free_at_start - weights - activation - non_torch) / GiB:.2f} GiB is free. "
                "Decrease --kv-cache-memory-bytes.",
                kind="gpu_short", needed=kv_cache_memory_bytes,
                available=free_at_start - weights - activation - non_torch,
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
        available = requested - weights - activation - non_torch
    if available <= 0:
        raise EngineStartupError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            f"initializing the engine. (requested {requested / GiB:.2f} GiB; model weights take "
            f"{weights / GiB:.2f} GiB; PyTorch activation peak memory takes {activation / GiB:.2f} GiB; "
            f"non-torch memory takes {non_torch / GiB:.2f} GiB)",
            kind="no_cache", requested=requested, weights=weights, activation=activation, non_torch=non_torch,
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
    return MemoryPlan(total, requested, weights, activation, non_torch, available, block_bytes, num_blocks, block_size)
