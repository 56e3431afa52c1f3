"""Transformer shapes for the engine twin: read from a Hugging Face `config.json`, or a preset.

Decoder-only models with grouped-query attention: dense (Llama, Mistral, Qwen2/3, Yi, Phi-3)
and mixture-of-experts (Mixtral, Qwen2-/Qwen3-MoE, Llama 4), in 16-bit or FP8 weights.  A
`config.json` naming anything else (an architecture, an attention kind, a quantization) is refused
with a `ModelSpecError` that names it: the twin never prices one model as another.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpilot.api.documents import brief
from kvpilot.twin import jsonin

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "fp8": 1}

# The architectures (config.json `architectures`) whose layers the twin prices.  Llama 4's
# chunked local attention is priced as full attention: the same below `attention_chunk_size`
# (8192) tokens of context, more above it.
DENSE_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
})
MOE_ARCHITECTURES = frozenset({
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Llama4ForConditionalGeneration",
    "Llama4ForCausalLM",
})
# Weight quantizations the twin prices (weights of the decoder layers at one byte; embeddings,
# LM head and norms stay 16-bit, as in FP8 checkpoints such as RedHatAI's `-FP8-dynamic`).
QUANTIZATIONS = ("fp8",)


class ModelSpecError(ValueError):
    """A model name the twin does not know, or a config.json it cannot read or does not model."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int  # the dense MLP's (dense models, and the dense layers of interleaved MoE models)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    gated_mlp: bool = True  # SwiGLU: gate and up projections
    # Mixture of experts: routed experts per MoE layer (0: dense), experts each token goes to, one
    # expert's intermediate size, the shared experts' intermediate size (all of them together; 0:
    # none), and every `moe_layer_step`-th layer is an MoE layer (Llama 4 Maverick interleaves).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layer_step: int = 1
    # Weight quantization of the decoder layers' linear weights ("" for none, or "fp8").
    quantization: str = ""

    @property
    def dtype_bytes(self) -> int:
        """Bytes of an activation element and of the 16-bit weights (embeddings, LM head)."""
        return _DTYPE_BYTES.get(self.dtype, 2)

    @property
    def weight_bytes(self) -> int:
        """Bytes of one element of the decoder layers' linear weights."""
        return 1 if self.quantization == "fp8" else self.dtype_bytes

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers // self.moe_layer_step if self.is_moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def attention_params(self) -> int:
        h = self.hidden_size
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h

    def dense_mlp_params(self) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    def moe_mlp_params(self) -> int:
        """One MoE layer's MLP: the router, every routed expert and the shared experts."""
        h, m = self.hidden_size, 3 if self.gated_mlp else 2
        return h * self.num_experts + m * h * (self.num_experts * self.moe_intermediate_size
                                              + self.shared_expert_intermediate_size)

    def active_mlp_params(self) -> int:
        """Weights one token multiplies in an MoE layer's MLP (top-k experts and the shared ones)."""
        h, m = self.hidden_size, 3 if self.gated_mlp else 2
        return h * self.num_experts + m * h * (self.num_experts_per_tok * self.moe_intermediate_size
                                              + self.shared_expert_intermediate_size)

    def layer_params(self) -> int:
        """Weights of one layer, averaged over dense and MoE layers."""
        per_layer = self.num_dense_layers * self.dense_mlp_params() + self.num_moe_layers * self.moe_mlp_params()
        return self.attention_params() + per_layer // self.num_hidden_layers + 2 * self.hidden_size

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

    def as_hf_config(self) -> dict[str, Any]:
        """A Hugging Face `config.json` with these shapes (`from_hf_config` reads it back to this spec)."""
        config: dict[str, Any] = {
            "architectures": [("Mixtral" if self.is_moe else "Llama") + "ForCausalLM"],
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "torch_dtype": self.dtype,
        }
        if self.is_moe:
            config.update(architectures=["Qwen2MoeForCausalLM"], num_experts=self.num_experts,
                          num_experts_per_tok=self.num_experts_per_tok,
                          moe_intermediate_size=self.moe_intermediate_size,
                          shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                          decoder_sparse_step=self.moe_layer_step)
            if not self.num_dense_layers:
                config["intermediate_size"] = self.moe_intermediate_size
        if self.quantization:
            config["quantization_config"] = {"quant_method": self.quantization}
        return config

    def quantized(self, method: str) -> ModelSpec:
        """The same model with its decoder weights quantized (`method` one of QUANTIZATIONS)."""
        if method not in QUANTIZATIONS:
            raise ModelSpecError(f"quantization {method!r} is not modelled by the twin (it prices {', '.join(QUANTIZATIONS)})")
        return replace(self, quantization=method)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelSpec:
        """Shapes from a Hugging Face `config.json` dict; ModelSpecError for what the twin does not model,
        and for a field it uses that is missing or not a positive integer (naming the field)."""
        top = config
        text = config.get("text_config")
        if isinstance(text, dict):  # multimodal wrappers (Llama 4) keep the language model here
            config = {**text, "architectures": top.get("architectures"),
                      "quantization_config": top.get("quantization_config") or text.get("quantization_config"),
                      "torch_dtype": top.get("torch_dtype") or text.get("torch_dtype")}
        _check_supported(config)
        hidden = _size(config, "hidden_size")
        heads = _size(config, "num_attention_heads")
        # num_local_experts (Mixtral, Llama 4) or num_experts (Qwen MoE); 0 or absent: a dense model.
        experts_key = "num_local_experts" if config.get("num_local_experts") is not None else "num_experts"
        experts = _size(config, experts_key, default=0, minimum=0)
        moe: dict[str, Any] = {}
        dense_key = "intermediate_size_mlp" if config.get("intermediate_size_mlp") is not None else "intermediate_size"
        dense_inter = _size(config, dense_key, default=0, minimum=0)
        if experts:
            expert_key = "moe_intermediate_size" if config.get("moe_intermediate_size") is not None \
                else "intermediate_size"
            expert_inter = _size(config, expert_key)
            shared = _size(config, "shared_expert_intermediate_size", default=0, minimum=0)
            if config.get("intermediate_size_mlp") is not None:  # Llama 4: one shared expert of the expert size
                shared = expert_inter
            step_key = "interleave_moe_layer_step" if config.get("interleave_moe_layer_step") is not None \
                else "decoder_sparse_step"
            layer_step = _size(config, step_key, default=1)
            if layer_step == 1:
                dense_inter = 0  # every layer is an MoE layer: no dense MLP
            moe = dict(num_experts=experts, num_experts_per_tok=_size(config, "num_experts_per_tok"),
                       moe_intermediate_size=expert_inter, shared_expert_intermediate_size=shared,
                       moe_layer_step=layer_step)
        kv_heads = _size(config, "num_key_value_heads", default=heads)
        if config.get("head_dim") is None and hidden < heads:
            raise ModelSpecError(f"config.json field 'hidden_size' ({hidden}) must be at least num_attention_heads "
                                 f"({heads}) when head_dim is not given: head_dim is hidden_size / num_attention_heads")
        head_dim = _size(config, "head_dim", default=hidden // heads)
        spec = cls(
            name=name or str(top.get("_name_or_path") or config.get("model_type") or "custom")[:_MAX_NAME],
            hidden_size=hidden,
            intermediate_size=dense_inter,
            num_hidden_layers=_size(config, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=_size(config, "vocab_size"),
            max_position_embeddings=_size(config, "max_position_embeddings", default=4096),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
            dtype=_dtype(config),
            quantization=_quantization(config.get("quantization_config")),
            **moe,
        )
        if spec.num_dense_layers and spec.intermediate_size <= 0:
            raise ModelSpecError(f"config.json field {dense_key!r} must be a positive integer: the model has "
                                 f"{spec.num_dense_layers} dense layers")
        if spec.is_moe and spec.num_experts_per_tok > spec.num_experts:
            raise ModelSpecError(f"config.json routes each token to {spec.num_experts_per_tok} experts of "
                                 f"{spec.num_experts}")
        if spec.num_attention_heads % spec.num_key_value_heads:
            raise ModelSpecError("num_attention_heads must be a multiple of num_key_value_heads")
        return spec


# No shape of a published model comes near this; larger ones only make the arithmetic slow.
MAX_SIZE = 2**31 - 1
_MAX_NAME = 200


def _size(config: dict[str, Any], key: str, *, default: int | None = None, minimum: int = 1) -> int:
    """The integer field `key`, from `minimum` to MAX_SIZE; `default` when it is absent or null (or
    ModelSpecError naming it when there is none)."""
    value = config.get(key)
    if value is None:
        if default is None:
            raise ModelSpecError(f"config.json lacks {key!r}, which the twin needs")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_SIZE:
        kind = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise ModelSpecError(f"config.json field {key!r} must be {kind} (at most {MAX_SIZE}), got {brief(value)}")
    return value


def _dtype(config: dict[str, Any]) -> str:
    value = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    if not isinstance(value, str):
        raise ModelSpecError(f"config.json field 'torch_dtype' must be a string such as \"bfloat16\", got {brief(value)}")
    return value


def _check_supported(config: dict[str, Any]) -> None:
    """Refuse, naming it, what the twin would otherwise price as something else."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelSpecError(f"config.json field 'architectures' must be a list of names, got {brief(archs)}")
    known = DENSE_ARCHITECTURES | MOE_ARCHITECTURES
    unknown = [a for a in archs if a not in known]
    model_type = config.get("model_type")
    if unknown or not archs and model_type not in (None, "llama", "mistral", "qwen2", "qwen3"):
        what = ", ".join(brief(a) for a in unknown) or f"model_type {brief(model_type)}"
        raise ModelSpecError(
            f"the twin does not model the architecture {what}: it models {', '.join(sorted(known))}")
    if config.get("kv_lora_rank") or config.get("q_lora_rank"):
        raise ModelSpecError("the twin does not model multi-head latent attention (kv_lora_rank in config.json)")
    if config.get("sliding_window") is not None:
        window = _size(config, "sliding_window")
        if config.get("use_sliding_window", True) and window < _size(config, "max_position_embeddings", default=0,
                                                                      minimum=0):
            raise ModelSpecError(
                f"the twin does not model sliding-window attention (sliding_window {window} in config.json)")
    layer_types = config.get("layer_types")
    if layer_types:
        if not isinstance(layer_types, list):
            raise ModelSpecError(f"config.json field 'layer_types' must be a list, got {brief(layer_types)}")
        if any(t != "full_attention" for t in layer_types):
            raise ModelSpecError(
                "the twin does not model layers other than full attention (layer_types in config.json)")
    if config.get("first_k_dense_replace") or config.get("n_routed_experts"):
        raise ModelSpecError("the twin does not model DeepSeek-style experts (n_routed_experts in config.json)")


def _quantization(qc: Any) -> str:
    """"" for 16-bit weights, "fp8" for FP8 weights; ModelSpecError for any other quantization."""
    if not qc:
        return ""
    if not isinstance(qc, dict):
        raise ModelSpecError("config.json's 'quantization_config' must be an object")
    method = str(qc.get("quant_method") or "")[:_MAX_NAME]
    if method == "fp8":
        return "fp8"
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict):
            raise ModelSpecError(f"config.json field 'quantization_config.config_groups' must be an object, "
                                 f"got {brief(groups)}")
        weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
        if weights and all(isinstance(w, dict) and w.get("num_bits") == 8 and w.get("type") == "float"
                           for w in weights):
            return "fp8"
        method = f"compressed-tensors ({brief(qc.get('format') or 'not FP8')})"
    raise ModelSpecError(f"the twin does not model the quantization {method or brief(qc)!r}: it models "
                         f"{', '.join(QUANTIZATIONS)} weights and unquantized ones")


# A Hugging Face config.json is a few kilobytes (one with a long label map, a few hundred) and nests
# about four levels (quantization_config.config_groups.group_0.weights).
MAX_CONFIG_BYTES = jsonin.MAX_BYTES
MAX_CONFIG_DEPTH = jsonin.MAX_DEPTH


def read_model_config(path: str | Path, label: str = "model config") -> str:
    """The text of a `config.json` file (or of the one in a directory), reading at most MAX_CONFIG_BYTES + 1
    bytes of it (`/dev/zero` is a file too); ModelSpecError, its message starting with `label`'s words, when
    it cannot be read, is larger or is not UTF-8."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = jsonin.read_head(p, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ModelSpecError(f"cannot read {label} {str(p)!r}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ModelSpecError(f"{label} {str(p)!r} is larger than {MAX_CONFIG_BYTES // 1024} KiB: "
                             "a Hugging Face config.json is a few kilobytes")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ModelSpecError(f"{label} {str(p)!r} is not UTF-8 (byte offset {exc.start})") from None


def parse_model_config(text: str | bytes) -> dict[str, Any]:
    """A config.json's object, its size and nesting bounded before it is parsed (a deep one would
    exhaust the JSON parser's recursion); ModelSpecError saying what is wrong."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ModelSpecError(f"it is larger than {MAX_CONFIG_BYTES // 1024} KiB: a Hugging Face config.json "
                             "is a few kilobytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ModelSpecError(f"it is not UTF-8 (byte offset {exc.start})") from None
    if jsonin.too_deep(text, MAX_CONFIG_DEPTH):
        raise ModelSpecError(f"it nests more than {MAX_CONFIG_DEPTH} levels deep (a config.json nests about 4)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"it is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # an integer beyond Python's digit limit, ...
        raise ModelSpecError(f"it is not JSON the twin can read: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ModelSpecError("it must hold a JSON object")
    return data


def load_model_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """A ModelSpec from a `config.json` file (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    text = read_model_config(p)
    try:
        return ModelSpec.from_hf_config(parse_model_config(text), name=name or p.parent.name or None)
    except ModelSpecError as exc:
        raise ModelSpecError(f"model config {str(p)!r}: {exc}") from None


def _moe(name: str, hidden: int, layers: int, heads: int, kv: int, head_dim: int, vocab: int, max_pos: int, *,
         experts: int, top_k: int, expert_inter: int, shared: int = 0, step: int = 1, dense_inter: int = 0,
         tie: bool = False) -> ModelSpec:
    return ModelSpec(name, hidden, dense_inter if step > 1 else 0, layers, heads, kv, head_dim, vocab, max_pos, tie_word_embeddings=tie,
                     num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_inter,
                     shared_expert_intermediate_size=shared, moe_layer_step=step)


# Shapes copied from each model's published config.json.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, 131072),
        ModelSpec("Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128, 128256, 131072),
        ModelSpec("Llama-3.1-405B", 16384, 53248, 126, 128, 8, 128, 128256, 131072),
        ModelSpec("Llama-3-8B", 4096, 14336, 32, 32, 8, 128, 128256, 8192),
        ModelSpec("Llama-3-70B", 8192, 28672, 80, 64, 8, 128, 128256, 8192),
        ModelSpec("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, 131072, tie_word_embeddings=True),
        ModelSpec("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, 128256, 131072, tie_word_embeddings=True),
        ModelSpec("Llama-2-7B", 4096, 11008, 32, 32, 32, 128, 32000, 4096, dtype="float16"),
        ModelSpec("Llama-2-13B", 5120, 13824, 40, 40, 40, 128, 32000, 4096, dtype="float16"),
        ModelSpec("Llama-2-70B", 8192, 28672, 80, 64, 8, 128, 32000, 4096, dtype="float16"),
        ModelSpec("CodeLlama-7B", 4096, 11008, 32, 32, 32, 128, 32016, 16384),
        ModelSpec("CodeLlama-13B", 5120, 13824, 40, 40, 40, 128, 32016, 16384),
        ModelSpec("CodeLlama-34B", 8192, 22016, 48, 64, 8, 128, 32000, 16384),
        ModelSpec("CodeLlama-70B", 8192, 28672, 80, 64, 8, 128, 32016, 16384),
        ModelSpec("Mistral-7B", 4096, 14336, 32, 32, 8, 128, 32768, 32768),
        ModelSpec("Mistral-Nemo-12B", 5120, 14336, 40, 32, 8, 128, 131072, 1024000),
        ModelSpec("Mistral-Small-24B", 5120, 32768, 40, 32, 8, 128, 131072, 32768),
        ModelSpec("Yi-34B", 7168, 20480, 60, 56, 8, 128, 64000, 4096),
        ModelSpec("Yi-6B", 4096, 11008, 32, 32, 4, 128, 64000, 4096),
        ModelSpec("Phi-4", 5120, 17920, 40, 40, 10, 128, 100352, 16384),
        ModelSpec("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, 32768, tie_word_embeddings=True),
        ModelSpec("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 128, 151936, 32768, tie_word_embeddings=True),
        ModelSpec("Qwen2.5-3B", 2048, 11008, 36, 16, 2, 128, 151936, 32768, tie_word_embeddings=True),
        ModelSpec("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 128, 152064, 32768),
        ModelSpec("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 128, 152064, 32768),
        ModelSpec("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 128, 152064, 32768),
        ModelSpec("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 128, 152064, 32768),
        # Qwen3 dense: head_dim 128 is set explicitly (not hidden / heads) in their config.json.
        ModelSpec("Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936, 40960, tie_word_embeddings=True),
        ModelSpec("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936, 40960, tie_word_embeddings=True),
        ModelSpec("Qwen3-4B", 2560, 9728, 36, 32, 8, 128, 151936, 40960, tie_word_embeddings=True),
        ModelSpec("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, 40960),
        ModelSpec("Qwen3-14B", 5120, 17408, 40, 40, 8, 128, 151936, 40960),
        ModelSpec("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, 40960),
        # Mixture of experts.
        _moe("Mixtral-8x7B", 4096, 32, 32, 8, 128, 32000, 32768, experts=8, top_k=2, expert_inter=14336),
        _moe("Mixtral-8x22B", 6144, 56, 48, 8, 128, 32768, 65536, experts=8, top_k=2, expert_inter=16384),
        _moe("Qwen1.5-MoE-A2.7B", 2048, 24, 16, 16, 128, 151936, 8192, experts=60, top_k=4, expert_inter=1408,
             shared=5632),
        _moe("Qwen2-57B-A14B", 3584, 28, 28, 4, 128, 151936, 32768, experts=64, top_k=8, expert_inter=2560,
             shared=20480),
        _moe("Qwen3-30B-A3B", 2048, 48, 32, 4, 128, 151936, 40960, experts=128, top_k=8, expert_inter=768),
        _moe("Qwen3-235B-A22B", 4096, 94, 64, 4, 128, 151936, 40960, experts=128, top_k=8, expert_inter=1536),
        # Llama 4: every layer of Scout is MoE (16 experts, top-1, one shared expert of the expert
        # size); Maverick alternates dense layers (intermediate 16384) with MoE layers of 128 experts.
        _moe("Llama-4-Scout-17B-16E", 5120, 48, 40, 8, 128, 202048, 10485760, experts=16, top_k=1,
             expert_inter=8192, shared=8192, dense_inter=16384),
        _moe("Llama-4-Maverick-17B-128E", 5120, 48, 40, 8, 128, 202048, 1048576, experts=128, top_k=1,
             expert_inter=8192, shared=8192, step=2, dense_inter=16384),
    )
}

# Other names of the same shapes (fine-tunes and distillations keep their base's config).
_ALIASES = {
    "mistral-nemo": "Mistral-Nemo-12B",
    "mistral-small-24b": "Mistral-Small-24B",
    "mistral-small-3.1-24b": "Mistral-Small-24B",
    "llama-3.3-70b": "Llama-3.1-70B",
    "deepseek-r1-distill-llama-8b": "Llama-3.1-8B",
    "deepseek-r1-distill-llama-70b": "Llama-3.1-70B",
    "deepseek-r1-distill-qwen-14b": "Qwen2.5-14B",
    "deepseek-r1-distill-qwen-32b": "Qwen2.5-32B",
    "llama-4-scout-17b-16e": "Llama-4-Scout-17B-16E",
    "llama-4-maverick-17b-128e": "Llama-4-Maverick-17B-128E",
}

# Words in a Hugging Face id that do not change the shapes.
_NOISE = re.compile(r"-(instruct|chat|hf|it|base|python)(?=-|$)")
_VERSION = re.compile(r"-v\d+(\.\d+)*$")
# A published FP8 checkpoint's suffix (RedHatAI's `-FP8-dynamic`, `-FP8`, neuralmagic's `-FP8`).
_FP8 = re.compile(r"-fp8(-dynamic)?$")


def _key(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.removeprefix("meta-")
    key = _FP8.sub("", key)
    key = _NOISE.sub("", key)
    key = re.sub(r"-\d{4}$", "", key)  # date suffixes such as -2407
    key = _VERSION.sub("", key)
    return _NOISE.sub("", key)  # "-Instruct-v0.1": the version first, then the word


_INDEX: dict[str, str] = {**{_key(n): n for n in MODEL_PRESETS}, **_ALIASES}


def resolve_model(name: str) -> ModelSpec:
    """The preset for a model name or Hugging Face id, case-insensitively.

    `meta-llama/Llama-3.1-8B-Instruct`, `meta-llama/Meta-Llama-3.1-8B-Instruct`, `llama-3.1-8b`
    and `mistralai/Mistral-7B-Instruct-v0.3` all resolve; an id ending in `-FP8` or `-FP8-dynamic`
    is its base model with FP8 weights; anything else is a ModelSpecError listing the presets.
    """
    preset = _INDEX.get(_key(name))
    if preset is None:
        raise ModelSpecError(
            f"unknown model {name!r}: the twin has presets for {', '.join(MODEL_PRESETS)} "
            "(Hugging Face ids of these resolve too); give the model's config.json for any other model"
        )
    spec = MODEL_PRESETS[preset]
    if _FP8.search(name.strip().lower()):
        spec = spec.quantized("fp8")
    return spec
