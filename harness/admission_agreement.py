"""The admission-agreement check's cases and its count: seeded InferenceServices over model, GPU and engine
flags, each started by the twin as an engine.kind twin pod would start it and predicted by
`kvpilot.twin.admission.predict`.  tests/unit/twin/test_admission_agreement.py asserts they agree;
benchmarks/admission_agreement.py prints what they cover.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from kvpilot.api.models import InferenceService
from kvpilot.cli import build_parser
from kvpilot.operator.builders.engine import MODEL_CONFIG_PATH, engine_args
from kvpilot.twin.admission import predict
from kvpilot.twin.engine import Engine, EngineStartupError
from kvpilot.twin.flags import engine_config_from_args
from kvpilot.twin.hardware import GPU_PRESETS
from kvpilot.twin.models import MODEL_PRESETS, ModelSpec

SEED = 18
COMBINATIONS = 2400

_TP = (1, 1, 1, 2, 2, 4, 8)
_LENGTHS = (None, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_SEQS = (1, 16, 64, 128, 256, 512, 1024)
_DTYPES = ("auto", "auto", "auto", "fp8", "fp8_e5m2", "bfloat16")
_BLOCKS = (16, 16, 16, 32, 8, 128)


def hf_config(model: ModelSpec) -> dict[str, Any]:
    """A Hugging Face config.json with a preset's shapes."""
    return model.as_hf_config()


@dataclass(frozen=True)
class Case:
    model: str  # preset name, or a Hugging Face id with no preset when `config` is set
    config: dict[str, Any] | None
    gpu: str  # twin GPU name
    gpu_type: str  # what spec.resources.gpuType says (product label or twin name)
    engine: dict[str, Any]

    def service(self, kind: str) -> InferenceService:
        spec: dict[str, Any] = {
            "model": self.model,
            "engine": {**self.engine, "kind": kind, "twin": {"gpu": self.gpu}},
            "resources": {"gpus": self.engine.get("tensorParallelSize", 1), "gpuType": self.gpu_type},
        }
        if self.config is not None:
            spec["modelConfig"] = {"configMapRef": {"name": "model-config"}}
        return InferenceService.model_validate({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                                "metadata": {"name": "svc"}, "spec": spec})


def draw(rng: random.Random) -> Case:
    preset = rng.choice(list(MODEL_PRESETS.values()))
    gpu = rng.choice(list(GPU_PRESETS.values()))
    engine: dict[str, Any] = {
        "tensorParallelSize": rng.choice(_TP),
        "maxNumBatchedTokens": rng.choice(_TOKENS),
        "maxNumSeqs": rng.choice(_SEQS),
        "blockSize": rng.choice(_BLOCKS),
        "kvCacheDtype": rng.choice(_DTYPES),
    }
    # Mostly lengths the model has (so memory decides), sometimes past its max_position_embeddings.
    fitting = [n for n in _LENGTHS if n is None or n <= preset.max_position_embeddings]
    length = rng.choice(fitting if rng.random() < 0.85 else _LENGTHS)
    if length is not None:
        engine["maxModelLen"] = length
    r = rng.random()
    if r < 0.8:
        engine["gpuMemoryUtilization"] = round(rng.uniform(0.3, 0.99), 2)
    elif r < 0.9:
        engine["kvCacheMemoryBytes"] = rng.choice((1, 4, 16, 40, 80, 120)) << 30
    # else: neither, vLLM's default fraction
    as_config = rng.random() < 0.1
    return Case(
        model=f"acme/{preset.name.lower()}-finetune" if as_config else preset.name,
        config=hf_config(preset) if as_config else None,
        gpu=gpu.name,
        gpu_type=gpu.product_label if rng.random() < 0.7 else gpu.name,
        engine=engine,
    )


def cases(n: int = COMBINATIONS, seed: int = SEED) -> tuple[list[Case], int]:
    """`n` cases the API accepts, and how many draws it refused on the way."""
    rng = random.Random(seed)
    out: list[Case] = []
    invalid = 0
    while len(out) < n:
        case = draw(rng)
        try:
            case.service("twin")
        except pydantic.ValidationError:
            invalid += 1
            continue
        out.append(case)
    return out, invalid


_PARSER = build_parser()


def twin_startup(case: Case, config_path: Path) -> str | None:
    """Start the twin's engine as an engine.kind twin pod of the service would; its start-up error, or None."""
    argv = engine_args(case.service("twin"))
    # The pod's mounted ConfigMap is this file here.
    argv = [str(config_path) if a == MODEL_CONFIG_PATH else a for a in argv]
    args = _PARSER.parse_args(["twin", "serve", *argv])
    assert args.handler.__name__ == "serve_command"
    config = engine_config_from_args(args)
    try:
        Engine(config)
    except EngineStartupError as exc:
        return str(exc)
    return None


def agreement(all_cases: list[Case], tmp: Path) -> Counter[str]:
    """Check every case; count started / refused (by kind of refusal)."""
    counts: Counter[str] = Counter()
    for i, case in enumerate(all_cases):
        path = tmp / f"config-{i}.json"
        if case.config is not None:
            path.write_text(json.dumps(case.config))
        expected = twin_startup(case, path)
        p = predict(case.service("vllm"), model_config=json.dumps(case.config) if case.config else None)
        assert p.missing == (), (case, p.missing)
        assert p.failure == expected, (case, p.failure, expected)
        if expected is None:
            assert p.plan is not None and p.kv_cache_tokens and p.kv_cache_tokens >= (p.max_model_len or 0)
            counts["started"] += 1
        else:
            counts["refused"] += 1
            counts["refused: " + expected.split(" (")[0].split(".")[0][:48]] += 1
    return counts
