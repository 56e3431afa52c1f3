"""Capacity search over the offered rate."""

from __future__ import annotations

import pytest

from kvpilot.tuner.core.capacity import find_capacity


def _queue(capacity: float):
    """An M/M/1-like p99: fine well below `capacity`, over the SLO above it."""
    def probe(rate: float) -> tuple[float, float]:
        util = rate / capacity
        ttft = 0.05 / max(1e-9, 1.0 - util) if util < 1 else float("inf")
        return ttft, 0.01
    return probe


@pytest.mark.parametrize("hint", [0.3, 4.0, 50.0])
def test_finds_the_rate_where_the_p99_crosses_the_slo(hint: float) -> None:
    # p99 <= 0.5 s while 0.05 / (1 - rate/10) <= 0.5, i.e. rate <= 9.
    res = find_capacity(_queue(10.0), 0.5, 0.05, hint=hint, rel_tol=0.02)
    assert 9.0 / 1.02 <= res.capacity <= 9.0
    assert res.at_capacity is not None and res.at_capacity[0] <= 0.5
    assert res.simulations <= 13  # even from a hint 30x off


def test_a_good_hint_is_cheap() -> None:
    res = find_capacity(_queue(10.0), 0.5, 0.05, hint=8.8, rel_tol=0.03)
    assert res.simulations <= 5


def test_zero_when_the_slo_is_missed_at_any_load() -> None:
    res = find_capacity(lambda r: (1.0, 0.01), 0.5, 0.05, hint=2.0, min_rate=0.05)
    assert res.capacity == 0.0
    assert min(p[0] for p in res.probes) == pytest.approx(0.05)
