"""Mixture-of-experts and FP8 models: read from config.json as published, priced by their experts,
and what the twin does not model refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.memory import weight_bytes_per_rank
from kvpilot.twin.models import MODEL_PRESETS, ModelSpec, ModelSpecError, resolve_model
from kvpilot.twin.steptime import StepTimeModel

GiB = 1 << 30

# Shapes as each model's published config.json gives them.
MIXTRAL: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "bfloat16",
}
QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}
LLAMA4_SCOUT_FP8: dict[str, Any] = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                            "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}},
    "text_config": {
        "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
        "max_position_embeddings": 10485760, "num_local_experts": 16, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "torch_dtype": "bfloat16",
    },
}


def test_mixtral_reads_as_its_preset() -> None:
    spec = ModelSpec.from_hf_config(MIXTRAL, name="Mixtral-8x7B")
    assert spec == MODEL_PRESETS["Mixtral-8x7B"]
    assert spec.is_moe and spec.num_moe_layers == 32 and spec.num_dense_layers == 0
    assert spec.num_params() == pytest.approx(46.7e9, rel=0.01)  # Mixtral's published total


def test_qwen3_moe_and_llama4_read_their_expert_shapes() -> None:
    qwen = ModelSpec.from_hf_config(QWEN3_MOE, name="Qwen3-30B-A3B")
    assert qwen == MODEL_PRESETS["Qwen3-30B-A3B"]
    assert qwen.num_params() == pytest.approx(30.5e9, rel=0.02)
    scout = ModelSpec.from_hf_config(LLAMA4_SCOUT_FP8, name="Llama-4-Scout-17B-16E")
    assert scout.quantization == "fp8"
    assert scout.shared_expert_intermediate_size == 8192 and scout.num_experts == 16
    assert scout.num_params() == pytest.approx(107.8e9, rel=0.02)  # the language model of the 109B


def test_an_fp8_checkpoint_name_resolves_to_its_base_with_fp8_weights() -> None:
    fp8 = resolve_model("RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic")
    bf16 = resolve_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert fp8.quantization == "fp8" and not bf16.quantization
    # One byte per decoder weight (plus scales) against two.
    ratio = weight_bytes_per_rank(fp8, 2) / weight_bytes_per_rank(bf16, 2)
    assert 0.5 < ratio < 0.56


@pytest.mark.parametrize(("change", "named"), [
    ({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}, "DeepseekV3ForCausalLM"),
    ({"architectures": ["MixtralForCausalLM"], "kv_lora_rank": 512}, "multi-head latent attention"),
    ({"sliding_window": 4096}, "sliding-window attention"),
    ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
])
def test_what_the_twin_does_not_model_is_refused_by_name(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelSpecError, match=named):
        ModelSpec.from_hf_config({**MIXTRAL, **change})


def test_mixtral_weights_hold_every_expert_sharded_by_tp() -> None:
    spec = MODEL_PRESETS["Mixtral-8x7B"]
    assert weight_bytes_per_rank(spec, 1) / GiB == pytest.approx(46.7e9 * 2 / GiB, rel=0.01)
    assert weight_bytes_per_rank(spec, 2) == pytest.approx(weight_bytes_per_rank(spec, 1) / 2, rel=0.01)


def test_a_moe_decode_step_reads_the_experts_its_tokens_touch() -> None:
    h100 = resolve_gpu("H100-80GB")
    moe = StepTimeModel(MODEL_PRESETS["Mixtral-8x7B"], h100, 2)
    # One token reads its top-2 experts of 8; 64 tokens touch all 8: the step costs more, far less
    # than 64 times more (memory bound).
    one, many = moe.linear_time(1), moe.linear_time(64)
    assert 2.0 < many / one < 6.0
    # A dense model of the same total weights streams them all for one token: slower than the MoE.
    dense = ModelSpec("dense-47b", 4096, 14336 * 8, 32, 32, 8, 128, 32000, 32768)
    assert StepTimeModel(dense, h100, 2).linear_time(1) > 1.8 * one


def test_fp8_gemms_run_faster_on_hopper_and_only_stream_faster_on_ampere() -> None:
    base = MODEL_PRESETS["Llama-3.1-70B"]
    fp8 = base.quantized("fp8")
    h100, a100 = resolve_gpu("H100-80GB"), resolve_gpu("A100-80GB")
    for gpu in (h100, a100):  # decode: half the weight bytes
        assert StepTimeModel(fp8, gpu, 4).linear_time(8) < 0.7 * StepTimeModel(base, gpu, 4).linear_time(8)
    # A large prefill is compute bound: FP8 tensor cores on Hopper, none on Ampere.
    assert StepTimeModel(fp8, h100, 4).linear_time(8192) < 0.7 * StepTimeModel(base, h100, 4).linear_time(8192)
    assert StepTimeModel(fp8, a100, 4).linear_time(8192) > 0.85 * StepTimeModel(base, a100, 4).linear_time(8192)
