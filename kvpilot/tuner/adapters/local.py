"""The local applier: restart a local engine process with a trial's flags, draining like a pod.

Clients talk to one stable port; behind it, a small TCP forwarder (a Service, in Kubernetes
terms) sends each new connection to the engine in force.  The engine runs in one of two slots
(two backend ports, blue/green).  A change starts the new engine in the idle slot, waits until
its /health answers 200, points new connections at it, and only then sends SIGTERM to the old
one, whose in-flight requests finish on their own connections (vLLM's `--shutdown-timeout`, the
twin's drain) - never below one ready engine, like a RollingUpdate with maxUnavailable 0.

A new engine that exits or never gets healthy is a failed rollout: it is killed, the old one
keeps serving untouched, and the trial is told as infeasible.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvpilot.api.engine import EngineArgsError, ServeDefaults, parse_engine_args, resolve
from kvpilot.api.startup import cause_line
from kvpilot.tuner.core.loop import ApplyFailed
from kvpilot.tuner.core.space import TUNED_FIELDS, EngineParams

log = logging.getLogger(__name__)

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_engine_command(argv: Sequence[str], defaults: ServeDefaults) -> tuple[list[str], int, EngineParams]:
    """Split `vllm serve ... --port P --max-num-seqs N ...` into (command without the port and the
    tuned flags, P, the starting engine).  Tuned flags the command leaves out take `defaults`,
    vLLM's for the GPU the engine runs on."""
    try:
        parsed = parse_engine_args(argv, only=TUNED_FIELDS)
    except EngineArgsError as exc:
        raise ValueError(f"engine command: {exc}") from None
    if parsed.port is None:
        raise ValueError("engine command: give --port P (the port clients use; the tuner serves it)")
    if not parsed.rest:
        raise ValueError("engine command: empty")
    values = resolve(parsed.values, defaults)
    return parsed.rest, parsed.port, EngineParams.from_spec({k: values[k] for k in TUNED_FIELDS})


class _Forwarder:
    """A TCP forwarder on 127.0.0.1:port; each new connection goes to the current backend."""

    def __init__(self, port: int, backend: int, host: str = "127.0.0.1") -> None:
        self.port, self.backend, self.host = port, backend, host
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpilot-forwarder", daemon=True)
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        fut.result(timeout=10)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.backend)
        except OSError:
            writer.close()
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    w.close()

        try:
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        except asyncio.CancelledError:
            # Shutting down: close both sides and end normally (asyncio's stream callback calls
            # .exception() on this task, which a cancelled task would raise from).
            for w in (writer, up_w):
                with contextlib.suppress(Exception):
                    w.close()

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):  # connections still open: close them, quietly
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)


class _Engine:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, params: EngineParams, log_path: Path) -> None:
        self.proc, self.port, self.params, self.log_path = proc, port, params, log_path

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class LocalApplier:
    """Applier for a local engine process (`vllm serve ...` or `kvpilot twin serve ...`)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        port: int,
        start: EngineParams,
        slots: tuple[int, int] | None = None,
        startup_timeout_s: float = 1800.0,
        shutdown_timeout_s: float = 30.0,
        log_dir: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.command = list(command)
        self.port = port
        self.slots = slots or (free_port(), free_port())
        self.startup_timeout_s, self.shutdown_timeout_s = startup_timeout_s, shutdown_timeout_s
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvpilot-local-"))
        self.env = env
        self._start_params = start
        self._engine: _Engine | None = None
        self._forwarder: _Forwarder | None = None
        self.history: list[tuple[float, EngineParams, int | None]] = []  # (monotonic, engine, trial) when in force
        self._lock = threading.Lock()  # one engine change at a time

    # -- process handling ----------------------------------------------------------------
    def _launch(self, params: EngineParams, port: int) -> _Engine:
        argv = [*self.command, "--port", str(port), *params.as_flags()]
        log_path = self.log_dir / f"engine-{port}-{int(time.time() * 1000)}.log"
        fh = open(log_path, "wb")  # noqa: SIM115  (closed by the child's exit; the parent keeps no handle)
        try:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(self.env or {})},
                                    start_new_session=True)
        finally:
            fh.close()
        log.info("started engine pid %d on port %d: %s", proc.pid, port, shlex.join(argv))
        return _Engine(proc, port, params, log_path)

    def _wait_healthy(self, eng: _Engine) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        url = f"http://127.0.0.1:{eng.port}/health"
        while time.monotonic() < deadline:
            if eng.proc.poll() is not None:
                tail = eng.log_tail(FAILURE_LOG_CHARS)
                raise ApplyFailed(_reason_from_log(tail),
                                  f"engine exited with code {eng.proc.returncode}: {_failure_line(tail)}")
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.1)
        self._kill(eng, grace=0.0)
        raise ApplyFailed("StartupTimeout", f"engine not healthy after {self.startup_timeout_s:g}s")

    def _kill(self, eng: _Engine, grace: float) -> None:
        if eng.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(eng.proc.pid, signal.SIGTERM)
        try:
            eng.proc.wait(timeout=max(grace, 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(eng.proc.pid, signal.SIGKILL)
            eng.proc.wait(timeout=10)

    # -- Applier -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the starting engine and the forwarder on the public port."""
        eng = self._launch(self._start_params, self.slots[0])
        try:
            self._wait_healthy(eng)
        except ApplyFailed as exc:
            raise RuntimeError(f"the starting engine did not come up: {exc}\n{eng.log_tail()}") from None
        self._engine = eng
        self._forwarder = _Forwarder(self.port, eng.port)
        self._forwarder.start()
        self.history.append((time.monotonic(), eng.params, None))

    def current(self) -> EngineParams:
        return self._engine.params if self._engine else self._start_params

    @property
    def backend_port(self) -> int | None:
        return self._engine.port if self._engine else None

    def apply(self, params: EngineParams, trial: int | None) -> None:
        with self._lock:
            old = self._engine
            if old is not None and old.params == params and old.proc.poll() is None:
                return
            port = self.slots[1] if old is not None and old.port == self.slots[0] else self.slots[0]
            new = self._launch(params, port)
            try:
                self._wait_healthy(new)
            except ApplyFailed:
                self._kill(new, grace=0.0)
                raise
            if self._forwarder is not None:
                self._forwarder.backend = new.port  # new connections go to the new engine
            self._engine = new
            self.history.append((time.monotonic(), params, trial))
            if old is not None:
                self._kill(old, grace=self.shutdown_timeout_s)  # SIGTERM: the old one drains

    def stop(self) -> None:
        if self._forwarder is not None:
            self._forwarder.stop()
            self._forwarder = None
        if self._engine is not None:
            self._kill(self._engine, grace=self.shutdown_timeout_s)
            self._engine = None


# How much of a dead engine's log to search for why it died: vLLM V1 logs the root cause in the
# engine-core process's traceback, then the API server's own traceback ("Engine core
# initialization failed. See root cause above.") buries it a few thousand characters up.
FAILURE_LOG_CHARS = 20_000


def _failure_line(text: str) -> str:
    """The line that says why the engine died (`kvpilot.api.startup.cause_line`: a memory failure's
    line first, its numbers grade the infeasible trial)."""
    return cause_line(text)


def _reason_from_log(text: str) -> str:
    low = text.lower()
    if "out of memory" in low or "no available memory" in low or "kv cache" in low and "larger" in low:
        return "OutOfMemory"
    return "StartupFailed"
