"""The engine command line: `vllm serve MODEL --port 8000` plus exactly the typed flags (rendered by the
API's engine codec), then extraArgs."""

from __future__ import annotations

from kvpilot.api.engine import format_value, render_flags
from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.operator.builders.common import HTTP_PORT


def typed_flags(isvc: InferenceService, engine: EngineSpec | None = None) -> list[str]:
    """The typed engine fields as vLLM flags (the codec's order); unset optional fields are left out."""
    engine = engine or isvc.spec.engine
    tracing = isvc.spec.observability.tracing
    return render_flags({
        "maxNumBatchedTokens": engine.max_num_batched_tokens,
        # Always explicit (vLLM's default when unset), so status and hash show what really runs.
        "gpuMemoryUtilization": engine.effective_gpu_memory_utilization,
        "kvCacheMemoryBytes": engine.kv_cache_memory_bytes,
        "maxNumSeqs": engine.max_num_seqs,
        "maxModelLen": engine.max_model_len,
        "tensorParallelSize": engine.tensor_parallel_size,
        "blockSize": engine.block_size,
        "kvCacheDtype": engine.kv_cache_dtype,
        "longPrefillTokenThreshold": engine.long_prefill_token_threshold,
        "shutdownTimeoutSeconds": isvc.spec.rollout.shutdown_timeout_seconds,
        "otlpTracesEndpoint": tracing.otlp_traces_endpoint if tracing else None,
        "collectDetailedTraces": list(tracing.collect_detailed_traces) if tracing else None,
    })


def engine_args(isvc: InferenceService, engine: EngineSpec | None = None) -> list[str]:
    """Arguments after the command: model, port, served name, typed flags, extraArgs (and --gpu for the twin)."""
    engine = engine or isvc.spec.engine
    args = [isvc.spec.model, "--port", str(HTTP_PORT)]
    if engine.kind == "twin":
        # The twin binds 127.0.0.1 by default; in a pod it must listen on the pod IP.
        args += ["--host", "0.0.0.0"]
    if isvc.spec.served_model_name:
        args += ["--served-model-name", isvc.spec.served_model_name]
    args += typed_flags(isvc, engine)
    if engine.kind == "twin":
        args += ["--gpu", engine.twin.gpu]
        if engine.twin.startup_delay_seconds > 0:
            args += ["--startup-delay", format_value(engine.twin.startup_delay_seconds)]
    args += list(engine.extra_args)
    return args


def engine_command(engine: EngineSpec) -> list[str]:
    return ["vllm", "serve"] if engine.kind == "vllm" else ["kvpilot", "twin", "serve"]
