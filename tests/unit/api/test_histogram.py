"""`histogram_quantile` as Prometheus computes it: the oracle is promtool's own PromQL engine.

One `promtool test rules` run evaluates `histogram_quantile(q, hN_bucket)` for every case; each case
expects an impossible value, so promtool reports what it got, and kvpilot's answer must equal it.
"""

from __future__ import annotations

import math
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness.prometheus import require_promtool
from kvpilot.api import vllm
from kvpilot.api.histogram import cumulative_counts, histogram_quantile, read_quantile
from kvpilot.slo import yamltext

IMPOSSIBLE = -12345.0


def _cases() -> list[tuple[float, tuple[float, ...], list[float]]]:
    rng = random.Random(7)
    gen = np.random.default_rng(7)
    cases: list[tuple[float, tuple[float, ...], list[float]]] = []
    for edges in (vllm.ITL_BUCKETS, vllm.TTFT_BUCKETS):
        for _ in range(12):
            x = gen.lognormal(math.log(rng.uniform(0.005, 0.5)), rng.uniform(0.1, 1.5), rng.randint(1, 400))
            cases.append((rng.choice((0.5, 0.9, 0.99, 0.999)), edges, [float(c) for c in cumulative_counts(x, edges)]))
    edges = (0.01, 0.025, 0.05)
    cases += [
        (0.99, edges, [97.0, 100.0, 100.0, 100.0]),  # inside (10, 25] ms: by the split around the rank
        (0.99, edges, [0.0, 0.0, 0.0, 5.0]),  # all in +Inf: the highest finite edge
        (0.5, edges, [4.0, 4.0, 8.0, 8.0]),  # the rank exactly on a bucket's count
        (0.3, edges, [10.0, 10.0, 10.0, 10.0]),  # the first bucket: from 0
        (0.99, edges, [0.0, 0.0, 0.0, 0.0]),  # no observations: NaN
        (0.9, edges, [5.0, 3.0, 9.0, 9.0]),  # counts out of order (a racing scrape): repaired
        (0.0, edges, [0.0, 2.0, 2.0, 2.0]),  # q = 0 over an empty first bucket
        (1.0, edges, [1.0, 2.0, 3.0, 3.0]),
        (1.5, edges, [1.0, 2.0, 3.0, 3.0]),
        (-0.5, edges, [1.0, 2.0, 3.0, 3.0]),
        (0.5, (-1.0, 0.0, 1.0), [0.0, 4.0, 6.0, 6.0]),  # non-positive edges
    ]
    return cases


def _prometheus_answers(cases: list[tuple[float, tuple[float, ...], list[float]]], tmp_path: Path) -> list[float]:
    series, exprs = [], []
    for i, (q, edges, counts) in enumerate(cases):
        for le, c in zip((*(f"{e:g}" for e in edges), "+Inf"), counts, strict=True):
            series.append({"series": f'h{i}_bucket{{le="{le}"}}', "values": f"{c:g}"})
        exprs.append({"expr": f"histogram_quantile({q:g}, h{i}_bucket)", "eval_time": "0m",
                      "exp_samples": [{"labels": "{}", "value": IMPOSSIBLE}]})
    path = tmp_path / "quantiles.test.yaml"
    path.write_text(yamltext.dump({"tests": [{"interval": "1m", "input_series": series, "promql_expr_test": exprs}]}))
    proc = subprocess.run([require_promtool(), "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    got = {int(m[1]): m[2] for m in re.finditer(
        r'expr: "histogram_quantile\([^,]+, h(\d+)_bucket\)".*?\n\s*exp:.*?\n\s*got: (.*?)\n', out, re.S)}
    assert sorted(got) == list(range(len(cases))), out[-3000:]
    return [float(g.split()[-1]) if g.strip() != "nil" else math.nan for _, g in sorted(got.items())]


def test_quantiles_equal_promtools(tmp_path: Path) -> None:
    cases = _cases()
    theirs = _prometheus_answers(cases, tmp_path)
    ours = [histogram_quantile(q, edges, counts) for q, edges, counts in cases]
    differ = [(i, cases[i][0], cases[i][2], a, b) for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
              if not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-12 * abs(b))]
    assert not differ, f"(case, q, counts, kvpilot, prometheus): {differ}"
    assert any(math.isnan(b) for b in theirs) and math.inf in theirs and -math.inf in theirs  # edges exercised


def test_the_reading_is_exact_at_edges_and_interpolates_between() -> None:
    gaps = np.r_[np.full(970, 0.004), np.full(30, 0.020)]  # 3% of gaps between 10 and 25 ms
    assert read_quantile(0.99, gaps, vllm.ITL_BUCKETS) == pytest.approx(0.01 + 0.015 * 20 / 30)
    assert float(np.quantile(gaps, 0.99)) == pytest.approx(0.020)  # the samples' own p99: another number
    assert read_quantile(0.99, np.full(100, 0.030), vllm.ITL_BUCKETS) <= 0.05
    assert read_quantile(0.99, np.full(100, 0.030), vllm.ITL_BUCKETS) > 0.025


def test_bad_shapes_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="one value per edge and one for \\+Inf"):
        histogram_quantile(0.5, (0.1, 0.2), [1, 2])
    with pytest.raises(ValueError, match="ascend strictly"):
        histogram_quantile(0.5, (0.2, 0.1), [1, 2, 3])
