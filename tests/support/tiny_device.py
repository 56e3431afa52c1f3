"""The tiny local model real vLLM runs on these CPUs (its config.json's shapes, as `make vllm-env` generates it)
and the device profile fitted for it on this host (benchmarks/twin_vs_vllm.py --calibrate): what the
tuner's twin is given to model that engine."""

from __future__ import annotations

import json
from pathlib import Path

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "vllm-cpu" / "profile.json"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 4096, "max_position_embeddings": 4096, "tie_word_embeddings": False, "dtype": "bfloat16"}


def tiny_model_dir(parent: Path) -> Path:
    """A model directory holding the tiny model's config.json (no weights: the twin needs the shapes)."""
    model = parent / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    return model
