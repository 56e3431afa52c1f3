"""Admission-time prediction: would vLLM start with this InferenceService, and with how much KV cache?

`predict(service)` starts the twin's engine as an engine.kind twin pod would, so the prediction and
the twin's start-up cannot disagree.  What it needs and when it warns: docs/architecture.md,
"Admission-time prediction".
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.api import serving
from kvpilot.api.models import InferenceService, InferenceServiceSpec
from kvpilot.twin.engine import EngineConfig
from kvpilot.twin.flags import add_engine_arguments, engine_config_from_args
from kvpilot.twin.hardware import GPU_PRESETS, GiB, GpuSpec, UnknownGpuError, resolve_gpu
from kvpilot.twin.memory import EngineStartupError, MemoryPlan
from kvpilot.twin.models import MODEL_PRESETS, ModelSpec, ModelSpecError, parse_model_config, resolve_model
from kvpilot.twin.workload import SHAREGPT_OUTPUT, SHAREGPT_PROMPT

__all__ = ["AVERAGE_SEQUENCE_TOKENS", "HIGH_UTILIZATION", "Prediction", "predict"]

# Above this gpuMemoryUtilization a prediction warns.
HIGH_UTILIZATION = 0.95
# The average sequence (prompt + output) the KV-cache warning counts in: the twin's default workload.
AVERAGE_SEQUENCE_TOKENS = round(SHAREGPT_PROMPT.mean() + SHAREGPT_OUTPUT.mean())


@dataclass(frozen=True)
class Prediction:
    """What vLLM would do at start-up with one InferenceService.

    missing   what is unknown, so nothing was predicted (empty when model and GPU were known)
    plan      the memory plan vLLM would size its KV cache with (None when missing or refused)
    failure   vLLM's start-up error, in its words, when it would refuse to start (else None)
    warnings  risky but legal settings
    """

    missing: tuple[str, ...] = ()
    plan: MemoryPlan | None = None
    failure: str | None = None
    warnings: tuple[str, ...] = ()
    model: str | None = None  # the model the twin sized (preset or config.json name)
    gpu: str | None = None  # the twin's GPU name
    config: EngineConfig | None = field(default=None, repr=False, compare=False)

    @property
    def refused(self) -> bool:
        return self.failure is not None

    @property
    def max_model_len(self) -> int | None:
        return self.config.max_model_len if self.config is not None else None

    @property
    def weights_per_gpu_gib(self) -> float | None:
        return self.plan.weights_bytes / GiB if self.plan is not None else None

    @property
    def kv_cache_tokens(self) -> int | None:
        return self.plan.kv_cache_tokens if self.plan is not None else None

    @property
    def max_concurrency(self) -> float | None:
        """How many maxModelLen sequences fit in the KV cache at once (vLLM logs it as "Maximum
        concurrency for N tokens per request")."""
        if self.plan is None or self.config is None:
            return None
        return self.plan.max_concurrency(self.config.max_model_len)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "gpu": self.gpu, "missing": list(self.missing),
                               "failure": self.failure, "warnings": list(self.warnings)}
        if self.config is not None:
            out["engine"] = self.config.as_dict()
        if self.plan is not None:
            out["weightsPerGpuGiB"] = round(self.weights_per_gpu_gib or 0.0, 2)
            out["kvCacheTokens"] = self.kv_cache_tokens
            out["maxModelLen"] = self.max_model_len
            out["maxConcurrency"] = round(self.max_concurrency or 0.0, 2)
            out["memoryPlan"] = self.plan.as_dict()
        return out


