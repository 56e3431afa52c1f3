"""What the operator process keeps per InferenceService, and that it lets go of it."""

from __future__ import annotations

import asyncio

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
