"""The `vllm serve` flags the engine twin accepts, so the operator renders one command line for both.

`add_engine_arguments(parser)` adds the engine flags (and the twin-only `--gpu` and
`--model-config`); `engine_config_from_args(args)` turns parsed flags into an EngineConfig.
`--host`/`--port` belong to the server, which adds them itself.  vLLM flags that change nothing
the twin simulates (logging, tokenizer, tool calling, ...) are accepted and ignored; flags vLLM
0.33 removed are refused with vLLM's reason; any other unknown flag is an argparse error.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import replace
from typing import Any

from kvpilot.api import tracing as vllm_tracing
from kvpilot.api import vllm as vllm_facts
from kvpilot.twin.calibration import CPU_PROFILE
from kvpilot.twin.engine import EngineConfig
from kvpilot.twin.hardware import DEFAULT_GPU, GPU_PRESETS, GpuSpec, resolve_gpu
from kvpilot.twin.models import MODEL_PRESETS, ModelSpec, ModelSpecError, load_model_config, resolve_model
from kvpilot.twin.profiles import DeviceProfile

# The environment variable the twin's commands read when `--gpu` is not given (a pod's env, say).
GPU_ENV = "KVPILOT_TWIN_GPU"

# vLLM flags the twin accepts and ignores: they take a value ...
HARMLESS_VALUE_FLAGS: tuple[str, ...] = (
    "--dtype", "--download-dir", "--tokenizer", "--revision", "--tokenizer-revision", "--tokenizer-mode",
    "--max-log-len", "--swap-space", "--load-format", "--tool-call-parser", "--chat-template",
    "--generation-config", "--distributed-executor-backend",
    "--uvicorn-log-level", "--api-key", "--root-path", "--response-role", "--hf-overrides", "--reasoning-parser",
    "--scheduling-policy", "--compilation-config", "--allowed-origins",
)
# ... or are switches.
HARMLESS_SWITCHES: tuple[str, ...] = (
    "--trust-remote-code", "--disable-log-requests", "--enable-log-requests", "--disable-log-stats",
    "--enforce-eager", "--enable-auto-tool-choice", "--disable-custom-all-reduce",
    "--disable-frontend-multiprocessing", "--disable-fastapi-docs", "--enable-prompt-tokens-details",
    "--enable-force-include-usage", "--disable-uvicorn-access-log", "--enable-server-load-tracking",
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def human_int(text: str) -> int:
    """An integer that may carry a size suffix, read as vLLM reads `--max-model-len 32k`:
    lowercase k/m/g/t are powers of 1000, uppercase K/M/G/T (or a trailing i: Ki, Gi) of 1024."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (suffixes k, K, m, M, g, G, Gi allowed)")
    value, unit, binary = float(m.group(1)), m.group(2), bool(m.group(3)) or m.group(2).isupper()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    result = value * ((1024 if binary else 1000) ** power)
    if result != int(result):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(result)


def _float_in(low: float, high: float, *, low_open: bool, high_open: bool) -> Any:
    """An argparse type: a float in the interval, else a usage error that names the interval."""
    shown = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        if not (above and below):
            raise argparse.ArgumentTypeError(f"{text} is outside {shown}")
        return v

    return parse


_fraction = _float_in(0.0, 1.0, low_open=True, high_open=False)  # --gpu-memory-utilization
_watermark = _float_in(0.0, 1.0, low_open=False, high_open=True)


def positive_int(text: str) -> int:
    """An argparse type: a token count or size of at least 1, with vLLM's size suffixes."""
    v = human_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return v


def _non_negative(text: str) -> int:
    v = human_int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return v


class _Removed(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string}: {vllm_facts.REMOVED_FLAGS.get(option_string or '', 'removed')}")