class _FlagError(Exception):
    """The twin's flag parser refused an argument (its `kvpilot twin serve` would exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # raise, not exit: this runs inside a webhook
        raise _FlagError(message)


@functools.cache
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvpilot twin serve", add_help=False, allow_abbrev=False)
    add_engine_arguments(parser)
    return parser


def _spec_of(service: InferenceService | InferenceServiceSpec) -> InferenceServiceSpec:
    return service.spec if isinstance(service, InferenceService) else service


def _model(spec: InferenceServiceSpec, model_config: ModelSpec | Mapping[str, Any] | str | None,
           missing: list[str]) -> ModelSpec | None:
    if isinstance(model_config, ModelSpec):
        return model_config
    if model_config is not None:
        try:
            if isinstance(model_config, str):  # the file's text, as a ConfigMap holds it
                model_config = parse_model_config(model_config)
            return ModelSpec.from_hf_config(dict(model_config), name=spec.model)
        except ModelSpecError as exc:
            missing.append(f"model: the config.json given for {spec.model!r} cannot be used: {exc}")
            return None
    ref = spec.model_config_ref
    if ref is not None:
        missing.append(f"model: spec.modelConfig names ConfigMap {ref.config_map_ref.name!r} key "
                       f"{ref.config_map_ref.key!r}, which was not supplied (put the ConfigMap in the same input, "
                       "or pass --model-config PATH)")
        return None
    try:
        return resolve_model(spec.model)
    except ModelSpecError:
        missing.append(f"model: {spec.model!r} is not a twin preset ({', '.join(MODEL_PRESETS)}) and no "
                       "config.json was given (spec.modelConfig, or --model-config PATH)")
        return None


def _gpu(spec: InferenceServiceSpec, missing: list[str]) -> GpuSpec | None:
    known = ", ".join(f"{g.name} ({g.product_label})" for g in GPU_PRESETS.values())
    name, where = spec.engine.twin.gpu, "spec.engine.twin.gpu"
    if spec.engine.kind != "twin":
        where = "spec.resources.gpuType"
        if spec.resources.gpu_type is not None:
            name = spec.resources.gpu_type
        else:
            missing.append(f"GPU: spec.resources.gpuType is not set; set it to the nodes' nvidia.com/gpu.product "
                           f"value (the twin models {known})")
            return None
    try:
        return resolve_gpu(name)
    except UnknownGpuError:
        missing.append(f"GPU: {where} {name!r} is not a GPU the twin models (it models {known})")
        return None


def _warnings(spec: InferenceServiceSpec, config: EngineConfig | None, plan: MemoryPlan | None) -> list[str]:
    out: list[str] = []
    util = config.gpu_memory_utilization if config is not None else spec.engine.effective_gpu_memory_utilization
    if util is not None and util > HIGH_UTILIZATION:
        out.append(f"engine.gpuMemoryUtilization {util:g} is above {HIGH_UTILIZATION:g}: what is left outside "
                   "vLLM's budget must hold other processes, allocator fragmentation and anything vLLM's "
                   "estimates miss, so the engine may run out of memory under load")
    if plan is not None and config is not None:
        average = min(AVERAGE_SEQUENCE_TOKENS, config.max_model_len)
        fits = plan.kv_cache_tokens // average
        if fits < config.max_num_seqs:
            out.append(f"the KV cache holds {plan.kv_cache_tokens} tokens: {fits} sequences of {average} tokens "
                       f"(the average request), fewer than engine.maxNumSeqs {config.max_num_seqs}; vLLM will "
                       "preempt requests before it runs that many")
    return out


def predict(service: InferenceService | InferenceServiceSpec, *,
            model_config: ModelSpec | Mapping[str, Any] | str | None = None) -> Prediction:
    """Start the twin's engine as an engine.kind twin pod of `service` would, and say what happened.

    `model_config`: the model's Hugging Face config.json (its text, parsed, or as a ModelSpec), for a model that is
    not a twin preset or whose spec.modelConfig ConfigMap the caller has read.  Never raises for a
    valid InferenceService."""
    spec = _spec_of(service)
    missing: list[str] = []
    model = _model(spec, model_config, missing)
    gpu = _gpu(spec, missing)
    if model is None or gpu is None:
        return Prediction(missing=tuple(missing), warnings=tuple(_warnings(spec, None, None)),
                          model=model.name if model else None, gpu=gpu.name if gpu else None)
    argv = (spec.model, *serving.typed_flags(spec), "--gpu", gpu.name)
    config, plan, failure = _start_up(argv, model, gpu)
    return Prediction(missing=(), plan=plan, failure=failure, warnings=tuple(_warnings(spec, config, plan)),
                      model=model.name, gpu=gpu.name, config=config)


@functools.lru_cache(maxsize=4096)
def _start_up(argv: tuple[str, ...], model: ModelSpec,
              gpu: GpuSpec) -> tuple[EngineConfig | None, MemoryPlan | None, str | None]:
    """The twin's start-up for a `kvpilot twin serve` command line: (config, plan, failure).  Pure (every
    input is immutable), so cached: an admission webhook sees the same few engines over and over."""
    config: EngineConfig | None = None
    try:
        args = _parser().parse_args(list(argv))
        config = engine_config_from_args(args, model=model, gpu=gpu)
        return config, config.memory_plan(), None  # what Engine(config) runs first, and the only part that refuses
    except EngineStartupError as exc:
        return config, None, str(exc)
    except _FlagError as exc:  # the twin's `vllm serve` parser would exit 2 with this
        return config, None, str(exc)
