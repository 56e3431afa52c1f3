"""What the live-loop tests share (the twin's fast path and real vLLM's): a load generator in a thread
of its own, an observer that records the loop's events, and signals that record every burn-rate
reading the loop took.

    load = BackgroundLoad(applier_url, rate=12.0, seed=5)   # or concurrency=8 (closed loop)
    load.start(); ...; result = load.stop()                 # the LoadResult: every request, failed or not
    events = Events(); LiveTuner(..., observer=events)
    events.wait(lambda log: any(k == "start" for _, k, _, _ in log), timeout=60)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvpilot.loadgen import LoadResult, run_load
from kvpilot.tuner.adapters.prometheus import PrometheusSignals
from kvpilot.tuner.core.loop import Observer
from kvpilot.tuner.core.objective import Measurement, Outcome
from kvpilot.tuner.core.space import EngineParams

EventLog = list[tuple[float, str, str, str]]  # (monotonic time, kind, a, b)


@contextlib.contextmanager
def live_world(prom: Any, applier: Any, load: BackgroundLoad) -> Iterator[tuple[Any, Any, BackgroundLoad]]:
    """Prometheus, the engines (the applier) and the load started in that order, and stopped in
    reverse whatever failed (one stop that raises, the load's error say, does not skip the others)."""
    with contextlib.ExitStack() as stack:
        prom.start()
        stack.callback(prom.stop)
        stack.callback(applier.stop)
        applier.start()
        stack.callback(load.stop)
        load.start()
        yield applier, prom, load


class BackgroundLoad:
    """`run_load` in a thread of its own until stopped; `run_load`'s keyword arguments (rate= or
    concurrency=, seed, max_tokens, keepalive, ...) as given, up to 100,000 requests over 600 s.

    `stop()` sends no more requests and waits (up to `drain_s`) for those in flight to finish, so
    none is cut by the test itself; only past that are they cancelled (and recorded as failed)."""

    def __init__(self, url: str, drain_s: float = 120.0, **kwargs: Any) -> None:
        self.url = url
        self.drain_s = drain_s
        self.kwargs = {"num_requests": 100_000, "max_duration_s": 600.0, **kwargs}
        self.result: LoadResult | None = None
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[LoadResult] | None = None
        self._thread = threading.Thread(target=self._run, name="background-load", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(run_load(self.url, stop=self._stop.is_set, **self.kwargs))
        try:
            self.result = self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass  # stopped past its drain: what was in flight is recorded as failed
        except Exception as exc:  # noqa: BLE001 - raised again by stop(), in the test's thread
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> LoadResult | None:
        self._stop.set()
        self._thread.join(timeout=self.drain_s)
        if self._thread.is_alive() and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
            self._thread.join(timeout=30)
        if self.error is not None:
            # A load that could not run (bad arguments, say) must fail the test, not look like no traffic.
            raise RuntimeError(f"the background load failed: {self.error!r}") from self.error
        return self.result


class TunerThread:
    """`tuner.run()` in a daemon thread of its own: `result` gets "best" (what run() returned) or
    "error" (what it raised), for the test's assertions."""

    def __init__(self, tuner: Any) -> None:
        self.tuner = tuner
        self.result: dict[str, object] = {}
        self.thread = threading.Thread(target=self._run, name="tuner", daemon=True)

    def _run(self) -> None:
        try:
            self.result["best"] = self.tuner.run()
        except BaseException as exc:  # surfaced by the test's assertions
            self.result["error"] = exc

    def start(self) -> TunerThread:
        self.thread.start()
        return self


class Events(Observer):
    """The loop's phases and trials, in order, with a condition to wait on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.log: EventLog = []

    def _add(self, kind: str, a: str, b: str) -> None:
        with self.cond:
            self.log.append((time.monotonic(), kind, a, b))
            self.cond.notify_all()

    def phase(self, phase: str, reason: str, message: str) -> None:
        self._add("phase", phase, reason)

    def trial_started(self, number: int, params: EngineParams, kind: str) -> None:
        self._add("start", str(number), params.label())

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None:
        self._add("finish", str(number), state)

    def wait(self, pred: Callable[[EventLog], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: pred(self.log), timeout=timeout)


class RecordingSignals:
    """The real Prometheus signals, with every burn-rate reading recorded (time, value)."""

    def __init__(self, inner: PrometheusSignals) -> None:
        self.inner = inner
        self.burns: list[tuple[float, float]] = []

    def burn_rate(self, window_s: float) -> float:
        v = self.inner.burn_rate(window_s)
        self.burns.append((time.monotonic(), v))
        return v

    def measure(self, window_s: float) -> Measurement:
        return self.inner.measure(window_s)
