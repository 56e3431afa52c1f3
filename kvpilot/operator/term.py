"""One term of reconciling: kopf and its handlers, in a thread with an event loop of its own.

Why not the process's main event loop: on its way out, kopf.operator cancels every task of its loop
that it did not find there when it started (its "hung" tasks), and the admission webhook's and
/metrics' connections are such tasks.  A leader stepping down would cut the webhook's connections
from the API server, which every replica must go on serving.  A loop of its own also gives each term
fresh state (the per-object locks, kopf's queues), so a replica that leads again starts clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading

import kopf

from kvpilot.operator.handlers import build_registry
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.reconcile import Runtime
from kvpilot.operator.settings import OperatorSettings


class _SignalsAreOurs(logging.Filter):
    """kopf warns, at every start off the main thread, that it ignores OS signals: here that is by
    design (the main loop turns SIGINT and SIGTERM into a stop of this term), not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("OS signals are ignored")


logging.getLogger("kopf._core.reactor.running").addFilter(_SignalsAreOurs())


class ReconcileTerm:
    """kopf's reconcile handlers from `start` until `stop` (or until kopf ends by itself)."""

    def __init__(self, settings: OperatorSettings, metrics: OperatorMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.ready = threading.Event()  # kopf's ready_flag: its startup handlers ran and it watches
        self.error: BaseException | None = None
        self._stop_flag = threading.Event()
        self._loop = asyncio.get_running_loop()
        self.finished = asyncio.Event()  # set in the caller's loop once the thread is done
        self._thread = threading.Thread(target=self._main, name="kopf", daemon=True)
        self._kopf_loop: asyncio.AbstractEventLoop | None = None
        self._kopf_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def stop(self, timeout: float) -> bool:
        """Ask kopf to stop, and after half of `timeout` cancel it outright; False when it has still
        not stopped after `timeout` seconds (the thread cannot be killed: the caller must end the
        process).  Why the cancel: asked to stop while it is still starting, kopf waits for its
        discovery calls, which retry against a connection its own shutdown has closed, for seconds;
        cancelled, it stops them at once, as on a second Ctrl+C."""
        self._stop_flag.set()
        if await self._finished_within(timeout / 2):
            return True
        kopf_loop, task = self._kopf_loop, self._kopf_task
        if kopf_loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # that loop has just closed
                kopf_loop.call_soon_threadsafe(task.cancel)
        return await self._finished_within(timeout / 2)

    async def _finished_within(self, seconds: float) -> bool:
        try:
            async with asyncio.timeout(seconds):
                await self.finished.wait()
        except TimeoutError:
            return False
        return True

    def _main(self) -> None:
        try:
            asyncio.run(self._operate())
        except asyncio.CancelledError:
            if not self._stop_flag.is_set():  # cancelled only by stop(), after the flag
                self.error = RuntimeError("kopf was cancelled")
        except BaseException as exc:  # handed to the caller's loop, which decides
            self.error = exc
        finally:
            with contextlib.suppress(RuntimeError):  # the caller's loop is already closed
                self._loop.call_soon_threadsafe(self.finished.set)

    async def _operate(self) -> None:
        self._kopf_loop, self._kopf_task = asyncio.get_running_loop(), asyncio.current_task()
        settings = self.settings
        client = KubeClient(backoff=settings.api_backoff, field_manager=settings.field_manager,
                            timeout_s=settings.api_timeout_seconds, rng=random.Random(settings.retry_seed))
        rt = Runtime(settings=settings, client=client, metrics=self.metrics)
        try:
            await kopf.operator(
                registry=build_registry(rt),
                standalone=True,
                clusterwide=settings.all_namespaces,
                namespaces=settings.watched_namespaces,
                ready_flag=self.ready,
                stop_flag=self._stop_flag,
            )
        finally:
            await client.close()
