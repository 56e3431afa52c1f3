"""`kvpilot twin serve`: the engine twin behind vLLM's OpenAI-compatible HTTP API.

Takes the same flags as `vllm serve` (kvpilot.twin.flags) plus the server's own: --host, --port,
--startup-delay (mimics model load: the port opens only afterwards) and --log-level.
`--shutdown-timeout` is one of vLLM's flags and so comes with the engine flags.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

_DESCRIPTION = """\
Serve the engine twin over HTTP, as `vllm serve` would: OpenAI /v1/completions and
/v1/chat/completions (streaming or not, tokens paced in real time by the simulated engine),
/v1/models, /health and /metrics (vLLM's metric names, labels and bucket edges).

The port opens only when the engine is "loaded" (after --startup-delay); a configuration
vLLM would refuse (e.g. too high --gpu-memory-utilization) prints vLLM's error and exits 1.
On SIGTERM the server refuses new requests (503), lets in-flight ones finish for up to
--shutdown-timeout seconds (0: abort them, vLLM's default), and exits 0.

example:
  kvpilot twin serve meta-llama/Llama-3.1-8B-Instruct --gpu H100-80GB \\
      --max-num-batched-tokens 2048 --gpu-memory-utilization 0.9 --port 8000 --shutdown-timeout 30
"""


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be >= 0 seconds")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0-65535; 0 picks a free port)")
    return value


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (those add_engine_arguments does not already define)."""
    known = parser._option_string_actions  # argparse has no public lookup
    g = parser.add_argument_group("server")
    if "--host" not in known:
        g.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    if "--port" not in known:
        g.add_argument("--port", type=_port, default=8000,
                       help="port to listen on (default 8000, as vLLM; 0 picks a free port and logs it)")
    if "--startup-delay" not in known:
        g.add_argument("--startup-delay", type=_non_negative_float, default=0.0, metavar="SECONDS",
                       help="simulated model-load time before the port opens (default 0)")
    if "--shutdown-timeout" not in known:
        g.add_argument("--shutdown-timeout", type=_non_negative_float, default=0.0, metavar="SECONDS",
                       help="seconds to let in-flight requests finish after SIGTERM (0 = abort them)")
    if "--log-level" not in known:
        g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="server log level; debug logs one line per request (default info)")


def register(twin_subparsers: Any) -> argparse.ArgumentParser:
    from kvpilot.twin.flags import add_engine_arguments

    p = twin_subparsers.add_parser(
        "serve", help="serve the twin over vLLM's OpenAI-compatible HTTP API and /metrics",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p)
    add_server_arguments(p)
    p.set_defaults(handler=serve_command)
    return p


def cache_config_info(config: Any, num_gpu_blocks: int) -> dict[str, Any]:
    """The labels of vllm:cache_config_info, named as vLLM's CacheConfig fields."""
    return {
        "block_size": config.block_size,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "kv_cache_memory_bytes": config.kv_cache_memory_bytes,
        "swap_space": 4,
        "cache_dtype": config.kv_cache_dtype,
        "is_attention_free": False,
        "num_gpu_blocks_override": None,
        "sliding_window": None,
        "enable_prefix_caching": config.enable_prefix_caching,
        "cpu_offload_gb": 0,
        "calculate_kv_scales": False,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": None,
    }


def _startup_failure(exc: BaseException) -> int:
    """What vLLM prints when its engine core cannot start, then exit 1."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    print(f"ERROR {stamp} [core.py] EngineCore failed to start.", file=sys.stderr)
    print(f"ERROR {stamp} [core.py] ValueError: {exc}", file=sys.stderr)
    print("RuntimeError: Engine core initialization failed. See root cause above. "
          "Failed core proc(s): {}", file=sys.stderr)
    return 1


def serve_command(args: argparse.Namespace) -> int:
    import asyncio

    from kvpilot.twin.engine import Engine, EngineStartupError
    from kvpilot.twin.flags import engine_config_from_args
    from kvpilot.twin.server import jsonlog
    from kvpilot.twin.server.app import ServingInfo, serve

    jsonlog.configure(args.log_level)
    try:
        config = engine_config_from_args(args, real_frontend=True)
    except ValueError as exc:  # unknown model or GPU preset, unreadable config.json
        print(f"kvpilot twin serve: error: {exc}", file=sys.stderr)
        return 2
    tracer = None
    if getattr(args, "otlp_traces_endpoint", None):
        from kvpilot.twin.server.tracing import RequestTracer, TracingUnavailable

        try:
            tracer = RequestTracer(args.otlp_traces_endpoint)
        except TracingUnavailable as exc:
            print(f"kvpilot twin serve: error: {exc}", file=sys.stderr)
            return 2

    def make_engine() -> tuple[Engine, ServingInfo]:
        engine = Engine(config)
        root = getattr(args, "model", None) or getattr(args, "model_flag", None) or config.model.name
        names = list(args.served_model_name or [config.model_name])
        info = ServingInfo(served_model_name=names[0], model=root,
                           max_model_len=int(config.max_model_len or 0),
                           cache_config=cache_config_info(config, engine.num_gpu_blocks),
                           extra_served_names=tuple(n for n in names[1:] if n != names[0]),
                           api_key=getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY") or None)
        return engine, info

    try:
        return asyncio.run(serve(make_engine, host=args.host, port=args.port,
                                 startup_delay=float(args.startup_delay),
                                 shutdown_timeout=float(args.shutdown_timeout), tracer=tracer))
    except EngineStartupError as exc:
        return _startup_failure(exc)
    except OSError as exc:  # the port is taken, or the address is not ours
        print(f"kvpilot twin serve: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
