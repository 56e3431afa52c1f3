"""The local applier: restart a local engine process with a trial's flags, draining like a pod.

`LocalApplier`: blue/green engine slots behind a TCP forwarder on one stable port; canary trials as a
second process on a weighted share of connections. How: docs/architecture.md, "The local applier".
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
from kvpilot.api.vocabulary import SERIES_LABEL_TRACK, Track
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
    """A TCP forwarder on 127.0.0.1:port; each new connection goes to the current backend, or, while
    a canary is set, to the canary for `canary_weight` of the connections (smooth weighted
    round-robin: exact shares, no randomness).  Counts connections per backend port."""

    def __init__(self, port: int, backend: int, host: str = "127.0.0.1") -> None:
        self.port, self.backend, self.host = port, backend, host
        self.canary: int | None = None
        self.canary_weight = 0.0
        self._credit = 0.0  # the canary's running credit in the weighted round-robin
        self.accepted: dict[int, int] = {}  # connections sent to each backend port, ever
        self.open: dict[int, int] = {}  # connections open now to each backend port
        self._counts = threading.Lock()  # the counts are read from the tuner's thread
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpilot-forwarder", daemon=True)
        self._tasks: set[asyncio.Task[None]] = set()

    def bind(self) -> None:
        """Hold the port (bound, not yet accepting): an engine started after this cannot take it.
        vLLM picks free ports for its own sockets (torch.distributed's store) at start-up, and once
        took the forwarder's port while the forwarder waited for the engine to come up."""
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._bind(), self._loop)
        try:
            fut.result(timeout=10)
        except BaseException:  # the port is taken: no thread left behind
            self.stop()
            raise

    def start(self) -> None:
        """Accept connections on the port `bind()` holds."""
        assert self._server is not None, "bind() first"
        asyncio.run_coroutine_threadsafe(self._server.start_serving(), self._loop).result(timeout=10)

    async def _bind(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True,
                                                  start_serving=False)

    def set_canary(self, port: int | None, weight: float = 0.0) -> None:
        """Route `weight` of new connections to `port` (None: none to a canary)."""
        self.canary, self.canary_weight, self._credit = port, weight if port is not None else 0.0, 0.0

    def _pick(self) -> int:
        """The backend for a new connection (runs on the forwarder's one event-loop thread)."""
        canary, weight = self.canary, self.canary_weight
        if canary is None or weight <= 0.0:
            return self.backend
        self._credit += weight
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return canary
        return self.backend

    def open_to(self, port: int) -> int:
        with self._counts:
            return self.open.get(port, 0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        backend = self._pick()
        with self._counts:
            self.accepted[backend] = self.accepted.get(backend, 0) + 1
            self.open[backend] = self.open.get(backend, 0) + 1
        try:
            await self._forward(reader, writer, backend)
        finally:
            with self._counts:
                self.open[backend] -= 1

    def counts(self) -> dict[int, int]:
        """Connections sent to each backend port so far."""
        with self._counts:
            return dict(self.accepted)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, backend: int) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, backend)
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
        canary_port: int | None = None,
        canary_weight: float = 0.25,
    ) -> None:
        if not 0.0 < canary_weight < 1.0:
            raise ValueError(f"canary weight: the canary's share of connections, in (0, 1); got {canary_weight}")
        self.command = list(command)
        self.port = port
        self.slots = slots or (free_port(), free_port())
        self.startup_timeout_s, self.shutdown_timeout_s = startup_timeout_s, shutdown_timeout_s
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvpilot-local-"))
        self.env = env
        self._start_params = start
        self.canary_port = canary_port or free_port()
        self.canary_weight = canary_weight
        self._canary: _Engine | None = None
        self.canaries: list[CanaryRun] = []  # every canary that served, with its requests
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
        """Start the starting engine and the forwarder on the public port (bound first, so the
        engine cannot take it; accepting once the engine is healthy)."""
        forwarder = _Forwarder(self.port, self.slots[0])
        forwarder.bind()
        try:
            eng = self._launch(self._start_params, self.slots[0])
            try:
                self._wait_healthy(eng)
            except ApplyFailed as exc:
                raise RuntimeError(f"the starting engine did not come up: {exc}\n{eng.log_tail()}") from None
            except BaseException:  # SIGTERM or Ctrl-C mid-start: this engine is no one's to stop later
                self._kill(eng, grace=0.0)
                raise
        except BaseException:
            forwarder.stop()
            raise
        self._engine = eng
        self._forwarder = forwarder
        forwarder.start()
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
            except BaseException:  # a failed start, or SIGTERM / Ctrl-C mid-start: stop() only knows _engine
                self._kill(new, grace=0.0)
                raise
            if self._forwarder is not None:
                self._forwarder.backend = new.port  # new connections go to the new engine
            self._engine = new
            self.history.append((time.monotonic(), params, trial))
            if old is not None:
                if self._forwarder is not None:
                    self._drain(self._forwarder, old.port)
                self._kill(old, grace=self.shutdown_timeout_s)  # SIGTERM: the old one drains

    # -- CanaryApplier -------------------------------------------------------------------
    def scrape_configs(self, job: str) -> list[dict[str, object]]:
        """Prometheus scrape configs for both tracks: the two stable slots and the canary's port, each
        labelled with its track (`kvpilot_dev_track`), as the operator's monitor labels pods."""
        return [
            {"job_name": f"{job}-{track.value}", "static_configs": [
                {"targets": [f"127.0.0.1:{p}" for p in ports], "labels": {"job": job, SERIES_LABEL_TRACK: track.value}}
            ]}
            for track, ports in ((Track.STABLE, self.slots), (Track.CANARY, (self.canary_port,)))
        ]

    @property
    def canary(self) -> EngineParams | None:
        return self._canary.params if self._canary else None

    def start_canary(self, params: EngineParams, trial: int) -> None:
        with self._lock:
            self._stop_canary()
            eng = self._launch(params, self.canary_port)
            try:
                self._wait_healthy(eng)
            except BaseException:  # as in apply: not yet _canary, so stop() would miss it
                self._kill(eng, grace=0.0)
                raise
            self._canary = eng
            fw = self._forwarder
            run = CanaryRun(params, trial, time.monotonic(), _accepted(fw))
            run.port = eng.port
            self.canaries.append(run)
            if fw is not None:
                fw.set_canary(eng.port, self.canary_weight)
            log.info("canary pid %d on port %d takes %.0f%% of new connections: %s", eng.proc.pid, eng.port,
                     self.canary_weight * 100, params.label())

    def stop_canary(self) -> None:
        with self._lock:
            self._stop_canary()

    def _stop_canary(self) -> None:
        eng, self._canary = self._canary, None
        if eng is None:
            return
        fw = self._forwarder
        if fw is not None:
            fw.set_canary(None)  # no new connections to it
            self._drain(fw, eng.port)
        run = self.canaries[-1]
        run.stopped = time.monotonic()
        run.accepted_after = _accepted(fw)
        self._kill(eng, grace=self.shutdown_timeout_s)
        log.info("canary on port %d stopped after %d connections", eng.port, run.served)

    def _drain(self, fw: _Forwarder, port: int) -> None:
        """Wait (up to the shutdown timeout) for the connections open to `port` to finish."""
        deadline = time.monotonic() + self.shutdown_timeout_s
        while fw.open_to(port) > 0 and time.monotonic() < deadline:
            time.sleep(0.02)

    def stop(self) -> None:
        with self._lock:
            self._stop_canary()
        if self._forwarder is not None:
            self._forwarder.stop()
            self._forwarder = None
        if self._engine is not None:
            self._kill(self._engine, grace=self.shutdown_timeout_s)
            self._engine = None


class CanaryRun:
    """One canary's life: its engine, its trial, when it served, and the forwarder's connection counts
    (per backend port) when it started and stopped."""

    def __init__(self, params: EngineParams, trial: int, started: float, accepted_before: dict[int, int]) -> None:
        self.params, self.trial, self.started = params, trial, started
        self.stopped: float | None = None
        self.accepted_before = accepted_before
        self.accepted_after: dict[int, int] = {}
        self.port: int | None = None

    def _delta(self) -> dict[int, int]:
        return {p: n - self.accepted_before.get(p, 0) for p, n in self.accepted_after.items()}

    @property
    def served(self) -> int:
        """Connections (requests, for clients that do not keep connections alive) the canary took."""
        return sum(n for p, n in self._delta().items() if p == self.port)

    @property
    def all_served(self) -> int:
        """Connections both tracks took while the canary served."""
        return sum(self._delta().values())


def _accepted(fw: _Forwarder | None) -> dict[int, int]:
    return fw.counts() if fw is not None else {}


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
