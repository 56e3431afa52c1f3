"""KV-cache sizing against hand-computed numbers, and vLLM's start-up failures."""

from __future__ import annotations

import pytest

from kvpilot.twin.engine import Engine, EngineConfig, EngineStartupError
from kvpilot.twin.hardware import GiB, resolve_gpu
from kvpilot.twin.memory import (
    CUDA_GRAPH_BYTES_PER_LAYER,
    NCCL_BYTES,
    NON_TORCH_BYTES,
    V2_SAMPLER_FP32_COPIES,
    activation_peak_bytes,
    plan_memory,
    weight_bytes_per_rank,
)
from kvpilot.twin.models import resolve_model

LLAMA8 = resolve_model("Llama-3.1-8B")
H100 = resolve_gpu("H100-80GB")


def test_llama_8b_weights_and_kv_bytes_by_hand() -> None:
    # 8.03e9 parameters x 2 bytes (vocab 128256 is already a multiple of 64).
    assert weight_bytes_per_rank(LLAMA8, 1) == 2 * LLAMA8.num_params()
    # K and V x 8 KV heads x 128 dims x 2 bytes x 32 layers = 128 KiB per token.
    assert LLAMA8.kv_bytes_per_token(1) == 2 * 8 * 128 * 2 * 32 == 131072
    # TP 2: each rank holds 4 KV heads; TP 16 replicates the 8 heads (1 per rank).
    assert LLAMA8.kv_bytes_per_token(2) == 65536
    assert LLAMA8.kv_bytes_per_token(16) == 2 * 1 * 128 * 2 * 32


def test_kv_cache_memory_bytes_gives_exact_block_count() -> None:
    plan = plan_memory(LLAMA8, H100, tensor_parallel_size=1, max_num_batched_tokens=2048, max_num_seqs=256,
                       max_model_len=8192, block_size=16, kv_cache_memory_bytes=10 * GiB)
    # 16 tokens x 128 KiB = 2 MiB per block -> 10 GiB / 2 MiB.
    assert plan.block_bytes == 2 * 1024 * 1024
    assert plan.num_gpu_blocks == 5120
    assert plan.kv_cache_tokens == 81920


def test_utilization_formula_by_hand() -> None:
    util, tokens, seqs = 0.9, 4096, 256
    plan = plan_memory(LLAMA8, H100, tensor_parallel_size=1, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                       max_model_len=8192, block_size=16, gpu_memory_utilization=util)
    weights = 2 * LLAMA8.num_params()
    # forward: tokens x 2 bytes x (3 x 14336 + 4 x 4096) = 0.45 GiB, the larger; the twin's vLLM warms
    # its sampler up on model runner V2: 256 rows x 128256 logits, 16-bit and an fp32 copy = 0.18 GiB.
    forward = tokens * 2 * (3 * 14336 + 4 * 4096)
    sampler = int(256 * 128256 * 4 * V2_SAMPLER_FP32_COPIES)
    assert forward > sampler
    assert activation_peak_bytes(LLAMA8, 1, tokens, seqs) == forward
    graphs = 32 * CUDA_GRAPH_BYTES_PER_LAYER
    available = int(util * H100.total_memory_bytes) - weights - forward - NON_TORCH_BYTES - graphs
    assert plan.cuda_graph_bytes == graphs
    assert plan.kv_cache_bytes == available
    assert plan.num_gpu_blocks == available // (16 * 131072)


def test_tensor_parallel_splits_weights_and_adds_nccl() -> None:
    kw = dict(max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192, block_size=16)
    one = plan_memory(resolve_model("Llama-3.1-70B"), H100, tensor_parallel_size=4, **kw)
    two = plan_memory(resolve_model("Llama-3.1-70B"), H100, tensor_parallel_size=8, **kw)
    assert one.non_torch_bytes == NON_TORCH_BYTES + NCCL_BYTES
    assert 0.49 < two.weights_bytes / one.weights_bytes < 0.51
    assert two.num_gpu_blocks > one.num_gpu_blocks


