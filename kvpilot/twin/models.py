"""Transformer shapes for the engine twin: read from a Hugging Face `config.json`, or a preset.

Only dense decoder-only models (Llama, Mistral, Qwen2 and Qwen3 families) are described; the twin needs
the shapes that decide weight memory, KV-cache bytes per token and FLOPs per token.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1}


class ModelSpecError(ValueError):
    """A model name the twin does not know, or a config.json it cannot read."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    gated_mlp: bool = True  # SwiGLU: gate and up projections

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES.get(self.dtype, 2)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = (3 if self.gated_mlp else 2) * h * i
        return attn + mlp + 2 * h  # two RMSNorm weights

    def num_params(self) -> int:
        emb = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else emb
        return emb + head + self.num_hidden_layers * self.layer_params() + self.hidden_size

    def kv_heads_per_rank(self, tp: int) -> int:
        # vLLM replicates KV heads when TP exceeds their number.
        return max(1, self.num_key_value_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1, kv_dtype_bytes: int | None = None) -> int:
        """KV-cache bytes per token per rank, all layers (K and V)."""
        b = self.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * b * self.num_hidden_layers

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelSpec:
        """Shapes from a Hugging Face `config.json` dict (Llama / Mistral / Qwen2 style)."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            spec = cls(
                name=name or str(config.get("_name_or_path") or config.get("model_type") or "custom"),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            )
        except KeyError as exc:
            raise ModelSpecError(f"config.json lacks {exc.args[0]!r}, which the twin needs") from None
        except (TypeError, ValueError) as exc:
            raise ModelSpecError(f"config.json has a field of the wrong type: {exc}") from None
        if min(spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers, spec.num_attention_heads,
               spec.num_key_value_heads, spec.head_dim, spec.vocab_size) <= 0:
            raise ModelSpecError("config.json sizes must all be positive")
        if spec.num_attention_heads % spec.num_key_value_heads:
            raise ModelSpecError("num_attention_heads must be a multiple of num_key_value_heads")
        return spec


def load_model_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a `config.json` file (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ModelSpecError(f"cannot read model config {str(p)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"model config {str(p)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelSpecError(f"model config {str(p)!r} must hold a JSON object")
    return ModelSpec.from_hf_config(data, name=name or p.parent.name or None)


# Shapes copied from each model's published config.json.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, 131072),
        ModelSpec("Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128, 128256, 131072),
        ModelSpec("Llama-3-8B", 4096, 14336, 32, 32, 8, 128, 128256, 8192),
        ModelSpec("Llama-3-70B", 8192, 28672, 80, 64, 8, 128, 128256, 8192),
        ModelSpec("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, 131072, tie_word_embeddings=True),
        ModelSpec("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, 128256, 131072, tie_word_embeddings=True),
        ModelSpec("Llama-2-7B", 4096, 11008, 32, 32, 32, 128, 32000, 4096, dtype="float16"),
        ModelSpec("Llama-2-13B", 5120, 13824, 40, 40, 40, 128, 32000, 4096, dtype="float16"),
        ModelSpec("Mistral-7B", 4096, 14336, 32, 32, 8, 128, 32768, 32768),
        ModelSpec("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, 32768, tie_word_embeddings=True),
        ModelSpec("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 128, 152064, 32768),
        ModelSpec("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 128, 152064, 32768),
        ModelSpec("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 128, 152064, 32768),
        ModelSpec("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 128, 152064, 32768),
        # Qwen3 dense: head_dim 128 is set explicitly (not hidden / heads) in their config.json.
        ModelSpec("Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936, 40960, tie_word_embeddings=True),
        ModelSpec("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, 40960),
        ModelSpec("Qwen3-14B", 5120, 17408, 40, 40, 8, 128, 151936, 40960),
        ModelSpec("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, 40960),
    )
}

# Words in a Hugging Face id that do not change the shapes.
_NOISE = re.compile(r"-(instruct|chat|hf|it|base)(?=-|$)")
_VERSION = re.compile(r"-v\d+(\.\d+)*$")


def _key(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.removeprefix("meta-")
    key = _NOISE.sub("", key)
    key = re.sub(r"-\d{4}$", "", key)  # date suffixes such as -2407
    return _VERSION.sub("", key)


_INDEX: dict[str, str] = {_key(n): n for n in MODEL_PRESETS}


def resolve_model(name: str) -> ModelSpec:
    """The preset for a model name or Hugging Face id, case-insensitively.

    `meta-llama/Llama-3.1-8B-Instruct`, `meta-llama/Meta-Llama-3.1-8B-Instruct`, `llama-3.1-8b`
    and `mistralai/Mistral-7B-Instruct-v0.3` all resolve; anything else is a ModelSpecError
    listing the presets.
    """
    preset = _INDEX.get(_key(name))
    if preset is None:
        raise ModelSpecError(
            f"unknown model {name!r}: the twin has presets for {', '.join(MODEL_PRESETS)} "
            "(Hugging Face ids of these resolve too); pass --model-config config.json for any other model"
        )
    return MODEL_PRESETS[preset]
