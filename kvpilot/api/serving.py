"""The typed engine flags of an InferenceService: what the operator puts on the engine's command line
(`vllm serve` or `kvpilot twin serve`) and what `kvpilot validate --predict` starts the twin's engine
with, from one function so the two can never differ."""

from __future__ import annotations

from typing import Any

from kvpilot.api.engine import render_flags
from kvpilot.api.models import EngineSpec, InferenceServiceSpec
from kvpilot.api.tuned import TUNED


def typed_values(spec: InferenceServiceSpec, engine: EngineSpec | None = None) -> dict[str, Any]:
    """The typed engine fields (camelCase, the codec's keys) of `engine` (spec.engine unless given);
    None where a field is unset, so vLLM resolves it."""
    engine = engine or spec.engine
    tracing = spec.observability.tracing
    return {
        # The tuned fields always explicit (vLLM's value when unset), so status and hash show what really runs.
        **{f.name: engine.in_force(f) for f in TUNED},
        "kvCacheMemoryBytes": engine.kv_cache_memory_bytes,
        "maxModelLen": engine.max_model_len,
        "tensorParallelSize": engine.tensor_parallel_size,
        "blockSize": engine.block_size,
        "kvCacheDtype": engine.kv_cache_dtype,
        "longPrefillTokenThreshold": engine.long_prefill_token_threshold,
        "shutdownTimeoutSeconds": spec.rollout.shutdown_timeout_seconds,
        "otlpTracesEndpoint": tracing.otlp_traces_endpoint if tracing else None,
        "collectDetailedTraces": list(tracing.collect_detailed_traces) if tracing else None,
    }


def typed_flags(spec: InferenceServiceSpec, engine: EngineSpec | None = None) -> list[str]:
    """The typed engine fields as vLLM flags (the codec's order); unset optional fields are left out."""
    return render_flags(typed_values(spec, engine))
