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
        ("uniform:rate=1", "start with a preset .* or an arrival process"),
        ("poisson:rate=1,requests=5", "--num-requests N"),
        ("chat:requests=160", "steady state"),
        ("chat:preset=rag", "write the preset first"),
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


def test_a_rate_is_needed_to_generate_but_not_to_parse() -> None:
    w = Workload.parse("poisson:prompt=10")
    with pytest.raises(WorkloadError, match="rate=R"):
        w.generate(num_requests=3)
    assert len(w.with_rate(2.0).generate(num_requests=3)) == 3


@pytest.mark.parametrize(("spec", "arrival", "prompt", "output"), [
    ("chat", "poisson", "lognormal/512/0.8/16..6144", "lognormal/160/0.7/8..1024"),
    ("bursty", "gamma", "lognormal/512/0.8/16..6144", "lognormal/160/0.7/8..1024"),
    ("rag:rate=3", "poisson", "lognormal/2048/0.5/256..7168", "lognormal/96/0.5/8..512"),
    # The earlier `kvpilot tune` form: keys alone, colon-separated lengths, cv switching to gamma.
    ("prompt=lognormal:1500:0.6,output=uniform:10:20,cv=1.5", "gamma", "lognormal/1500/0.6", "10..20"),
    ("prompt=256,output=32", "poisson", "256", "32"),
    ("bursty:cv=1", "poisson", "lognormal/512/0.8/16..6144", "lognormal/160/0.7/8..1024"),
])
def test_one_language_for_presets_and_specs(spec: str, arrival: str, prompt: str, output: str) -> None:
    w = Workload.parse(spec)
    assert (w.arrival, str(w.prompt), str(w.output)) == (arrival, prompt, output)
    # What a spec prints reads back as the same distribution.
    assert LengthDist.parse(str(w.prompt), "prompt") == w.prompt


def test_arrivals_scale_exactly_with_the_rate() -> None:
    w = Workload.parse("bursty")
    slow = w.with_rate(1.0).generate(num_requests=200, seed=3)
    fast = w.with_rate(4.0).generate(num_requests=200, seed=3)
    assert np.allclose(fast.arrival_s, slow.arrival_s / 4.0)
    assert np.allclose(slow.at_rate(4.0).arrival_s, fast.arrival_s)
    assert np.array_equal(fast.prompt_tokens, slow.prompt_tokens)


def test_bounded_lognormal_stays_inside_its_bounds() -> None:
    x = LengthDist.parse("lognormal/800/1.5/16..2000", "prompt").sample(np.random.default_rng(0), 5000)
    assert x.min() >= 16 and x.max() <= 2000 and (x == 2000).any()


def test_batches_join_with_the_later_arrivals_after_the_earlier() -> None:
    w = Workload.parse("poisson:rate=2,prompt=10,output=5,prefix=4")
    a, b = w.generate(num_requests=5, seed=1), w.generate(num_requests=3, seed=2)
    joined = a.then(b)
    assert len(joined) == 8 and np.all(np.diff(joined.arrival_s) >= 0)
    assert np.allclose(joined.arrival_s[5:], b.arrival_s + a.arrival_s[-1])
    assert joined.prefix_keys == [*a.prefix_keys, *b.prefix_keys]
    assert joined.prefix_tokens is not None and len(joined.prefix_tokens) == 8
