"""What the operator process keeps per InferenceService, and that it lets go of it."""

from __future__ import annotations

import asyncio
import logging
import random

from kvpilot.operator.kube import KubeClient
from kvpilot.operator.reconcile import Runtime
from kvpilot.operator.settings import OperatorSettings


def test_forget_drops_an_unused_lock_the_status_basis_and_the_engine_series() -> None:
    async def scenario() -> None:
        rt = Runtime(settings=OperatorSettings(), client=KubeClient())
        lock = rt.lock_for("ns", "a")
        assert rt.lock_for("ns", "a") is lock
        rt.status_basis["ns/a"] = "17"
        rt.metrics.set_engine("ns", "a", {"max_num_batched_tokens": "2048", "gpu_memory_utilization": "0.92",
                                          "max_num_seqs": "256", "config_hash": "abc"})
        async with lock:
            rt.forget("ns", "a")
            assert rt.locks["ns/a"] is lock  # held: whoever holds it, and its waiters, keep it
        rt.forget("ns", "a")
        assert rt.locks == {} and rt.status_basis == {}
        assert rt.lock_for("ns", "a") is not lock
        assert rt.metrics._engine_series == {}

    asyncio.run(scenario())


def test_a_failed_deployment_event_is_handled_again_once_with_a_growing_delay() -> None:
    async def scenario() -> None:
        settings = OperatorSettings(handler_retry_delay_seconds=1.0, event_retry_cap_seconds=4.0)
        rt = Runtime(settings=settings, client=KubeClient(rng=random.Random(5)))
        delays = [rt.next_event_retry_delay("ns/a", None) for _ in range(5)]
        for n, delay in enumerate(delays):  # 1, 2, 4, 4, 4 s with +-25% jitter
            nominal = min(4.0, 2.0 ** n)
            assert 0.75 * nominal <= delay <= 1.25 * nominal
        assert rt.next_event_retry_delay("ns/a", 9.0) == 9.0  # a Retry-After is the least wait
        ran: list[str] = []
        done = asyncio.Event()

        async def job(what: str) -> None:
            ran.append(what)
            done.set()

        log = logging.getLogger("test")
        rt.handle_again("ns/a", 0.01, lambda: job("first"), log)
        rt.handle_again("ns/a", 0.01, lambda: job("second"), log)  # replaces the pending first
        await asyncio.wait_for(done.wait(), 5)
        await asyncio.sleep(0.05)
        assert ran == ["second"] and rt.event_retries == {}
        rt.handle_again("ns/b", 3600, lambda: job("never"), log)
        pending = rt.event_retries["ns/b"]
        rt.forget("ns", "b")  # deleted: nothing left to retry
        await asyncio.sleep(0)
        assert pending.cancelled() and "ns/b" not in rt.event_retry_attempts
        rt.handle_again("ns/c", 3600, lambda: job("never"), log)
        await rt.close()
        assert ran == ["second"] and rt.event_retries == {}

    asyncio.run(scenario())
