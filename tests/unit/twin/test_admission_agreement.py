"""The admission prediction's promise: `predict` refuses exactly the configs the twin's start-up refuses, with the
same words, and refuses none that it starts.

The twin's side is its real start-up entry, not the prediction: the operator renders an engine.kind twin
pod's command line for the service (`kvpilot twin serve ...`, builders.engine.engine_args), the real
`kvpilot` parser reads it, `engine_config_from_args` resolves it (naming the model and the GPU itself) and
`Engine(config)` starts the engine, which is what `serve_command` does before it opens its port.  A few of
the refused configs also run as a real `kvpilot twin serve` process, whose stderr must carry the message,
and one predicted to start runs until healthy, reporting the predicted block count.

The prediction's side is the same service as engine.kind vllm on spec.resources.gpuType (the product label,
or the twin's name for the GPU), so the gpuType mapping is checked too.  Combinations are drawn seeded
over model (18 presets, and a tenth as a config.json of a preset's shapes, the ConfigMap path), GPU (6),
tensorParallelSize, maxModelLen, gpuMemoryUtilization (or kvCacheMemoryBytes), maxNumBatchedTokens,
maxNumSeqs, blockSize and kvCacheDtype; the draws the API itself refuses are drawn again.
`benchmarks/admission_agreement.py` prints how many were drawn and refused and how long it took.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import pytest

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


def test_predict_refuses_exactly_what_the_twin_refuses_with_the_same_words(tmp_path: Path) -> None:
    all_cases, _invalid = cases()
    assert len(all_cases) >= 2000
    counts = agreement(all_cases, tmp_path)
    assert counts["started"] + counts["refused"] == len(all_cases)
    # The set is useful only if it exercises both sides and every way of refusing.
    assert counts["started"] > 200 and counts["refused"] > 200, counts
    kinds = {k for k in counts if k.startswith("refused: ")}
    for wording in ("CUDA out of memory while loading the model weights", "No available memory for the cache blocks",
                    "The model's max seq len", "User-specified max_model_len", "Total number of attention heads",
                    "Free memory on device cuda:0"):
        assert any(k.startswith("refused: " + wording[:40]) for k in kinds), (wording, sorted(kinds))


def test_the_real_twin_serve_process_prints_the_predicted_failure(tmp_path: Path) -> None:
    """One case per kind of refusal, through a real `kvpilot twin serve` process: it exits 1 at start-up
    and its vLLM-worded error line is the prediction's failure."""
    all_cases, _ = cases(400, seed=SEED + 1)
    picked: dict[str, Case] = {}
    for case in all_cases:
        if case.config is not None:
            continue
        failure = predict(case.service("vllm")).failure
        if failure is not None:
            picked.setdefault(failure.split(" (")[0][:30], case)
        if len(picked) >= 4:
            break
    assert len(picked) >= 4
    for case in picked.values():
        failure = predict(case.service("vllm")).failure
        argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in engine_args(case.service("twin"))]
        argv[argv.index("--port") + 1] = "0"
        proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "twin", "serve", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert f"ValueError: {failure}" in proc.stderr


if __name__ == "__main__":  # pragma: no cover - benchmarks/admission_agreement.py is the printing entry
    pytest.main([__file__, "-q"])


def test_a_real_twin_pod_command_starts_with_the_predicted_kv_cache(tmp_path: Path) -> None:
    """A config predicted to start, a model from a config.json (the pod's mounted ConfigMap): the real
    `kvpilot twin serve` process gets healthy and reports the predicted block count in vllm:cache_config_info."""
    import re
    import urllib.request

    from tests.support.twin_process import twin_server

    config = hf_config(MODEL_PRESETS["Qwen2.5-0.5B"])
    case = Case("acme/small-chat", config, "L4", "NVIDIA-L4",
                {"maxModelLen": 4096, "maxNumBatchedTokens": 2048, "maxNumSeqs": 64, "gpuMemoryUtilization": 0.8})
    p = predict(case.service("vllm"), model_config=json.dumps(config))
    assert p.failure is None and p.plan is not None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = engine_args(case.service("twin"))
    for flag in ("--port", "--host"):  # the harness picks a free port on 127.0.0.1
        i = argv.index(flag)
        del argv[i:i + 2]
    argv = [str(path) if a == MODEL_CONFIG_PATH else a for a in argv]
    with twin_server(*argv, log_dir=tmp_path) as twin, urllib.request.urlopen(twin.metrics_url, timeout=10) as resp:
        metrics = resp.read().decode()
    m = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', metrics, flags=re.M)
    assert m is not None, metrics[:2000]
    assert int(m.group(1)) == p.plan.num_gpu_blocks
