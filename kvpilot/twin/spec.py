"""An EngineConfig from an InferenceService, through the same `vllm serve` flags the operator renders.

The offline tuner (goal: capacity) and anything else that wants to ask "how would this
InferenceService behave?" without a GPU call `engine_config_from_spec(isvc)`.  The spec is turned
into a `vllm serve` argument list (typed fields, then `extraArgs`) and parsed by the twin's own
flag parser, so a flag the twin would refuse at `kvpilot twin serve` is refused here too.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from kvpilot.twin.engine import EngineConfig
from kvpilot.twin.flags import add_engine_arguments, engine_config_from_args


class SpecFlagError(ValueError):
    """The spec's engine flags do not parse (an unknown or removed flag in extraArgs, ...)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SpecFlagError(message)


def engine_args_from_spec(spec: Any) -> list[str]:
    """`vllm serve` arguments for an InferenceServiceSpec (without --host/--port)."""
    e = spec.engine
    args = [spec.model, "--served-model-name", spec.served_model_name or spec.model,
            "--max-num-batched-tokens", str(e.max_num_batched_tokens),
            "--max-num-seqs", str(e.max_num_seqs),
            "--tensor-parallel-size", str(e.tensor_parallel_size),
            "--block-size", str(e.block_size),
            "--kv-cache-dtype", e.kv_cache_dtype,
            "--long-prefill-token-threshold", str(e.long_prefill_token_threshold)]
    if e.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    elif e.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    return args + list(e.extra_args)


def engine_config_from_spec(isvc: Any, *, gpu: str | None = None) -> EngineConfig:
    """EngineConfig for an InferenceService (or its spec).  The GPU is `spec.engine.twin.gpu`
    unless `gpu` is given.  Raises SpecFlagError, or a ValueError naming an unknown model/GPU."""
    spec = getattr(isvc, "spec", isvc)
    parser = _Parser(prog="vllm serve", add_help=False)
    add_engine_arguments(parser)
    args = parser.parse_args(engine_args_from_spec(spec))
    args.gpu = gpu or spec.engine.twin.gpu
    return engine_config_from_args(args)
