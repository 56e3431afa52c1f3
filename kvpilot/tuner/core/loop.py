"""The live trial loop: apply -> rollout -> warm-up -> measure -> tell, with the safety rules.

Safety, always:
- one engine change at a time: the loop is sequential and `Applier.apply` returns only when the
  rollout is complete (or has failed);
- the burn rate is polled through warm-up and window; a fast burn (>= 14.4x on 5m, the SRE
  workbook's page threshold) prunes the trial at once and puts back the best engine known so far
  (or the starting one);
- signals unreachable or no traffic: pause; the engine is never changed blind, and the window
  starts again once signals are back (a window with a hole in it is not a measurement);
- the budget gate (spec.tuning.budgetGate): a trial starts only while enough error budget is left
  and inside the maintenance windows; while the gate is closed the best engine is in force and
  the loop reports Paused with the gate's reason (no trial is cut short by the gate);
- load drift: every measurement records the offered load; when load has moved more than 25%
  since the incumbent was measured, the incumbent is measured again before comparing;
- the loop breaking on anything but the config (the API server down past its retries, the study's
  storage failing): the best engine known is put back before the error goes up, so a trial's
  engine is never left in force by a loop that gave up.  The trial stays RUNNING in the study;
  the study's next opening fails it and queues its config again (`TunerStudy.recover`).

The loop talks to the world through three small protocols (Applier, SignalSource, Clock), so
the same code drives Kubernetes, a local process, or a fake clock in unit tests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from kvpilot.api.vocabulary import Reason, TuningPhase
from kvpilot.tuner.core.gate import Closed, Gate
from kvpilot.tuner.core.objective import Goal, Measurement, Outcome, better, infeasible, score
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import KIND_REMEASURE, Incumbent, TunerStudy

log = logging.getLogger(__name__)

FAST_BURN = 14.4  # SRE workbook: page when 2% of a 30-day budget goes in an hour
DRIFT = 0.25


class ApplyFailed(Exception):
    """The config could not be put in force: start-up failure, OOM, failed rollout.

    `reason` is a CamelCase reason (StartupFailed, OutOfMemory, RolloutFailed, ...).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class SignalsUnavailable(Exception):
    """No trustworthy signals right now (Prometheus unreachable, a query failing, no traffic)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


class Applier(Protocol):
    def current(self) -> EngineParams:
        """The engine in force now."""
        ...

    def apply(self, params: EngineParams, trial: int | None) -> None:
        """Put `params` in force; return once the rollout is complete.  Raises ApplyFailed."""
        ...


class SignalSource(Protocol):
    def burn_rate(self, window_s: float) -> float:
        """The SLO burn rate over the last `window_s`.  Raises SignalsUnavailable."""
        ...

    def measure(self, window_s: float) -> Measurement:
        """p99s, burn rate and offered load over the last `window_s`.  Raises SignalsUnavailable."""
        ...


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class Observer:
    """Hooks for status, Events and metrics.  No-ops by default."""

    def phase(self, phase: TuningPhase, reason: str, message: str) -> None: ...

    def trial_started(self, number: int, params: EngineParams, kind: str) -> None: ...

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None: ...

    def best_changed(self, incumbent: Incumbent) -> None: ...

    def gate_changed(self, closed: Closed | None) -> None:
        """The budget gate closed (with why), changed its reason, or opened again (None)."""


@dataclass(frozen=True)
class LiveSettings:
    warmup_s: float = 120.0
    window_s: float = 600.0
    poll_s: float = 15.0
    fast_burn: float = FAST_BURN
    fast_burn_window_s: float = 300.0
    drift: float = DRIFT
    pause_poll_s: float = 15.0
    max_trials: int = 30


class TunerStopped(Exception):
    """Asked to stop while waiting: the trial in progress stays RUNNING and is measured again on resume."""


class TrialPruned(Exception):
    def __init__(self, burn: float) -> None:
        super().__init__(f"fast burn {burn:.1f}x")
        self.burn = burn


class LiveTuner:
    def __init__(
        self,
        study: TunerStudy,
        applier: Applier,
        signals: SignalSource,
        settings: LiveSettings,
        clock: Clock | None = None,
        observer: Observer | None = None,
        gate: Gate | None = None,
    ) -> None:
        self.study, self.applier, self.signals, self.s = study, applier, signals, settings
        self.clock = clock or RealClock()
        self.obs = observer or Observer()
        self.gate = gate
        self.gate_pauses = 0  # polls spent with the gate closed
        self.goal: Goal = study.goal
        self.starting = study.starting_engine(applier.current())
        self.pauses = 0
        self.stop_requested = False
        self.put_back_failed: Exception | None = None  # why the put-back after a failure failed

    # -- helpers --------------------------------------------------------------------------
    def fallback(self) -> EngineParams:
        """The best engine known so far, or the starting one while none has beaten it."""
        inc = self.study.incumbent
        return inc.params if inc else self.starting

    def _restore(self) -> None:
        """Put back the best engine known so far (or the starting one)."""
        target = self.fallback()
        if self.applier.current() == target:
            return
        self.obs.phase(TuningPhase.APPLYING, "RestoringBest", f"putting back {target.label()}")
        try:
            self.applier.apply(target, None)
        except ApplyFailed as exc:  # the known-good engine failing is not ours to fix: say so loudly
            log.error("restoring %s failed: %s", target.label(), exc)

    def put_back(self) -> bool:
        """After the loop broke: put the best engine known (or the starting one) back in force.
        Never raises (it runs while another error goes up); True when that engine is in force."""
        target = self.fallback()
        try:
            if self.applier.current() == target:
                return True
            self.obs.phase(TuningPhase.APPLYING, "RestoringBest", f"the loop failed; putting back {target.label()}")
            self.applier.apply(target, None)
            return True
        except Exception as exc:
            self.put_back_failed = exc
            log.error("putting back %s failed: %s", target.label(), exc)
            return False

    def _wait_for_signals(self) -> None:
        """Block until signals are readable and traffic flows.  The engine is not touched meanwhile."""
        while True:
            if self.stop_requested:
                raise TunerStopped()
            try:
                self.signals.burn_rate(self.s.fast_burn_window_s)
                return
            except SignalsUnavailable as exc:
                self.pauses += 1
                self.obs.phase(TuningPhase.PAUSED, exc.reason, f"{exc.message}; the engine is left as it is")
                log.warning("paused: %s", exc)
                self.clock.sleep(self.s.pause_poll_s)

    def _wait_for_gate(self) -> None:
        """Before a trial: while the budget gate is closed, keep the best engine in force and wait.
        One gate_changed per change of reason (an Event, not one per poll); Paused in status."""
        if self.gate is None:
            return
        shown: Closed | None = None
        while True:
            if self.stop_requested:
                raise TunerStopped()
            closed = self.gate.closed()
            if closed is None:
                if shown is not None:
                    self.obs.gate_changed(None)
                return
            if shown is None:
                self._restore()  # a trial's engine never stands through a pause
            if shown is None or shown.reason != closed.reason:
                self.obs.gate_changed(closed)
            shown = closed
            self.gate_pauses += 1
            self.obs.phase(TuningPhase.PAUSED, closed.reason, f"{closed.message}; the best engine is in force")
            self.clock.sleep(self.s.pause_poll_s)

    def _cool_down(self) -> None:
        """After a prune, wait until the fast-burn window no longer holds the bad config's errors;
        otherwise the next trial would be judged (and pruned) on its predecessor's burn."""
        self.obs.phase(TuningPhase.MEASURING, "FastBurn", "waiting for the burn rate to fall after the rollback")
        deadline = self.clock.monotonic() + 2 * self.s.fast_burn_window_s
        while self.clock.monotonic() < deadline:
            self.clock.sleep(self.s.poll_s)
            try:
                if self.signals.burn_rate(self.s.fast_burn_window_s) < self.s.fast_burn:
                    return
            except SignalsUnavailable:
                self._wait_for_signals()

    def _watch(self, seconds: float) -> bool:
        """Poll the burn rate for `seconds`.  True if the span was clean, False if signals dropped
        out (the caller starts the span again).  Raises TrialPruned on a fast burn."""
        end = self.clock.monotonic() + seconds
        while True:
            left = end - self.clock.monotonic()
            if left <= 1e-9:
                return True
            self.clock.sleep(min(self.s.poll_s, left))
            try:
                burn = self.signals.burn_rate(self.s.fast_burn_window_s)
            except SignalsUnavailable:
                self._wait_for_signals()
                self.obs.phase(TuningPhase.MEASURING, "SignalsBack", "signals are back; the window starts again")
                return False
            if burn >= self.s.fast_burn:
                raise TrialPruned(burn)

    def _measure(self, warmup: bool = True) -> Measurement:
        """Warm-up, then a clean window, then the measurement.  Raises TrialPruned."""
        if warmup:
            while not self._watch(self.s.warmup_s):
                pass
        self.obs.phase(TuningPhase.MEASURING, "WindowStarted", f"measuring over {self.s.window_s:g}s")
        while True:
            if not self._watch(self.s.window_s):
                continue
            try:
                return self.signals.measure(self.s.window_s)
            except SignalsUnavailable:
                self._wait_for_signals()

    # -- one trial ------------------------------------------------------------------------
    def run_trial(self, number: int, params: EngineParams, kind: str = "trial") -> str:
        """Apply, measure and tell one trial.  Returns its final state (complete|pruned|infeasible)."""
        self._wait_for_signals()  # never change the engine blind
        self.obs.trial_started(number, params, kind)
        self.obs.phase(TuningPhase.APPLYING, "TrialStarted", f"trial {number}: {params.label()}")
        try:
            self.applier.apply(params, number)
        except ApplyFailed as exc:
            outcome = infeasible(self.goal, exc.reason, exc.message)
            self.study.tell(number, outcome)
            self.obs.trial_finished(number, params, "infeasible", outcome)
            self._restore()
            return "infeasible"
        self.obs.phase(TuningPhase.WARMING_UP, Reason.ROLLOUT_COMPLETE, f"trial {number}: {self.s.warmup_s:g}s warm-up")
        try:
            m = self._measure()
        except TrialPruned as exc:
            self.study.prune(
                number, "FastBurn",
                f"burn {exc.burn:.1f}x >= {self.s.fast_burn:g}x on {self.s.fast_burn_window_s:g}s",
                constraints=(exc.burn - 1.0,),
            )
            self.obs.trial_finished(number, params, "pruned", None)
            self._restore()
            self._cool_down()
            return "pruned"
        outcome = score(self.goal, m, self.study.slo)
        if kind == KIND_REMEASURE:
            self.study.tell(number, outcome)
            self.obs.trial_finished(number, params, "complete", outcome)
            return "complete"
        self._compare(number, params, outcome)
        self.study.tell(number, outcome)
        self.obs.trial_finished(number, params, "complete", outcome)
        return "complete"

    def _compare(self, number: int, params: EngineParams, outcome: Outcome) -> None:
        """Make the trial the incumbent if it beats it under comparable load."""
        if not outcome.feasible or outcome.measurement is None:
            return
        load = outcome.measurement.request_rate
        inc = self.study.incumbent
        if inc is not None and inc.params != params and _drifted(inc.request_rate, load, self.s.drift):
            inc = self._remeasure(inc)
        if inc is None or better(self.goal, outcome.value, inc.value) or inc.params == params:
            new = Incumbent(params, outcome.value, load, number)
            self.study.incumbent = new
            self.obs.best_changed(new)

    def _remeasure(self, inc: Incumbent) -> Incumbent | None:
        """Measure the incumbent again at today's load; returns the refreshed incumbent, or None
        when it no longer holds up (then the trial being judged stands on its own)."""
        log.info("load drifted more than %.0f%% since trial %d was measured; measuring it again",
                 self.s.drift * 100, inc.trial)
        self.obs.phase(TuningPhase.MEASURING, "LoadDrift", f"re-measuring the incumbent (trial {inc.trial})")
        self._wait_for_signals()
        try:
            self.applier.apply(inc.params, None)
            m = self._measure()
        except (ApplyFailed, TrialPruned) as exc:
            log.warning("the incumbent (trial %d) failed its re-measurement: %s", inc.trial, exc)
            self.study.incumbent = None
            self._restore()
            if isinstance(exc, TrialPruned):
                self._cool_down()
            return None
        outcome = score(self.goal, m, self.study.slo)
        self.study.record(inc.params, outcome, kind=KIND_REMEASURE, source="remeasure",
                          attrs={"remeasureOf": inc.trial})
        if not outcome.feasible:
            self.study.incumbent = None
            return None
        fresh = Incumbent(inc.params, outcome.value, m.request_rate, inc.trial)
        self.study.incumbent = fresh
        return fresh

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> EngineParams:
        """Run trials until the budget is spent; leave the best engine in force and return it."""
        try:
            while not self.stop_requested and self.study.finished_count() < self.s.max_trials:
                self._wait_for_gate()
                number, params = self.study.ask()
                kind = self.study.study.get_trials(deepcopy=False)[number].user_attrs.get("kind", "trial")
                self.run_trial(number, params, kind=kind)
            best = self.fallback()
            self._wait_for_signals()
            if self.applier.current() != best:
                self.obs.phase(TuningPhase.APPLYING, "ApplyingBest", f"putting the best engine in force: {best.label()}")
                self.applier.apply(best, None)
        except TunerStopped:
            self.obs.phase(TuningPhase.IDLE, "Stopped", "stopped; a restarted tuner resumes the study")
            return self.applier.current()
        except Exception:
            self.put_back()
            raise
        self.obs.phase(TuningPhase.DONE, "BudgetSpent", f"best: {best.label()}")
        return best


def _drifted(old: float, new: float, limit: float) -> bool:
    if old <= 0:
        return new > 0
    return abs(new - old) / old > limit
