"""The fake tuning world the live loop's tests and benchmarks drive: a virtual clock, an engine whose
latency follows its config and the offered load, and a signal source that can go dark.  Two tracks for
canary trials: a canary engine beside the stable one takes `canary_weight` of the requests, and the
world counts the requests each engine served (`served`).  Time only moves when the loop sleeps, so a
10-minute trial runs in microseconds and every event has an exact time.

`World` is the tuner's Applier, CanaryApplier, TrackSignals and FleetSize at once; a benchmark with a latency
model of its own subclasses it and replaces the signals (`_refuse` decides which engines cannot start).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvpilot.api.vocabulary import Track
from kvpilot.tuner.core.fleetsize import Replicas
from kvpilot.tuner.core.loop import ApplyFailed, SignalsUnavailable
from kvpilot.tuner.core.objective import Measurement
from kvpilot.tuner.core.space import EngineParams


class VirtualClock:
    """The tuner's Clock: time moves only when someone sleeps; each listener hears the new time."""

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
    clock: VirtualClock = field(default_factory=VirtualClock)
    load: Callable[[float], float] = lambda t: 5.0
    dark: list[tuple[float, float]] = field(default_factory=list)  # Prometheus down in [a, b)
    oom_above: float = 0.93  # util above this "runs out of memory" at start-up
    rollout_s: float = 30.0  # how long `apply` takes
    burning: Callable[[EngineParams], bool] = lambda p: False
    latency: Callable[[EngineParams, float], tuple[float, float]] = default_latency
    applies: list[tuple[float, EngineParams, int | None]] = field(default_factory=list)
    reads_while_dark: int = 0
    # -- the canary track --
    canary: EngineParams | None = None
    canary_weight: float = 0.25  # share of requests the canary takes while serving
    canary_startup_s: float = 20.0
    canary_starts: list[tuple[float, EngineParams, int]] = field(default_factory=list)
    canary_stops: list[float] = field(default_factory=list)  # every stop_canary call, canary or not
    served: dict[EngineParams, float] = field(default_factory=dict)  # requests each engine served
    noise: float = 0.0  # relative sd of each p99 reading (seeded)
    seed: int = 0
    # -- the fleet's size (FleetSize): stable replicas (desired, ready) at a time; None reads as unknown --
    replicas_at: Callable[[float], tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        self._last = self.clock.t
        self._rng = random.Random(self.seed)
        self.clock.listeners.append(self._serve)

    def _serve(self, t: float) -> None:
        """Integrate the requests served since the last tick, split between the tracks."""
        dt, self._last = t - self._last, t
        n = max(self.load(t), 0.0) * dt
        share = self.canary_weight if self.canary is not None else 0.0
        self.served[self.engine] = self.served.get(self.engine, 0.0) + n * (1 - share)
        if self.canary is not None:
            self.served[self.canary] = self.served.get(self.canary, 0.0) + n * share

    def _latency(self, p: EngineParams, load: float) -> tuple[float, float]:
        ttft, itl = self.latency(p, load)
        if self.noise:
            ttft *= 1 + self._rng.gauss(0, self.noise)
            itl *= 1 + self._rng.gauss(0, self.noise)
        return ttft, itl

    # -- CanaryApplier ---------------------------------------------------------------
    def start_canary(self, params: EngineParams, trial: int) -> None:
        assert not self.is_dark(), "a canary was started while signals were dark"
        assert self.canary is None, "a second canary"
        self.canary_starts.append((self.clock.t, params, trial))
        self._refuse(params)
        self.clock.sleep(self.canary_startup_s)
        self.canary = params

    def stop_canary(self) -> None:
        self.canary_stops.append(self.clock.t)
        self.canary = None

    # -- Applier ---------------------------------------------------------------------
    def current(self) -> EngineParams:
        return self.engine

    def apply(self, params: EngineParams, trial: int | None) -> None:
        assert not self.is_dark(), "the engine was changed while signals were dark"
        self.applies.append((self.clock.t, params, trial))
        self._refuse(params)
        self.clock.sleep(self.rollout_s)  # the rollout takes a while
        self.engine = params

    def _refuse(self, params: EngineParams) -> None:
        """Raise ApplyFailed for an engine that cannot start (here: one that leaves no room for activations)."""
        if params.gpu_memory_utilization > self.oom_above:
            raise ApplyFailed("OutOfMemory", f"{params.gpu_memory_utilization} leaves no room for activations")

    # -- FleetSize -------------------------------------------------------------------
    def replicas(self) -> Replicas | None:
        if self.replicas_at is None:
            return None
        return Replicas(*self.replicas_at(self.clock.t))

    # -- SignalSource ----------------------------------------------------------------
    def is_dark(self) -> bool:
        return any(a <= self.clock.t < b for a, b in self.dark)

    def _check(self) -> None:
        if self.is_dark():
            self.reads_while_dark += 1
            raise SignalsUnavailable("PrometheusUnreachable", "connection refused")
        if self.load(self.clock.t) <= 0:
            raise SignalsUnavailable("NoTraffic", "no requests in the window")

    def _burn(self, p: EngineParams) -> float:
        if self.burning(p):
            return 60.0
        ttft, itl = self.latency(p, self.load(self.clock.t))
        return 0.2 if ttft <= 0.5 and itl <= 0.05 else 5.0

    def burn_rate(self, window_s: float, track: Track | None = None) -> float:
        self._check()
        if track is Track.CANARY:
            if self.canary is None:
                raise SignalsUnavailable("NoTraffic", "no canary requests in the window")
            return self._burn(self.canary)
        if track is Track.STABLE or self.canary is None:
            return self._burn(self.engine)
        w = self.canary_weight
        return (1 - w) * self._burn(self.engine) + w * self._burn(self.canary)

    def _measure(self, p: EngineParams, load: float) -> Measurement:
        ttft, itl = self._latency(p, load)
        return Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=load, burn_rate=self._burn(p))

    def measure(self, window_s: float) -> Measurement:
        self._check()
        return self._measure(self.engine, self.load(self.clock.t))

    def measure_tracks(self, window_s: float) -> tuple[Measurement, Measurement]:
        self._check()
        if self.canary is None:
            raise SignalsUnavailable("NoTraffic", "no canary requests in the window")
        load = self.load(self.clock.t)
        stable, canary = self._measure(self.engine, load), self._measure(self.canary, load)
        # As Prometheus reads a track: its own requests' rate (the latency model stays per engine).
        w = self.canary_weight
        return replace(stable, request_rate=load * (1 - w)), replace(canary, request_rate=load * w)
