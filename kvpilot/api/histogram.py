"""Prometheus's reading of a classic histogram: cumulative bucket counts and `histogram_quantile`.

The live tuner never sees a latency: it sees `histogram_quantile(0.99, ...)` over vLLM's buckets,
which places the quantile by linear interpolation inside the bucket that holds its rank.  Between
two edges that reading depends only on how the observations split across buckets: with ITL edges at
10 and 25 ms, a p99 anywhere in (10, 25] ms reads as 10 ms plus 15 ms times the share of the
bucket's observations below the rank, so "1% of token gaps over 25 ms" and "3% of them under 10 ms"
move it as much as the gaps' own lengths do.  Whatever predicts what the live tuner will read (the
twin's warm start) reads its own samples the same way.

Semantics are those of Prometheus's `bucketQuantile` (promql/quantile.go) for a classic histogram
with a `+Inf` bucket; the tests hold this module to `promtool`'s answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def cumulative_counts(samples: Sequence[float] | np.ndarray, edges: Sequence[float]) -> list[int]:
    """The `_bucket` counts of `samples` at each edge (`le`, inclusive), then the `+Inf` bucket:
    what a Prometheus client library exposes after observing them."""
    s = np.sort(np.asarray(samples, dtype=float))
    counts = np.searchsorted(s, np.asarray(edges, dtype=float), side="right")
    return [int(c) for c in counts] + [len(s)]


def histogram_quantile(q: float, edges: Sequence[float], counts: Sequence[float]) -> float:
    """`histogram_quantile(q, ...)` of one classic histogram: `edges` its finite upper bounds,
    ascending; `counts` the cumulative count at each, then the `+Inf` bucket's (the total).

    As Prometheus: NaN for no observations; the quantile inside the bucket holding rank q * total,
    linearly between its lower and upper bound (0 below the first edge when it is positive); the
    highest finite edge when the rank falls in `+Inf`; -inf / +inf for q below 0 / above 1.
    """
    if len(counts) != len(edges) + 1:
        raise ValueError(f"counts needs one value per edge and one for +Inf: {len(edges)} edges, "
                         f"{len(counts)} counts")
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError(f"edges must ascend strictly, got {list(edges)}")
    if math.isnan(q):
        return math.nan
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    # Prometheus repairs counts that fall between buckets (a scrape racing an observation).
    fixed = list(np.maximum.accumulate(np.asarray(counts, dtype=float)))
    total = fixed[-1]
    if not edges or total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, c in enumerate(fixed) if c >= rank)
    if b == len(edges):
        return float(edges[-1])
    if b == 0 and edges[0] <= 0:
        return float(edges[0])
    start, end, count = 0.0, float(edges[b]), fixed[b]
    if b > 0:
        start = float(edges[b - 1])
        count -= fixed[b - 1]
        rank -= fixed[b - 1]
    if count == 0:  # q = 0 over an empty first bucket: Go's 0/0
        return math.nan
    return start + (end - start) * (rank / count)


def read_quantile(q: float, samples: Sequence[float] | np.ndarray, edges: Sequence[float]) -> float:
    """The q-quantile of `samples` as Prometheus reads it from buckets at `edges`."""
    return histogram_quantile(q, edges, cumulative_counts(samples, edges))