def test_bigger_token_budget_leaves_fewer_blocks() -> None:
    base = EngineConfig.resolve(LLAMA8, H100, max_model_len=8192)
    small = base.with_(max_num_batched_tokens=2048, max_num_seqs=256).memory_plan()
    big = base.with_(max_num_batched_tokens=32768, max_num_seqs=256).memory_plan()
    assert big.activation_peak_bytes > small.activation_peak_bytes
    assert big.num_gpu_blocks < small.num_gpu_blocks


def test_fp8_kv_cache_doubles_the_blocks_of_bf16() -> None:
    kw = dict(tensor_parallel_size=1, max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=8192,
              block_size=16, kv_cache_memory_bytes=8 * GiB)
    assert plan_memory(LLAMA8, H100, kv_cache_dtype="fp8", **kw).num_gpu_blocks == 2 * plan_memory(
        LLAMA8, H100, **kw).num_gpu_blocks


def test_lower_utilization_fewer_blocks() -> None:
    base = EngineConfig.resolve(LLAMA8, H100, max_model_len=8192)
    blocks = [Engine(base.with_(gpu_memory_utilization=u)).num_gpu_blocks for u in (0.5, 0.7, 0.9)]
    assert blocks == sorted(blocks) and len(set(blocks)) == 3


def test_too_high_utilization_fails_like_vllm() -> None:
    with pytest.raises(EngineStartupError, match=r"Free memory on device .* is less than desired GPU memory utilization"):
        Engine(EngineConfig.resolve(LLAMA8, H100, gpu_memory_utilization=0.999, max_model_len=8192))


def test_too_low_utilization_leaves_no_cache() -> None:
    # 0.15 x 79 GiB is less than the 15 GiB of weights.
    with pytest.raises(EngineStartupError, match="No available memory for the cache blocks"):
        Engine(EngineConfig.resolve(LLAMA8, H100, gpu_memory_utilization=0.15))


def test_max_model_len_larger_than_cache_fails_like_vllm() -> None:
    # An 8B model on a 24 GB L4 cannot hold one 131072-token sequence.
    with pytest.raises(EngineStartupError, match=r"max seq len \(131072\) is larger than the maximum number of tokens"):
        Engine(EngineConfig.resolve(LLAMA8, resolve_gpu("L4")))
    assert Engine(EngineConfig.resolve(LLAMA8, resolve_gpu("L4"), max_model_len=8192)).num_gpu_blocks > 512


def test_model_too_big_for_the_gpu() -> None:
    with pytest.raises(EngineStartupError, match="CUDA out of memory"):
        Engine(EngineConfig.resolve(resolve_model("Llama-3.1-70B"), H100))


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tensor_parallel_size": 3}, "divisible by tensor parallel size"),
        ({"max_num_batched_tokens": 128, "max_num_seqs": 256}, "greater than or equal to max_num_seqs"),
        ({"max_model_len": 200000}, "greater than the derived max_model_len"),
        ({"max_model_len": 0}, r"max_model_len \(0\) must be >= 1"),
        ({"block_size": 7}, "block_size"),
    ],
)
def test_invalid_configs_fail_startup_with_a_reason(changes: dict, match: str) -> None:
    with pytest.raises(EngineStartupError, match=match):
        Engine(EngineConfig.resolve(LLAMA8, H100).with_(**changes))


def test_vllm_default_batching() -> None:
    assert EngineConfig.resolve(LLAMA8, H100).max_num_batched_tokens == 8192
    assert EngineConfig.resolve(LLAMA8, H100).max_num_seqs == 1024
    a100 = EngineConfig.resolve(LLAMA8, resolve_gpu("A100-80GB"))
    assert (a100.max_num_batched_tokens, a100.max_num_seqs) == (2048, 256)
    assert EngineConfig.resolve(LLAMA8, H100).max_model_len == 131072
