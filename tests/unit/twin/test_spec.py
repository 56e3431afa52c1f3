"""EngineConfig from an InferenceService, through the vllm serve flags."""

from __future__ import annotations

import pytest

from kvpilot.api import InferenceService
from kvpilot.twin.engine import Engine
from kvpilot.twin.spec import SpecFlagError, engine_config_from_spec


def isvc(engine: dict) -> InferenceService:
    return InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "default"},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "engine": engine},
    })


def test_typed_fields_and_extra_args_reach_the_engine_config() -> None:
    cfg = engine_config_from_spec(isvc({
        "kind": "twin", "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128,
        "maxModelLen": 16384, "longPrefillTokenThreshold": 512, "twin": {"gpu": "A100-80GB"},
        "extraArgs": ["--no-enable-prefix-caching", "--disable-log-requests"],
    }))
    assert cfg.model.name == "Llama-3.1-8B" and cfg.gpu.name == "A100-80GB"
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len) == (4096, 128, 16384)
    assert cfg.gpu_memory_utilization == 0.85 and cfg.long_prefill_token_threshold == 512
    assert cfg.enable_prefix_caching is False
    assert cfg.served_model_name == "meta-llama/Llama-3.1-8B-Instruct"
    assert Engine(cfg).num_gpu_blocks > 0


def test_gpu_override_and_kv_cache_bytes() -> None:
    cfg = engine_config_from_spec(isvc({"kvCacheMemoryBytes": 8 * 2**30, "maxModelLen": 8192}), gpu="H200")
    assert cfg.gpu.name == "H200" and cfg.kv_cache_memory_bytes == 8 * 2**30 and cfg.gpu_memory_utilization is None
    assert Engine(cfg).num_gpu_blocks == 8 * 2**30 // (16 * 131072)


def test_unknown_extra_flag_is_refused() -> None:
    with pytest.raises(SpecFlagError, match="unrecognized arguments"):
        engine_config_from_spec(isvc({"extraArgs": ["--speculative-config", "{}"]}))
