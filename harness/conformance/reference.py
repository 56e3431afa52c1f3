"""vLLM's own scheduler as a reference: a worker process in the real-vLLM venv, fed traces.

The venv is the one `make vllm-env` (scripts/install-vllm-env.sh) builds: `$KVPILOT_VLLM_ENV`,
else `~/.cache/kvpilot/vllm-<version>`.  vLLM is imported once per worker (seconds); a trace
then replays in milliseconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from harness.conformance.traces import Trace

VLLM_VERSION = "0.32.0"
WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmEnvMissing(RuntimeError):
    """The real-vLLM venv is not built here."""


def vllm_env() -> Path:
    """The real-vLLM venv's directory (it may not exist)."""
    env = os.environ.get("KVPILOT_VLLM_ENV")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvpilot" / f"vllm-{VLLM_VERSION}"


def require_vllm_env() -> tuple[Path, Path]:
    """(the venv's python, the tiny model's directory); VllmEnvMissing says how to build them."""
    env = vllm_env()
    python, model = env / "bin" / "python", env / "tiny-llama"
    if not (env / ".kvpilot-installed").is_file() or not (model / ".kvpilot-complete").is_file():
        raise VllmEnvMissing(f"no real-vLLM environment at {env}: run `make vllm-env` (or set KVPILOT_VLLM_ENV)")
    return python, model


def worker_env() -> dict[str, str]:
    """The environment a script in the real-vLLM venv runs with: vLLM's CPU platform, no model hub,
    quiet logs, and none of this project's import path."""
    return dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR", PYTHONPATH="")


class VllmWorker:
    """A worker script run by the real-vLLM venv's python, answering one JSON line per JSON-line
    request; its first line says it is ready.  vLLM's own log lines are kept aside and shown if the
    worker dies.  Use as a context manager."""

    what = "vLLM worker"

    def __init__(self, script: Path, *args: str, python: Path | None = None) -> None:
        python = python or require_vllm_env()[0]
        env = worker_env()
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the worker)
        self.proc = subprocess.Popen(
            [str(python), str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env,
        )
        self.ready = self._read()
        if not self.ready.get("ready"):
            self.close()
            raise RuntimeError(f"{self.what} did not start: {self.ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.log.seek(0)
            tail = self.log.read()[-4000:]
            raise RuntimeError(f"{self.what} exited with status {code}:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class VllmScheduler(VllmWorker):
    """vLLM's V1 scheduler in a worker: `run(trace)` returns vLLM's step records."""

    what = "vLLM scheduler worker"

    def __init__(self) -> None:
        super().__init__(WORKER, "--model", str(require_vllm_env()[1]))

    def run(self, trace: Trace) -> list[dict[str, Any]]:
        reply = self.ask(trace)
        if "error" in reply:
            raise RuntimeError(f"vLLM's scheduler failed on a trace: {reply['error']}")
        steps: list[dict[str, Any]] = reply["steps"]
        return steps
