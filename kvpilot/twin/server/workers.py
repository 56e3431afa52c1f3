"""The worker processes that parse large request bodies: a fixed number, a bounded queue, and no
work left running for a client that has gone.

concurrent.futures' process pool fits none of the three: its queue has no bound, and a cancelled
job keeps running in its worker (the slot looks free, the next job queues behind it).  Here each
worker is one spawned process on a pipe; a job whose caller is cancelled (aiohttp cancels the
handler of a client that disconnects) kills its worker, and the next job starts a fresh one.  A
job that finds the slots busy and the queue full is refused at once with 503 and Retry-After, as
a loaded server answers, rather than wait behind work it cannot see the end of.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvpilot.twin.server.protocol import OpenAIError

RETRY_AFTER_S = 1


def _serve(conn: Connection) -> None:
    """A worker's loop: one (function, args) at a time, answered as ("ok", result) or ("error", text)."""
    with contextlib.suppress(OSError):
        os.nice(10)  # parsing a hostile body must not take CPU from serving streams and /health
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return  # the server closed its end
        try:
            answer: tuple[str, Any] = ("ok", fn(*args))
        except Exception as exc:  # the server turns it into a 500 with the same words
            answer = ("error", f"{type(exc).__name__}: {exc}"[:500])
        conn.send(answer)


class WorkerDied(Exception):
    """The worker process ended mid-job (killed, out of memory)."""


class _Worker:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # a clean interpreter: no fork of threads and a loop
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True, name="kvpilot-twin-parse")
        self._child = child

    async def start(self) -> None:
        # Starting writes the spawn preparation to a pipe the new interpreter reads: off the loop.
        await asyncio.get_running_loop().run_in_executor(None, self.process.start)
        self._child.close()

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        loop = asyncio.get_running_loop()
        # Pickling and writing a large body holds the GIL in stretches: a thread does it.
        try:
            await loop.run_in_executor(None, self.conn.send, (fn, args))
        except (OSError, ValueError) as exc:
            raise WorkerDied(str(exc)) from None
        readable = loop.create_future()
        fd = self.conn.fileno()
        def on_readable() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(fd, on_readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:
            status, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise WorkerDied(str(exc) or "the worker closed its pipe") from None
        if status != "ok":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        """End the process now (mid-job too); it is reaped off the loop."""
        if self.process.pid is not None:
            self.process.kill()
            with contextlib.suppress(RuntimeError):  # no running loop: the interpreter is exiting
                asyncio.get_running_loop().run_in_executor(None, self.process.join, 5.0)
        self.conn.close()
        self._child.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid


class ParseWorkers:
    """Up to `slots` jobs at once in worker processes, up to `queue_limit` more waiting."""

    def __init__(self, slots: int, queue_limit: int) -> None:
        if slots < 1 or queue_limit < 0:
            raise ValueError(f"slots must be at least 1 and queue_limit at least 0, got {slots}, {queue_limit}")
        self.slots = slots
        self.queue_limit = queue_limit
        self._free = asyncio.Semaphore(slots)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self.waiting = 0

    @property
    def pids(self) -> list[int]:
        """The worker processes now alive (idle or busy)."""
        return [w.pid for w in (*self._idle, *self._busy) if w.pid is not None and w.process.is_alive()]

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in a worker.  Cancelled, it kills the worker running it; refused with 503 when
        every slot is busy and `queue_limit` jobs already wait; WorkerDied if the worker died."""
        if self._free.locked() and self.waiting >= self.queue_limit:
            raise OpenAIError(f"The server is busy parsing other large request bodies ({self.slots} at once, "
                              f"{self.waiting} waiting); retry after {RETRY_AFTER_S} s.", status=503,
                              retry_after=RETRY_AFTER_S)
        self.waiting += 1
        try:
            await self._free.acquire()  # a caller cancelled here leaves the queue, nothing ran
        finally:
            self.waiting -= 1
        try:
            worker = self._idle.pop() if self._idle else _Worker()
            self._busy.add(worker)
            try:
                if worker.pid is None:
                    await worker.start()
                result = await worker.call(fn, args)
            except BaseException:
                # Cancelled (the client went away) or failed mid-job: the work stops with the process.
                self._busy.discard(worker)
                worker.kill()
                raise
            self._busy.discard(worker)
            self._idle.append(worker)
            return result
        finally:
            self._free.release()

    def close(self) -> None:
        for worker in (*self._idle, *self._busy):
            worker.kill()
        self._idle.clear()
        self._busy.clear()
