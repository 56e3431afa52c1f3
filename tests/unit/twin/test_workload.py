"""Workload specs, determinism, trace replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvpilot.twin.workload import LengthDist, Workload, WorkloadError


def test_same_spec_and_seed_give_the_same_requests() -> None:
    w = Workload.parse("gamma:rate=5,cv=3,prompt=lognormal/500/0.7,output=10..200")
    a = w.generate(duration_s=100, seed=7)
    b = w.generate(duration_s=100, seed=7)
    c = w.generate(duration_s=100, seed=8)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert np.array_equal(a.output_tokens, b.output_tokens)
    assert not np.array_equal(a.prompt_tokens[:10], c.prompt_tokens[:10])


def test_poisson_rate_and_window() -> None:
    batch = Workload.parse("poisson:rate=20,prompt=100,output=10").generate(duration_s=500, seed=1)
    assert 0.95 * 10000 < len(batch) < 1.05 * 10000
    assert batch.arrival_s.max() < 500 and np.all(np.diff(batch.arrival_s) >= 0)
    assert set(batch.prompt_tokens.tolist()) == {100} and set(batch.output_tokens.tolist()) == {10}
    gaps = np.diff(batch.arrival_s)
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # exponential: cv 1


def test_gamma_is_burstier_than_poisson() -> None:
    gaps = np.diff(Workload.parse("gamma:rate=20,cv=3").generate(num_requests=20000, seed=1).arrival_s)
    assert 2.6 < gaps.std() / gaps.mean() < 3.4
    assert 1 / 22 < gaps.mean() < 1 / 18


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    u = LengthDist.parse("10..20", "prompt").sample(rng, 5000)
    assert u.min() == 10 and u.max() == 20
    ln = LengthDist.parse("lognormal/300/0.5", "prompt").sample(rng, 20000)
    assert 280 < np.median(ln) < 320 and ln.min() >= 1
    share = Workload.parse("poisson:rate=1").generate(num_requests=20000, seed=0)
    assert 200 < share.prompt_tokens.mean() < 300 and 150 < share.output_tokens.mean() < 260


def test_count_limit_and_prefixes() -> None:
    b = Workload.parse("poisson:rate=3,prompt=50,output=5,prefix=100,prefixes=2").generate(num_requests=50, seed=0)
    assert len(b) == 50
    assert set(b.prompt_tokens.tolist()) == {150}
    assert set(b.prefix_keys or []) == {"prefix-0", "prefix-1"}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("uniform:rate=1", "start with poisson: or gamma:"),
        ("poisson:prompt=10", "rate=R"),
        ("poisson:rate=-1", "positive"),
        ("poisson:rate=1,foo=2", "unknown key"),
        ("poisson:rate=1,prompt=abc", "LOW..HIGH"),
        ("poisson:rate=1,output=0", ">= 1"),
        ("poisson:rate=1,prompt", "key=value"),
    ],
)
def test_bad_specs_say_what_is_allowed(spec: str, match: str) -> None:
    with pytest.raises(WorkloadError, match=match):
        Workload.parse(spec)


def test_trace_replay(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"arrival_s": 2.0, "prompt_tokens": 30, "output_tokens": 3},
            {"arrival_s": 0.5, "prompt_tokens": 10, "output_tokens": 1, "prefix": "p", "prefix_tokens": 8},
            {"arrival_s": 9.0, "prompt_tokens": 5, "output_tokens": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = Workload.parse(str(path))
    assert w.arrival == "trace"
    b = w.generate(duration_s=5.0)
    assert b.arrival_s.tolist() == [0.5, 2.0]
    assert b.prompt_tokens.tolist() == [10, 30] and b.prefix_keys == ["p", None]
    assert len(Workload.parse(f"trace:{path}").generate(num_requests=10)) == 3


def test_bad_trace_names_the_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 1}\n{"arrival_s": 1}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: .*arrival_s, prompt_tokens and output_tokens"):
        Workload.parse(str(path)).generate(num_requests=5)
    with pytest.raises(WorkloadError, match="cannot read trace"):
        Workload.parse(str(tmp_path / "none.jsonl")).generate(num_requests=5)
