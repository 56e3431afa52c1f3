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
from typing import Any

from kvpilot.twin.conformance.traces import Trace

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


class VllmScheduler:
    """A running worker: `run(trace)` returns vLLM's step records.  Use as a context manager."""

    def __init__(self) -> None:
        python, model = require_vllm_env()
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR",
                   PYTHONPATH="")
        # vLLM logs a few lines per scheduler built; kept aside, shown if the worker fails.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (lives as long as the worker)
        self.proc = subprocess.Popen(
            [str(python), str(WORKER), "--model", str(model)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, env=env,
        )
        first = self._read()
        if not first.get("ready"):
            self.close()
            raise RuntimeError(f"vLLM scheduler worker did not start: {first}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.log.seek(0)
            tail = self.log.read()[-4000:]
            raise RuntimeError(f"vLLM scheduler worker exited with status {code}:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def run(self, trace: Trace) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(trace) + "\n")
        self.proc.stdin.flush()
        reply = self._read()
        if "error" in reply:
            raise RuntimeError(f"vLLM's scheduler failed on a trace: {reply['error']}")
        steps: list[dict[str, Any]] = reply["steps"]
        return steps

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

    def __enter__(self) -> VllmScheduler:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
