"""Hostile Hugging Face config.json files: what a user, a script or an attacker hands `--model-config`
(`kvpilot validate --predict`, `twin run`/`serve`, `twin calibrate`) or `tune --model PATH`.  Each case is
raw bytes plus the words the one clear error must carry, or "valid".

Classes: size, nesting, encodings and JSON that is not an object, and every shape field the twin
divides or multiplies by missing, zero, negative, of the wrong type or absurdly large.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.twin.models import MAX_CONFIG_BYTES

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
MOE: dict[str, Any] = {**TINY, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                       "num_experts_per_tok": 2}


@dataclass(frozen=True)
class Case:
    id: str
    data: bytes
    expect: str  # "valid", or a phrase the error output must contain
    # What it runs through: `validate --predict` and `twin run` read every case; `tune` and `twin calibrate`
    # (the same reader, a second's start-up each) one case of each kind.
    commands: tuple[str, ...] = ("predict", "twin-run", "tune", "calibrate")


def _with(base: dict[str, Any] | None = None, **fields: Any) -> bytes:
    config = {**(TINY if base is None else base), **fields}
    return json.dumps({k: v for k, v in config.items() if v is not _DROP}).encode()


_DROP = object()


def _field_cases(field: str, base: dict[str, Any] | None = None) -> list[Case]:
    phrase = f"'{field}' must be a positive integer"
    some = ("predict", "twin-run")
    return [
        Case(f"{field}-zero", _with(base, **{field: 0}), phrase),
        Case(f"{field}-negative", _with(base, **{field: -8}), phrase, some),
        Case(f"{field}-string", _with(base, **{field: "32"}), phrase, some),
        Case(f"{field}-float", _with(base, **{field: 32.5}), phrase, some),
        Case(f"{field}-bool", _with(base, **{field: True}), phrase, some),
        Case(f"{field}-huge", _with(base, **{field: 10**40}), phrase, some),
        Case(f"{field}-list", _with(base, **{field: [1] * 1000}), phrase, some),
    ]


CASES: list[Case] = [
    Case("tiny-is-fine", _with(), "valid", ("predict", "twin-run")),
    Case("moe-is-fine", _with(MOE), "valid", ("predict", "twin-run")),
    # --- size, nesting, encoding, not an object
    Case("too-large", b'{"a": "' + b"x" * MAX_CONFIG_BYTES + b'"}', "larger than 1024 KiB"),
    Case("deep-2000", b'{"a":' * 2000 + b"1" + b"}" * 2000, "nests more than 32 levels"),
    Case("deep-list-300k", b"[" * 300_000, "nests more than 32 levels"),
    Case("deep-inside-a-string-is-fine", _with(note="[" * 5000), "valid", ("predict", "twin-run")),
    Case("wide-list-of-objects", _with(x=[{}] * 200_000).replace(b'"hidden_size": 256, ', b""),
         "lacks 'hidden_size'"),
    Case("int-5000-digits", b'{"hidden_size": ' + b"9" * 5000 + b"}", "not JSON the twin can read"),
    Case("not-json", b"{hidden_size: 4096}", "not valid JSON"),
    Case("not-an-object", b"[1, 2, 3]", "must hold a JSON object"),
    Case("not-utf8", b'{"model_type": "caf\xe9"}', "not UTF-8"),
    Case("empty", b"", "not valid JSON"),
    # --- the shape fields
    *_field_cases("num_attention_heads"),
    *_field_cases("hidden_size"),
    *_field_cases("num_hidden_layers"),
    *_field_cases("num_key_value_heads"),
    *_field_cases("vocab_size"),
    *_field_cases("head_dim"),
    *_field_cases("max_position_embeddings"),
    *_field_cases("num_experts_per_tok", MOE),
    Case("intermediate_size-zero", _with(intermediate_size=0), "'intermediate_size' must be a positive integer"),
    Case("num_hidden_layers-missing", _with(num_hidden_layers=_DROP), "lacks 'num_hidden_layers'"),
    Case("hidden-smaller-than-heads", _with(hidden_size=2), "must be at least num_attention_heads"),
    Case("heads-not-a-multiple", _with(num_key_value_heads=3), "multiple of num_key_value_heads"),
    Case("experts-negative", _with(MOE, num_local_experts=-4), "'num_local_experts' must be an integer of at least 0"),
    Case("sliding-window-string", _with(sliding_window="4096"), "'sliding_window' must be a positive integer"),
    Case("layer-types-not-a-list", _with(layer_types=7), "'layer_types' must be a list"),
    Case("dtype-not-a-string", _with(torch_dtype={"a": 1}), "'torch_dtype' must be a string"),
    Case("config-groups-a-list", _with(quantization_config={"quant_method": "compressed-tensors",
                                                            "config_groups": [1, 2]}), "config_groups"),
    Case("config-groups-weights-a-list", _with(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {"g": {"weights": [8]}}}), "compressed-tensors"),
    Case("architecture-long-name", _with(architectures=["X" * 100_000]), "does not model the architecture"),
]
