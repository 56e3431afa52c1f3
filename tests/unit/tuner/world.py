"""A small fake world for the live loop: a virtual clock, an engine whose latency follows its
config and the offered load, and a signal source that can go dark.  Time only moves when the
loop sleeps, so a 10-minute trial runs in microseconds and every event has an exact time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvpilot.tuner.core.loop import ApplyFailed, SignalsUnavailable
from kvpilot.tuner.core.objective import Measurement
from kvpilot.tuner.core.space import EngineParams


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.listeners: list[Callable[[float], None]] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
        for fn in self.listeners:
            fn(self.t)


def default_latency(p: EngineParams, load: float) -> tuple[float, float]:
    """p99s that a plausible engine would show: best near 2048 tokens, more KV is better."""
    import math

    chunk_penalty = abs(math.log2(p.max_num_batched_tokens / 2048)) * 0.05
    kv = (p.gpu_memory_utilization - 0.6) * 10
    ttft = 0.1 + load * 0.02 / kv + chunk_penalty
    itl = 0.02 + p.max_num_batched_tokens / 2048 * 0.005 + load * 0.0005
    return ttft, itl


@dataclass
class World:
    engine: EngineParams
    clock: FakeClock = field(default_factory=FakeClock)
    load: Callable[[float], float] = lambda t: 5.0
    dark: list[tuple[float, float]] = field(default_factory=list)  # Prometheus down in [a, b)
    oom_above: float = 0.93  # util above this "runs out of memory" at start-up
    burning: Callable[[EngineParams], bool] = lambda p: False
    latency: Callable[[EngineParams, float], tuple[float, float]] = default_latency
    applies: list[tuple[float, EngineParams, int | None]] = field(default_factory=list)
    reads_while_dark: int = 0

    # -- Applier ---------------------------------------------------------------------
    def current(self) -> EngineParams:
        return self.engine

    def apply(self, params: EngineParams, trial: int | None) -> None:
        assert not self.is_dark(), "the engine was changed while signals were dark"
        self.applies.append((self.clock.t, params, trial))
        if params.gpu_memory_utilization > self.oom_above:
            raise ApplyFailed("OutOfMemory", f"{params.gpu_memory_utilization} leaves no room for activations")
        self.clock.sleep(30)  # the rollout takes a while
        self.engine = params

    # -- SignalSource ----------------------------------------------------------------
    def is_dark(self) -> bool:
        return any(a <= self.clock.t < b for a, b in self.dark)

    def _check(self) -> None:
        if self.is_dark():
            self.reads_while_dark += 1
            raise SignalsUnavailable("PrometheusUnreachable", "connection refused")
        if self.load(self.clock.t) <= 0:
            raise SignalsUnavailable("NoTraffic", "no requests in the window")

    def burn_rate(self, window_s: float) -> float:
        self._check()
        if self.burning(self.engine):
            return 60.0
        ttft, itl = self.latency(self.engine, self.load(self.clock.t))
        return 0.2 if ttft <= 0.5 and itl <= 0.05 else 5.0

    def measure(self, window_s: float) -> Measurement:
        self._check()
        load = self.load(self.clock.t)
        ttft, itl = self.latency(self.engine, load)
        return Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=load, burn_rate=self.burn_rate(window_s))
