"""The parse workers (kvpilot.twin.server.workers) with real spawned processes: a job whose caller is
cancelled (its client went away) dies with its worker, a full queue is refused with 503 and
Retry-After, and a worker that dies fails only its own job."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvpilot.twin.server.protocol import OpenAIError
from kvpilot.twin.server.workers import ParseWorkers, WorkerDied
from tests.support import parse_jobs

DEADLINE_S = 60.0  # to fail rather than hang; not a speed goal
LONG_S = 120.0  # CPU-seconds a spinning job would take if nothing stopped it


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _started(marker: Path) -> int:
    await _until(marker.exists, "the job to start")
    return int(marker.read_text())


def _run(body: Callable[[ParseWorkers], Awaitable[Any]], slots: int = 1, queue_limit: int = 1) -> Any:
    async def main() -> Any:
        workers = ParseWorkers(slots, queue_limit)
        try:
            return await asyncio.wait_for(body(workers), DEADLINE_S * 2)
        finally:
            workers.close()
    return asyncio.run(main())


def test_a_job_runs_in_a_worker_and_the_worker_is_reused() -> None:
    async def body(workers: ParseWorkers) -> None:
        assert await workers.run(parse_jobs.echo, {"a": b"x" * 1_000_000}) == {"a": b"x" * 1_000_000}
        first = workers.pids
        assert len(first) == 1 and first[0] != os.getpid()
        with pytest.raises(RuntimeError, match="ValueError: broken"):
            await workers.run(parse_jobs.fail, "broken")
        assert await workers.run(parse_jobs.echo, 7) == 7
    _run(body)


def test_a_cancelled_job_dies_with_its_worker(tmp_path: Path) -> None:
    async def body(workers: ParseWorkers) -> None:
        marker = tmp_path / "started"
        job = asyncio.create_task(workers.run(parse_jobs.spin, str(marker), LONG_S))
        pid = await _started(marker)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        await _until(lambda: not _alive(pid), "the cancelled job's worker to end")
        # The slot is free again, and the next job gets a fresh worker.
        assert await workers.run(parse_jobs.echo, "next") == "next"
        assert pid not in workers.pids
    _run(body)


def test_a_full_queue_is_refused_with_503_and_retry_after(tmp_path: Path) -> None:
    async def body(workers: ParseWorkers) -> None:
        running = asyncio.create_task(workers.run(parse_jobs.spin, str(tmp_path / "a"), LONG_S))
        pid = await _started(tmp_path / "a")
        waiting = asyncio.create_task(workers.run(parse_jobs.echo, "queued"))
        await _until(lambda: workers.waiting == 1, "the second job to queue")
        with pytest.raises(OpenAIError) as info:
            await workers.run(parse_jobs.echo, "refused")
        assert info.value.status == 503 and info.value.retry_after == 1
        assert "busy" in info.value.message
        # A queued job whose client leaves gives its place up; nothing of it runs.
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert workers.waiting == 0
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await _until(lambda: not _alive(pid), "the worker to end")
    _run(body)


def test_a_worker_that_dies_fails_its_job_only(tmp_path: Path) -> None:
    async def body(workers: ParseWorkers) -> None:
        job = asyncio.create_task(workers.run(parse_jobs.spin, str(tmp_path / "a"), LONG_S))
        os.kill(await _started(tmp_path / "a"), signal.SIGKILL)  # as the OOM killer would
        with pytest.raises(WorkerDied):
            await job
        assert await workers.run(parse_jobs.echo, "after") == "after"
    _run(body)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="slots must be at least 1"):
        ParseWorkers(0, 1)
