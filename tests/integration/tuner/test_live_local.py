"""The live loop end to end: the local applier restarting real `kvpilot twin serve` processes
(blue/green on two ports behind the applier's forwarder), the test's load generator sending
real streaming requests, and a real Prometheus scraping both engine ports every second.

One run covers the three behaviours (one tuner, one Prometheus, to keep the suite short):
- at least 4 trials complete and the best config is the one running at the end;
- a planted bad config (token budget 1, one sequence: the queue grows without bound and every
  TTFT misses the SLO) is pruned at the first burn-rate poll that sees the fast burn, and the
  best engine is put back;
- Prometheus is killed mid-trial: the tuner pauses without touching the engine, and carries on
  once Prometheus is back (same port, same TSDB);
- and the warm start's workload estimate reads the load the test really sent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from optuna.trial import TrialState

from harness.live_tuning import BackgroundLoad, Events, RecordingSignals, TunerThread, live_world
from harness.prometheus import PrometheusServer, require_prometheus
from kvpilot.tuner.adapters.local import LocalApplier, free_port
from kvpilot.tuner.adapters.prometheus import PrometheusSignals, estimate_workload
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner
from kvpilot.tuner.core.objective import SLO, Goal
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import TunerStudy

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
# L40S: a step of this small model takes ~2.7 ms there, the regime the thresholds below were set in
# (the twin's GPU-calibrated H100 takes 1.2 ms, too quick for the one-token-a-step engine to burn).
TWIN = [sys.executable, "-m", "kvpilot.cli", "twin", "serve", "--model", "Qwen2.5-0.5B", "--gpu", "L40S",
        "--max-model-len", "4096", "--shutdown-timeout", "5"]
SLO_ = SLO(ttft_seconds=0.25, itl_seconds=0.1)  # both bucket edges of vLLM's histograms
START = EngineParams(512, 0.80, 16)
GOOD = [EngineParams(256, 0.70, 8), EngineParams(1024, 0.85, 32), EngineParams(2048, 0.90, 64)]
BAD = EngineParams(1, 0.80, 1)
SETTINGS = LiveSettings(warmup_s=2.0, window_s=4.0, poll_s=1.0, fast_burn_window_s=4.0, pause_poll_s=1.0,
                        max_trials=6)
RATE = 12.0


class RestartablePrometheus(PrometheusServer):
    """Kill the server and bring it back on the same port with the same TSDB."""

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def revive(self) -> None:
        assert self._tmp is not None and self.port is not None
        root = Path(self._tmp.name)
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed by stop()
        self._log = log
        self.proc = subprocess.Popen(
            [require_prometheus(), f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, cwd=root,
        )
        self._wait_ready()


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[LocalApplier, RestartablePrometheus, BackgroundLoad]]:
    require_prometheus()
    slots = (free_port(), free_port())
    prom = RestartablePrometheus(targets=[f"127.0.0.1:{p}" for p in slots], job="twin")
    applier = LocalApplier(TWIN, port=free_port(), start=START, slots=slots, startup_timeout_s=60,
                           shutdown_timeout_s=10, log_dir=str(tmp_path),
                           env={"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    load = BackgroundLoad(f"http://127.0.0.1:{applier.port}", rate=RATE, seed=5, max_tokens=16, prompt_words=32,
                          request_timeout_s=30.0, drain_s=30.0)
    with live_world(prom, applier, load) as world:
        yield world


def test_live_tuning_with_a_bad_config_and_a_prometheus_outage(
    world: tuple[LocalApplier, RestartablePrometheus, BackgroundLoad],
) -> None:
    applier, prom, _load = world
    space = SearchSpace(max_num_batched_tokens=(1, 4096), gpu_memory_utilization=(0.5, 0.9), max_num_seqs=(1, 64))
    study = TunerStudy(storage=None, name="live", goal=Goal.LATENCY, space=space, slo=SLO_, seed=1,
                       n_trials=SETTINGS.max_trials)
    study.enqueue(START, "current")
    study.enqueue(GOOD[0], "test")
    study.enqueue(BAD, "planted")
    for p in GOOD[1:]:
        study.enqueue(p, "test")
    signals = RecordingSignals(PrometheusSignals(prom.url, selector='job="twin"', slo=SLO_, timeout_s=1.0))
    prom.wait_for('sum(rate(vllm:time_to_first_token_seconds_count{job="twin"}[4s])) > 0', timeout=60)
    events = Events()
    tuner = LiveTuner(study, applier, signals, SETTINGS, observer=events)
    runner = TunerThread(tuner).start()
    thread, result = runner.thread, runner.result

    # --- Prometheus dies while trial 1 is being measured --------------------------------------
    assert events.wait(lambda log: any(k == "start" and a == "1" for _, k, a, _ in log), timeout=120), events.log

    def measuring_trial_1(log: list[tuple[float, str, str, str]]) -> bool:
        i = next((i for i, (_, k, a, _) in enumerate(log) if k == "start" and a == "1"), None)
        return i is not None and any(k == "phase" and a == "Measuring" for _, k, a, _ in log[i:])

    assert events.wait(measuring_trial_1, timeout=60)
    applies_before = len(applier.history)
    prom.kill()
    t_kill = time.monotonic()
    assert events.wait(lambda log: any(k == "phase" and a == "Paused" and t >= t_kill for t, k, a, _ in log),
                       timeout=30), events.log
    # Stay dark for a few of the tuner's polls: it must keep waiting, engine untouched.
    pauses = tuner.pauses
    deadline = time.monotonic() + 30
    while tuner.pauses < pauses + 3 and time.monotonic() < deadline:
        with events.cond:
            events.cond.wait(timeout=0.2)
    assert tuner.pauses >= pauses + 3
    assert len(applier.history) == applies_before, "the engine was changed while Prometheus was down"
    assert thread.is_alive()
    prom.revive()

    thread.join(timeout=300)
    assert not thread.is_alive(), f"the tuner did not finish: {events.log[-5:]}"
    assert "error" not in result, result.get("error")

    trials = study.study.trials
    states = {t.number: t.state for t in trials}
    complete = [n for n, s in states.items() if s is TrialState.COMPLETE]
    assert len(complete) >= 4, states
    # The outage trial completed after the pause (its window started again).
    assert states[1] is TrialState.COMPLETE

    # --- the planted bad config: pruned at the first poll that saw the fast burn, best put back --
    bad = [t for t in trials if study.engine_of(t) == BAD]
    assert len(bad) == 1 and bad[0].state is TrialState.PRUNED, [(t.number, t.state) for t in bad]
    assert bad[0].user_attrs["reason"] == "FastBurn"
    in_force = next(t for t, p, n in applier.history if p == BAD)
    restored_at, restored, _ = applier.history[[p for _, p, _ in applier.history].index(BAD) + 1]
    first_fast = next(t for t, v in signals.burns if t >= in_force and v >= SETTINGS.fast_burn)
    # The restore began right after that reading (its start-up takes the rest): within one poll.
    restore_started = max(t for t, k, a, b in events.log
                          if k == "phase" and (a, b) == ("Applying", "RestoringBest") and t <= restored_at)
    assert restore_started - first_fast <= SETTINGS.poll_s
    assert all(v < SETTINGS.fast_burn for t, v in signals.burns if in_force <= t < first_fast)
    assert restored != BAD

    # --- the best config is in force at the end -----------------------------------------------
    best = result["best"]
    inc = study.incumbent
    assert inc is not None and best == inc.params
    assert applier.current() == best
    assert applier.history[-1][1] == best
    assert applier._engine is not None and applier._engine.proc.poll() is None
    cmdline = Path(f"/proc/{applier._engine.proc.pid}/cmdline").read_bytes().split(b"\0")
    flags = [a.decode() for a in cmdline if a]
    assert flags[-6:] == best.as_flags()

    # --- the warm start's workload estimate, from the same Prometheus ---------------------------
    est = estimate_workload(signals.inner, window_s=20.0)
    assert RATE / 2 <= est.request_rate <= RATE * 1.5
    assert 16 <= est.prompt_median <= 80  # 32 words, about a token each
    assert 8 <= est.output_median <= 20  # max_tokens 16 with ignore_eos, read through histogram buckets