class _PipelineParallel(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if values != 1:
            parser.error(f"{option_string} {values}: the twin simulates one pipeline stage only (use 1)")


def add_engine_arguments(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    g = parser.add_argument_group("engine (the same flags as `vllm serve`)")
    if model_positional:
        g.add_argument("model", nargs="?", default=None,
                       help="model: a preset name or Hugging Face id (e.g. meta-llama/Llama-3.1-8B-Instruct)")
    g.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the model, as a flag (same as the positional)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) the API serves the model under (default: the model)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="TOKENS",
                   help="token budget per step, the chunked-prefill chunk size (default as vLLM: "
                        f"{vllm_facts.DEFAULT_BATCHED_TOKENS_LARGE_GPU} on >=70 GiB GPUs other than A100, else "
                        f"{vllm_facts.DEFAULT_BATCHED_TOKENS_SMALL_GPU})")
    g.add_argument("--max-num-seqs", type=positive_int, default=None, metavar="N",
                   help="most requests running at once (default as vLLM: "
                        f"{vllm_facts.DEFAULT_MAX_NUM_SEQS_LARGE_GPU} or {vllm_facts.DEFAULT_MAX_NUM_SEQS_SMALL_GPU})")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=None, metavar="FRACTION",
                   help=f"fraction of GPU memory for the engine (default {vllm_facts.DEFAULT_GPU_MEMORY_UTILIZATION})")
    g.add_argument("--kv-cache-memory-bytes", type=positive_int, default=None, metavar="BYTES",
                   help="KV-cache size in bytes (e.g. 20Gi); overrides --gpu-memory-utilization")
    g.add_argument("--max-model-len", type=positive_int, default=None, metavar="TOKENS",
                   help="longest prompt + output in tokens, e.g. 8192 or 32k (default: the model's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N", help="GPUs per replica (default 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1, action=_PipelineParallel,
                   help=argparse.SUPPRESS)
    g.add_argument("--block-size", type=int, choices=vllm_facts.BLOCK_SIZES, default=vllm_facts.DEFAULT_BLOCK_SIZE,
                   help="tokens per KV-cache block (default 16)")
    g.add_argument("--kv-cache-dtype", choices=vllm_facts.KV_CACHE_DTYPES, default="auto",
                   help="KV-cache dtype; fp8 variants halve the bytes per token (default auto = model dtype)")
    g.add_argument("--long-prefill-token-threshold", type=_non_negative, metavar="TOKENS",
                   default=vllm_facts.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD,
                   help="cap on one request's prefill chunk per step when others are eligible (0 = none)")
    g.add_argument("--long-prefill-token-threshold-adaptive", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="floor that cap at the step's token budget / the requests eligible (default off)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of shared prompt prefixes (vLLM V1 default: on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted for compatibility: chunked prefill is always on in vLLM V1")
    g.add_argument("--watermark", type=_watermark, default=0.0, metavar="FRACTION",
                   help="fraction of KV blocks kept free when admitting new requests (default 0)")
    g.add_argument("--prefill-schedule-interval", type=positive_int, default=1, metavar="N",
                   help="admit new prefills only every N steps; the steps between decode alone (default 1)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step N+1 while step N runs, as vLLM does by default on GPUs (default on)")
    g.add_argument("--shutdown-timeout", type=_non_negative, default=0, metavar="SECONDS",
                   help="seconds to let in-flight requests finish after SIGTERM (0 = abort them)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0); `twin run` also seeds the workload with it")
    o = parser.add_argument_group("tracing (vLLM's; the OTEL_* environment configures the exporter and sampler)")
    o.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send an OpenTelemetry span for every finished request (vLLM's llm_request span) to this "
                        "OTLP endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (the default, as in vLLM) or "
                        "http/protobuf (needs kvpilot[tracing]; grpc also kvpilot[tracing-grpc])")
    o.add_argument("--collect-detailed-traces", nargs="+", choices=vllm_tracing.DETAILED_TRACE_MODULES,
                   default=None, metavar="MODULE",
                   help="accepted as vLLM 0.32 accepts it (model, worker, all); it adds no span attributes there either")
    t = parser.add_argument_group("twin only")
    t.add_argument("--gpu", default=None, metavar="GPU",
                   help=f"GPU preset: {', '.join(GPU_PRESETS)} (default ${GPU_ENV} or {DEFAULT_GPU})")
    t.add_argument("--model-config", default=None, metavar="CONFIG_JSON",
                   help="a Hugging Face config.json for a model without a preset")
    t.add_argument("--device-profile", default=None, metavar="JSON",
                   help="a measured device instead of a GPU preset: its peaks and fitted step-time constants "
                        f"(`kvpilot twin calibrate` fits one; vLLM-CPU's ships as {CPU_PROFILE}); not with --gpu.  "
                        "`twin serve` leaves out the profile's frontend terms: its own HTTP frontend is real")
    ig = parser.add_argument_group("accepted and ignored (no effect on the simulation)")
    for flag in HARMLESS_VALUE_FLAGS:
        ig.add_argument(flag, default=None, metavar="VALUE", help=argparse.SUPPRESS)
    for flag in HARMLESS_SWITCHES:
        ig.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in vllm_facts.REMOVED_FLAGS:
        parser.add_argument(flag, nargs="?", action=_Removed, help=argparse.SUPPRESS)


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """The model spec named by the flags: `--model-config` wins; else the positional or `--model`.
    ModelSpecError (a ValueError) names the presets when the name is unknown."""
    name = getattr(args, "model", None) or getattr(args, "model_flag", None)
    if getattr(args, "model_config", None):
        return load_model_config(args.model_config, name=name)
    if not name:
        raise ModelSpecError(f"no model given: name a preset ({', '.join(MODEL_PRESETS)}) or pass --model-config")
    return resolve_model(name)


def gpu_from_args(args: argparse.Namespace) -> GpuSpec:
    """The GPU named by `--gpu`, else by $KVPILOT_TWIN_GPU, else the default preset."""
    return resolve_gpu(getattr(args, "gpu", None) or os.environ.get(GPU_ENV) or DEFAULT_GPU)


def engine_config_from_args(args: argparse.Namespace, *, model: ModelSpec | None = None,
                            gpu: GpuSpec | None = None, real_frontend: bool = False) -> EngineConfig:
    """EngineConfig from parsed flags.  ValueError subclasses for unknown GPUs/models.  `model` and
    `gpu`, when given, stand for the ones the flags name (a config.json already read, say).  `real_frontend`:
    for `twin serve`, whose HTTP frontend is real, so a device profile's model of vLLM's frontend
    (`frontend_s` and its server costs) is left out rather than counted twice."""
    knobs: dict[str, Any] = {}
    if getattr(args, "device_profile", None):
        if getattr(args, "gpu", None):
            raise ValueError("--device-profile and --gpu both name the device: give one")
        profile = DeviceProfile.load(args.device_profile)
        gpu = gpu or profile.device
        step_time = profile.step_time
        if real_frontend:
            step_time = replace(step_time, frontend_s=0.0, frontend_request_s=0.0, frontend_step_s=0.0,
                                frontend_token_s=0.0, frontend_prompt_token_s=0.0)
        knobs["step_time_params"] = step_time
    served = args.served_model_name[0] if args.served_model_name else (
        getattr(args, "model", None) or getattr(args, "model_flag", None))
    return EngineConfig.resolve(
        model or model_from_args(args),
        gpu or gpu_from_args(args),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        enable_prefix_caching=args.enable_prefix_caching,
        served_model_name=served,
        seed=args.seed,
        watermark=args.watermark,
        prefill_schedule_interval=args.prefill_schedule_interval,
        async_scheduling=args.async_scheduling,
        **knobs,
    )
