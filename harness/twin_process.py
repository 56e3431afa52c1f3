"""Run `kvpilot twin serve` as a real subprocess, for integration tests.

    from harness.twin_process import twin_server, FAST_TWIN_ARGS

    with twin_server(*FAST_TWIN_ARGS, "--max-num-batched-tokens", "512") as twin:
        twin.base_url        # http://127.0.0.1:PORT      (OpenAI client: base_url=twin.openai_url)
        twin.metrics_url     # http://127.0.0.1:PORT/metrics
        twin.port

The server is started with `--port 0` unless a port is given: the kernel picks a free port and
the harness reads it back from the server's "Starting vLLM API server" log line, so two tests can
never race for the same port.  `twin_server` waits until /health answers 200 (with a deadline,
failing fast with the server's log if the process exits), and on exit sends SIGTERM, waits, and
falls back to SIGKILL.  Every line the server logs is kept in `twin.log_path`.

For pytest, import the fixture into a conftest.py (or a test module):

    from harness.twin_process import twin_factory  # noqa: F401  (a fixture)

    def test_x(twin_factory):
        twin = twin_factory("--max-num-seqs", "8")   # started and healthy; stopped after the test
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# A small model on a fast GPU: steps of a few milliseconds, so real-time tests take a few seconds.
FAST_TWIN_ARGS: tuple[str, ...] = ("--model", "Qwen2.5-0.5B", "--gpu", "H100-80GB",
                                   "--max-model-len", "4096")
# An 8B model on an L4: decode steps of ~60-70 ms (about 15 tokens/s per stream), for tests that
# need requests to stay in flight for seconds (draining, rollouts, SLO burn under load).
SLOW_TWIN_ARGS: tuple[str, ...] = ("--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L4",
                                   "--max-model-len", "4096")


class TwinStartError(RuntimeError):
    """The twin exited before it was healthy, or did not get healthy in time."""


def twin_command(args: Sequence[str]) -> list[str]:
    """`python -m kvpilot.cli twin serve ARGS` with this interpreter (the venv's)."""
    return [sys.executable, "-m", "kvpilot.cli", "twin", "serve", *args]


def _http_status(url: str, timeout: float = 1.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def port_is_open(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (for tests that must know the port before the server starts)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class TwinProcess:
    """A started `kvpilot twin serve` process."""

    args: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    host: str = "127.0.0.1"
    port: int | None = None
    _log_file: object = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise TwinStartError("the twin's port is not known yet (not started)")
        return f"http://{self.host}:{self.port}"

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"

    @property
    def health_url(self) -> str:
        return self.base_url + "/health"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> list[dict]:
        """The server's JSON log lines (other lines, e.g. a start-up error, are skipped)."""
        records = []
        for line in self.logs().splitlines():
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                if isinstance(obj, dict):
                    records.append(obj)
        return records

    def metric_families(self) -> dict[str, Any]:
        """/metrics scraped now and parsed with prometheus_client's parser, by family name
        (counters appear without `_total`: `families["vllm:request_success"]`)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        return {f.name: f for f in text_string_to_metric_families(text)}

    def metric_value(self, sample_name: str, **labels: str) -> float | None:
        """One sample's value from a fresh scrape, e.g.
        `twin.metric_value("vllm:request_success_total", finished_reason="length")`, or
        `twin.metric_value("vllm:time_to_first_token_seconds_bucket", le="0.5")`; None if absent.
        Labels not given are not matched (model_name and engine, usually)."""
        for family in self.metric_families().values():
            for s in family.samples:
                if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
        return None

    def _port_from_log(self) -> int | None:
        for rec in self.log_records():
            url = rec.get("url")
            if rec.get("msg") == "Starting vLLM API server" and isinstance(url, str):
                return int(url.rsplit(":", 1)[1])
        return None

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until /health answers 200; raises TwinStartError (with the log) on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise TwinStartError(f"twin exited with code {code} before it was healthy; "
                                     f"log:\n{self.logs()[-4000:]}")
            if self.port is None:
                self.port = self._port_from_log()
            if self.port is not None and _http_status(self.health_url) == 200:
                return
            time.sleep(0.05)
        raise TwinStartError(f"twin not healthy within {timeout:.0f}s; log:\n{self.logs()[-4000:]}")

    def terminate(self) -> None:
        """Send SIGTERM (the start of a graceful shutdown) without waiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait up to `timeout`, then SIGKILL.  Returns the exit code (-9 if killed)."""
        self.terminate()
        code = self.wait(timeout)
        if code is None:
            self.proc.kill()
            code = self.proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None
        return code


def start_twin(*args: str, port: int | None = None, host: str = "127.0.0.1",
               env: dict[str, str] | None = None, log_dir: str | Path | None = None,
               log_level: str = "info") -> TwinProcess:
    """Start the process; does not wait for health (see `TwinProcess.wait_healthy`)."""
    argv = [*args, "--host", host, "--port", str(0 if port is None else port), "--log-level", log_level]
    log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvpilot-twin-"))
    log_path = log_dir / f"twin-{time.monotonic_ns()}.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed by TwinProcess.stop
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    # The repo root first on the path, so the checkout under test is what runs.
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(twin_command(argv), stdout=log_file, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=full_env, cwd=str(REPO_ROOT))
    return TwinProcess(args=argv, proc=proc, log_path=log_path, host=host, port=port, _log_file=log_file)


@contextlib.contextmanager
def twin_server(*args: str, port: int | None = None, host: str = "127.0.0.1",
                ready_timeout: float = 30.0, stop_timeout: float = 15.0,
                env: dict[str, str] | None = None, log_dir: str | Path | None = None,
                log_level: str = "info") -> Iterator[TwinProcess]:
    """A healthy twin for the `with` block; always stopped (SIGTERM, then SIGKILL) afterwards."""
    twin = start_twin(*args, port=port, host=host, env=env, log_dir=log_dir, log_level=log_level)
    try:
        twin.wait_healthy(ready_timeout)
        yield twin
    finally:
        twin.stop(stop_timeout)


@pytest.fixture
def twin_factory(tmp_path: Path) -> Iterator:
    """Start healthy twins on demand: `twin = twin_factory(*args, **start_twin_kwargs)`.
    Every twin is stopped when the test ends; its log is in the test's tmp_path."""
    started: list[TwinProcess] = []

    def factory(*args: str, ready_timeout: float = 30.0, **kwargs) -> TwinProcess:
        kwargs.setdefault("log_dir", tmp_path)
        twin = start_twin(*args, **kwargs)
        started.append(twin)
        twin.wait_healthy(ready_timeout)
        return twin

    yield factory
    for twin in started:
        twin.stop()
