"""The fleet twin: N replicas of one engine config behind a router, in virtual time, a day in seconds.

The step-level twin (`offline.simulate`) says how one replica serves a token mix at a rate; running it
for every replica over a whole day would take minutes per replica. So the fleet twin works on two
levels:

- `measure_envelope` runs the step-level twin once per (config, token mix): the replica's saturation
  throughput (flooded), and at a grid of rates up to it the share of requests whose TTFT misses the SLO,
  the share of token gaps over the ITL SLO, and the mean end-to-end latency (for in-flight counts);
- `FleetTwin` advances in ticks (10 s by default): Poisson arrivals at the load's rate, split by the
  router over the replicas that serve (a Service's random spread: a multinomial split; least
  outstanding requests, as the Gateway API inference extension routes: each request to the replica
  with the fewest in flight), each replica serving at most its saturation throughput and queueing the
  rest; a request's TTFT misses when its queue wait alone passes the SLO, else as the envelope says at
  the replica's rate. Replicas asked for take their start-up time before they serve; replicas removed
  stop taking requests at once and their queue goes back to the router (drained, not lost).

What the ticks lose: the order of requests inside a tick, and the burstiness least-outstanding routing
smooths below Poisson (its envelope is the random spread's, so its figures are conservative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpilot.api.slo import SLO
from kvpilot.twin.engine import EngineConfig
from kvpilot.twin.offline import simulate
from kvpilot.twin.workload import Workload

ROUTERS = ("random", "least-outstanding")
GOOD_SHARE = 0.99  # a p99 within the SLO: at most 1% over it


@dataclass(frozen=True)
class Envelope:
    """How one replica of a config serves a token mix, by request rate (requests per second)."""

    rates: tuple[float, ...]  # ascending
    ttft_miss: tuple[float, ...]  # share of requests over the TTFT SLO at each rate
    itl_miss: tuple[float, ...]  # share of token gaps over the ITL SLO
    e2e_mean_s: tuple[float, ...]
    saturation_rps: float  # requests per second completed when flooded

    def __post_init__(self) -> None:
        n = len(self.rates)
        if n < 2 or any(len(x) != n for x in (self.ttft_miss, self.itl_miss, self.e2e_mean_s)):
            raise ValueError("an envelope needs at least two rates, and one value of each kind per rate")
        if list(self.rates) != sorted(self.rates) or self.saturation_rps <= 0:
            raise ValueError("envelope rates must ascend and the saturation throughput be positive")

    def at(self, rate: float) -> tuple[float, float, float]:
        """(TTFT miss share, ITL miss share, mean e2e seconds) at `rate`, interpolated; held at the ends."""
        xs = self.rates
        return (float(np.interp(rate, xs, self.ttft_miss)), float(np.interp(rate, xs, self.itl_miss)),
                float(np.interp(rate, xs, self.e2e_mean_s)))

    @property
    def capacity_rps(self) -> float:
        """The highest rate whose TTFT and ITL p99s are both within the SLO (misses at most 1%)."""
        best = 0.0
        for i, rate in enumerate(self.rates):
            if max(self.ttft_miss[i], self.itl_miss[i]) <= 1 - GOOD_SHARE:
                best = rate
            elif i > 0 and best == self.rates[i - 1]:
                # Where the misses cross 1% between two grid rates, linearly.
                before = max(self.ttft_miss[i - 1], self.itl_miss[i - 1])
                after = max(self.ttft_miss[i], self.itl_miss[i])
                share = (1 - GOOD_SHARE - before) / (after - before) if after > before else 0.0
                best = self.rates[i - 1] + share * (rate - self.rates[i - 1])
                break
            else:
                break
        return best


def measure_envelope(config: EngineConfig, mix: str, slo: SLO, *, points: int = 10, duration_s: float = 120.0,
                     flood_requests: int = 1500, seed: int = 0) -> Envelope:
    """The envelope of `config` for the token mix `mix` (a workload spec's prompt and output parts,
    e.g. `prompt=sharegpt,output=sharegpt`), measured with the step-level twin."""
    flood = simulate(config, f"poisson:rate=100000,{mix}", num_requests=flood_requests, seed=seed, slo=slo)
    saturation = flood.throughput["requests_per_s"]
    rates, ttft, itl, e2e = [], [], [], []
    # From 2% of saturation up, geometrically: a config whose p99s leave the SLO at a low load (long
    # prompts, a small chunk) still gets a capacity, not a zero.
    for rate in np.geomspace(saturation * 0.02, saturation, points):
        report = simulate(config, Workload.parse(f"poisson:rate={rate:.6g},{mix}"), duration_s=duration_s,
                          seed=seed, slo=slo)
        rates.append(float(rate))
        ttft.append(1.0 - report.goodput["ttft_attainment"])
        itl.append(1.0 - report.goodput["itl_attainment"])
        e2e.append(report.e2e_s["mean"])
    return Envelope(tuple(rates), tuple(ttft), tuple(itl), tuple(e2e), saturation)


@dataclass
class Replica:
    serving_from: float  # virtual time it starts to serve (its start-up done)
    queued: float = 0.0  # requests waiting beyond what it served (fluid)


@dataclass(frozen=True)
class Tick:
    """One tick of the fleet: what arrived, what missed, what it cost."""

    at: float
    seconds: float
    requests: int
    ttft_misses: float
    itl_misses: float  # requests' worth: the ITL miss share weighted by requests
    provisioned: int  # replicas holding a GPU set (starting or serving)
    serving: int
    in_flight: float  # requests running or queued over the fleet (vLLM's running + waiting)
    queued: float

    @property
    def bad(self) -> float:
        """Requests that missed either objective (the larger share: they overlap)."""
        return max(self.ttft_misses, self.itl_misses)


@dataclass
class FleetTwin:
    envelope: Envelope
    slo: SLO
    startup_s: float
    router: str = "random"
    replicas: int = 1
    tick_s: float = 10.0
    seed: int = 0
    gpus_per_replica: int = 1
    now: float = 0.0
    _fleet: list[Replica] = field(default_factory=list)
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)} (got {self.router!r})")
        if self.tick_s <= 0 or self.startup_s < 0:
            raise ValueError("tick_s must be positive and startup_s not negative")
        self._rng = np.random.default_rng(self.seed)
        # The fleet at the start serves already (a day starts from a running service).
        self._fleet = [Replica(serving_from=self.now) for _ in range(self.replicas)]

    @property
    def provisioned(self) -> int:
        return len(self._fleet)

    def serving(self) -> list[Replica]:
        return [r for r in self._fleet if r.serving_from <= self.now]

    def serving_times(self) -> list[float]:
        """When each replica asked for began (or begins) to serve, in order: exact, not by the tick."""
        return sorted(r.serving_from for r in self._fleet)

    def scale(self, desired: int) -> None:
        """Ask for `desired` replicas: new ones start now; removed ones go starting ones first (they
        serve nobody yet), then those that serve, their queues handed back to the others."""
        if desired < 0:
            raise ValueError(f"desired replicas must be >= 0 (got {desired})")
        while len(self._fleet) < desired:
            self._fleet.append(Replica(serving_from=self.now + self.startup_s))
        if len(self._fleet) > desired:
            keep = sorted(self._fleet, key=lambda r: r.serving_from)[:desired]
            kept = {id(r) for r in keep}
            dropped = sum(r.queued for r in self._fleet if id(r) not in kept)
            self._fleet = keep
            # The queue goes to those that serve, else to those starting (it waits for them).
            takers = self.serving() or keep
            for r in takers:
                r.queued += dropped / len(takers)

    def step(self, rate: float) -> Tick:
        """One tick at `rate` requests per second."""
        dt = self.tick_s
        arrivals = int(self._rng.poisson(max(rate, 0.0) * dt))
        serving = self.serving()
        env = self.envelope
        ttft_miss = itl_miss = in_flight = queued = 0.0
        if not serving:
            # Nobody serves: every request waits the whole tick at least, and is counted missed
            # once the wait passes the TTFT SLO (it does: a tick is longer than any TTFT SLO here).
            ttft_miss = itl_miss = float(arrivals)
        else:
            shares = self._route(arrivals, serving)
            for replica, share in zip(serving, shares, strict=True):
                offered = replica.queued + share
                capacity = env.saturation_rps * dt
                served = min(offered, capacity)
                before, replica.queued = replica.queued, offered - served
                # A request's queue wait: the queue ahead of it, served at the saturation rate.
                wait_s = 0.5 * (before + replica.queued) / env.saturation_rps
                t_share, i_share, e2e = env.at(min(share / dt, env.saturation_rps))
                ttft_miss += share * (1.0 if wait_s > self.slo.ttft_seconds else t_share)
                itl_miss += share * i_share
                in_flight += min(share / dt, env.saturation_rps) * e2e + replica.queued
                queued += replica.queued
        tick = Tick(self.now, dt, arrivals, ttft_miss, itl_miss, self.provisioned, len(serving), in_flight, queued)
        self.now += dt
        return tick

    def _route(self, arrivals: int, serving: Sequence[Replica]) -> list[float]:
        n = len(serving)
        if self.router == "random":
            return [float(x) for x in self._rng.multinomial(arrivals, [1.0 / n] * n)]
        # Least outstanding: fill the shortest queues first, then spread evenly (water-filling).
        queues = [r.queued for r in serving]
        order = sorted(range(n), key=lambda i: queues[i])
        shares = [0.0] * n
        left = float(arrivals)
        for k in range(n):
            # Raise the k+1 shortest queues to the next one's level, or as far as the arrivals go.
            level_next = queues[order[k + 1]] if k + 1 < n else math.inf
            group = order[:k + 1]
            level_now = max(queues[i] + shares[i] for i in group)
            room = (level_next - level_now) * len(group)
            give = min(left, room)
            for i in group:
                shares[i] += give / len(group)
            left -= give
            if left <= 0:
                break
        return shares


@dataclass(frozen=True)
class Window:
    """A stretch of ticks as the SLO reads it: both p99s within the SLO when at most 1% missed each."""

    requests: int
    ttft_misses: float
    itl_misses: float

    @property
    def attained(self) -> bool:
        if self.requests == 0:
            return True
        limit = (1 - GOOD_SHARE) * self.requests
        return self.ttft_misses <= limit and self.itl_misses <= limit


def windows(ticks: Sequence[Tick], seconds: float = 300.0) -> list[Window]:
    """The ticks grouped into consecutive windows of `seconds` (5 minutes: the dashboards' p99)."""
    buckets: list[list[Tick]] = [[]]
    for tick in ticks:
        if sum(t.seconds for t in buckets[-1]) >= seconds - 1e-9:
            buckets.append([])
        buckets[-1].append(tick)
    return [Window(sum(t.requests for t in b), sum(t.ttft_misses for t in b), sum(t.itl_misses for t in b))
            for b in buckets if b]


def gpu_hours(ticks: Sequence[Tick], gpus_per_replica: int = 1) -> float:
    return sum(t.provisioned * t.seconds for t in ticks) * gpus_per_replica / 3600.0


def budget_burned(ticks: Sequence[Tick], objective: float) -> float:
    """The share of the error budget the ticks used: bad requests over what the objective allows."""
    requests = sum(t.requests for t in ticks)
    if requests == 0:
        return 0.0
    return sum(t.bad for t in ticks) / (requests * (1.0 - objective))
