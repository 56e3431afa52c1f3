"""Capacity: the highest request rate at which both p99s stay within the SLO.

Found by a search over the offered rate: bracket by doubling (or halving) from a hint, then
bisect on a log scale to a relative tolerance.  p99 latency grows with load, so "within SLO"
flips once from true to false as the rate rises; a seeded simulation keeps that flip
reproducible.  With a good hint (the incumbent's capacity), a search costs 5-7 simulations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# probe(rate) -> (ttft p99 s, itl p99 s); raise to say the config cannot run at all.
Probe = Callable[[float], tuple[float, float]]


@dataclass
class CapacityResult:
    capacity: float  # req/s; 0.0 when even the lowest probed rate misses the SLO
    probes: list[tuple[float, float, float, bool]] = field(default_factory=list)  # rate, ttft, itl, ok
    at_capacity: tuple[float, float] | None = None  # p99s measured at the capacity rate

    @property
    def simulations(self) -> int:
        return len(self.probes)


def find_capacity(
    probe: Probe,
    ttft_slo: float,
    itl_slo: float,
    *,
    hint: float = 4.0,
    min_rate: float = 0.05,
    max_rate: float = 1000.0,
    rel_tol: float = 0.03,
    max_probes: int = 14,
    first_step: float = 1.25,
) -> CapacityResult:
    """Bracket from `hint` with steps that grow (x1.25, x1.56, x2.4, ...: a good hint costs two
    probes to bracket, a bad one few more), then bisect on a log scale to `rel_tol`."""
    result = CapacityResult(0.0)

    def ok(rate: float) -> bool:
        ttft, itl = probe(rate)
        good = ttft <= ttft_slo and itl <= itl_slo
        result.probes.append((rate, ttft, itl, good))
        if good and rate >= result.capacity:
            result.capacity, result.at_capacity = rate, (ttft, itl)
        return good

    rate = min(max(hint, min_rate), max_rate)
    step = first_step
    if ok(rate):
        lo, hi = rate, None
        while hi is None and len(result.probes) < max_probes:
            nxt = min(lo * step, max_rate)
            step = min(step * step, 4.0)
            if nxt <= lo:
                return result  # at the ceiling and still fine
            if ok(nxt):
                lo = nxt
            else:
                hi = nxt
        if hi is None:
            return result
    else:
        hi, lo_opt = rate, None
        while lo_opt is None and len(result.probes) < max_probes:
            if hi <= min_rate:
                return result  # capacity 0: misses the SLO even when nearly idle
            nxt = max(hi / step, min_rate)
            step = min(step * step, 4.0)
            if ok(nxt):
                lo_opt = nxt
            else:
                hi = nxt
        if lo_opt is None:
            return result
        lo = lo_opt
    while hi / lo > 1.0 + rel_tol and len(result.probes) < max_probes:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return result
