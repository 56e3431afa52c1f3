"""GPU and model presets, Hugging Face config parsing."""

from __future__ import annotations

import argparse
import json

import pytest

from kvpilot.twin.flags import GPU_ENV, gpu_from_args
from kvpilot.twin.hardware import GPU_PRESETS, UnknownGpuError, resolve_gpu
from kvpilot.twin.models import MODEL_PRESETS, ModelSpec, ModelSpecError, load_model_config, resolve_model


@pytest.mark.parametrize("name", ["A100-80GB", "H100-80GB", "H200", "L40S", "L4", "A10G"])
def test_required_gpu_presets_exist_with_sane_figures(name: str) -> None:
    g = resolve_gpu(name)
    assert g.name == name
    assert 20 < g.total_memory_gib < 145
    assert 50e12 < g.bf16_flops < 1.2e15
    assert 0.2e12 < g.hbm_bandwidth < 5e12


def test_gpu_names_resolve_case_insensitively_and_by_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_gpu("h100").name == "H100-80GB"
    assert resolve_gpu("nvidia-a100-80gb").name == "A100-80GB"
    assert resolve_gpu("l40s").name == "L40S"
    monkeypatch.setenv(GPU_ENV, "L4")
    assert gpu_from_args(argparse.Namespace(gpu=None)).name == "L4"
    assert gpu_from_args(argparse.Namespace(gpu="H200")).name == "H200"
    monkeypatch.delenv(GPU_ENV)
    assert gpu_from_args(argparse.Namespace(gpu=None)).name == "H100-80GB"


def test_unknown_gpu_lists_the_presets() -> None:
    with pytest.raises(UnknownGpuError) as err:
        resolve_gpu("TPU-v5")
    for name in GPU_PRESETS:
        assert name in str(err.value)


@pytest.mark.parametrize(
    ("hf_id", "preset"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("meta-llama/llama-3.1-70b-instruct", "Llama-3.1-70B"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama-3-8B"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("qwen/qwen2.5-32b", "Qwen2.5-32B"),
        ("meta-llama/Llama-2-7b-hf", "Llama-2-7B"),
    ],
)
def test_hugging_face_ids_resolve_to_presets(hf_id: str, preset: str) -> None:
    assert resolve_model(hf_id).name == preset


def test_unknown_model_lists_presets() -> None:
    with pytest.raises(ModelSpecError) as err:
        resolve_model("google/gemma-2-9b")
    msg = str(err.value)
    assert "gemma-2-9b" in msg and "config.json" in msg
    for name in MODEL_PRESETS:
        assert name in msg


def test_llama_8b_parameter_count_matches_the_published_8_03b() -> None:
    assert abs(resolve_model("Llama-3.1-8B").num_params() - 8.03e9) < 0.01e9
    assert abs(resolve_model("Llama-3.1-70B").num_params() - 70.55e9) < 0.1e9


def test_model_from_hf_config_file(tmp_path) -> None:
    cfg = {
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model_config(tmp_path, name="tiny")
    assert m == ModelSpec("tiny", 2048, 5632, 22, 32, 4, 64, 32000, 2048)
    # K and V, 4 heads x 64 dims, 2 bytes, 22 layers.
    assert m.kv_bytes_per_token() == 2 * 4 * 64 * 2 * 22


def test_bad_hf_config_names_the_missing_field(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(ModelSpecError, match="num_attention_heads|intermediate_size"):
        load_model_config(tmp_path / "config.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ModelSpecError, match="not valid JSON"):
        load_model_config(tmp_path / "bad.json")
    with pytest.raises(ModelSpecError, match="cannot read"):
        load_model_config(tmp_path / "missing.json")
