# Over 500 lines: the live tuner's trial lifecycle (apply, warm up, measure, prune, promote) is one state machine.
"""The live trial loop: apply -> rollout -> warm-up -> measure -> tell, with the safety rules.

`LiveTuner` runs it (rolling or canary trials, spec.tuning.trialStrategy); it talks to the world
through the `Applier`, `SignalSource` and `Clock` protocols.  The safety rules and the two strategies:
docs/architecture.md, "The live trial loop".
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kvpilot.api.vocabulary import Reason, Track, TrialStrategy, TuningPhase
from kvpilot.tuner.core.fleetsize import FleetSize, Replicas, moved
from kvpilot.tuner.core.gate import Closed, Gate
from kvpilot.tuner.core.objective import Goal, Measurement, Outcome, better, infeasible, latency_score, score
from kvpilot.tuner.core.sequential import PairedSPRT, SequentialSettings, Verdict
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import KIND_REMEASURE, Incumbent, TunerStudy
from kvpilot.tuner.core.tracks import service_load

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


class CanaryApplier(Applier, Protocol):
    """An Applier that can also run a trial engine beside the stable track (`apply` then promotes:
    a rolling update of the stable track)."""

    def start_canary(self, params: EngineParams, trial: int) -> None:
        """Start the canary engine with `params`; return once it is serving its share of requests.
        Raises ApplyFailed (with vLLM's reason) when it cannot start; nothing of it is left serving."""
        ...

    def stop_canary(self) -> None:
        """Take the canary out of service (its in-flight requests finish) and remove it.  Idempotent:
        no canary is no error."""
        ...


class TrackSignals(SignalSource, Protocol):
    """A SignalSource that can read each track apart (the `kvpilot_dev_track` series label)."""

    def burn_rate(self, window_s: float, track: Track | None = None) -> float:
        """The burn rate over the last `window_s` of one track (None: all of the service)."""
        ...

    def measure_tracks(self, window_s: float) -> tuple[Measurement, Measurement]:
        """(stable, canary), both over the same last `window_s`.  Raises SignalsUnavailable, also when
        either track served no requests in it."""
        ...


class TrialEvent(StrEnum):
    """What happened to a trial, counted by strategy (kvpilot_tuning_*_total{strategy})."""

    STARTED = "started"
    PROMOTED = "promoted"  # its engine replaced the best known: rolled onto the stable track (canary), or
    # made the incumbent (rolling; it is in force already)
    PRUNED = "pruned"  # a fast burn cut it short
    ROLLED_BACK = "rolled_back"  # its engine taken out of service after a failure (prune, failed start)


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

    def trial_event(self, number: int, strategy: TrialStrategy, event: TrialEvent) -> None:
        """A trial started, was promoted, pruned or rolled back, under `strategy`."""


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
    strategy: TrialStrategy = TrialStrategy.ROLLING
    sequential: SequentialSettings = field(default_factory=SequentialSettings)
    canary_guard: bool = True  # an undecided canary is promoted only while the test still allows "better"
    # Rolling trials: windows more that a trial is measured for when its first window would make it
    # the best engine (0: told on one window).  One window's p99 is noisy -- on real vLLM, 10 s
    # windows of one config read up to 2.4x apart -- and a lucky one would otherwise stand as the
    # value every later trial must beat; the mean of the windows is told.
    confirm_windows: int = 1


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
        fleet: FleetSize | None = None,
    ) -> None:
        self.study, self.applier, self.signals, self.s = study, applier, signals, settings
        self.fleet = fleet  # where the replica count is read; None: a fleet whose size never changes
        self.scale_discards = 0  # windows left out because the replica count moved in them
        self.clock = clock or RealClock()
        self.obs = observer or Observer()
        self.gate = gate
        self.canary: CanaryApplier | None = None
        self.tracks: TrackSignals | None = None
        if settings.strategy is TrialStrategy.CANARY:
            if not hasattr(applier, "start_canary") or not hasattr(applier, "stop_canary"):
                raise ValueError("trialStrategy canary: this applier cannot run a canary (use rolling)")
            if not hasattr(signals, "measure_tracks"):
                raise ValueError("trialStrategy canary: these signals cannot read tracks apart (use rolling)")
            self.canary, self.tracks = applier, signals  # type: ignore[assignment]
        self.verdicts: list[tuple[int, Verdict]] = []  # canary trials' sequential verdicts, in order
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

    def _wait_for_signals(self) -> float:
        """Block until signals are readable and traffic flows; returns the burn rate that said so.
        The engine is not touched meanwhile."""
        while True:
            if self.stop_requested:
                raise TunerStopped()
            try:
                return self.signals.burn_rate(self.s.fast_burn_window_s)
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

    def _replicas(self) -> Replicas | None:
        return self.fleet.replicas() if self.fleet is not None else None

    def _scaled(self, first: Replicas | None) -> tuple[Replicas | None, bool]:
        """Read the replica count again: (the window's first reading, True when it moved since).  A
        window that moved is left out (`fleetsize`): said in status, counted in `scale_discards`."""
        now = self._replicas()
        why = moved(first, now)
        if why is None:
            return first if first is not None else now, False
        self.scale_discards += 1
        self.obs.phase(TuningPhase.MEASURING, "ScaleEvent", f"{why} during the window; it is left out and "
                       "measured again")
        return now, True

    def _watch(self, seconds: float) -> bool:
        """Poll the burn rate for `seconds`.  True if the span was clean, False if signals dropped
        out or the replica count moved (the caller starts the span again).  Raises TrialPruned on a
        fast burn."""
        end = self.clock.monotonic() + seconds
        first = self._replicas()
        while True:
            left = end - self.clock.monotonic()
            if left <= 1e-9:
                return True
            self.clock.sleep(min(self.s.poll_s, left))
            try:
                burn = self.signals.burn_rate(self.s.fast_burn_window_s)
            except SignalsUnavailable:
                # A trial engine so bad that nothing completes reads as no traffic; the first reading
                # after it is judged like any other poll, or the prune waits one more poll.
                burn = self._wait_for_signals()
                if burn >= self.s.fast_burn:
                    raise TrialPruned(burn) from None
                self.obs.phase(TuningPhase.MEASURING, "SignalsBack", "signals are back; the window starts again")
                return False
            if burn >= self.s.fast_burn:
                raise TrialPruned(burn)
            first, scaled = self._scaled(first)
            if scaled:
                return False

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
        if self.canary is not None and kind != KIND_REMEASURE:
            self._wait_for_signals()
            if self.applier.current() != self.fallback():
                self._restore()  # the stable track carries the best engine known
            if params != self.applier.current():
                return self._run_canary_trial(number, params)
        return self._run_rolling_trial(number, params, kind)

    def _event(self, number: int, event: TrialEvent) -> None:
        self.obs.trial_event(number, self.s.strategy, event)

    def _run_rolling_trial(self, number: int, params: EngineParams, kind: str) -> str:
        self._wait_for_signals()  # never change the engine blind
        self.obs.trial_started(number, params, kind)
        if kind != KIND_REMEASURE:
            self._event(number, TrialEvent.STARTED)
        self.obs.phase(TuningPhase.APPLYING, "TrialStarted", f"trial {number}: {params.label()}")
        try:
            self.applier.apply(params, number)
        except ApplyFailed as exc:
            outcome = infeasible(self.goal, exc.reason, exc.message)
            self.study.tell(number, outcome)
            self.obs.trial_finished(number, params, "infeasible", outcome)
            self._restore()
            self._event(number, TrialEvent.ROLLED_BACK)
            return "infeasible"
        self.obs.phase(TuningPhase.WARMING_UP, Reason.ROLLOUT_COMPLETE, f"trial {number}: {self.s.warmup_s:g}s warm-up")
        try:
            m = self._measure()
            windows = 1
            if kind != KIND_REMEASURE:
                m, windows = self._confirm(number, params, m)
        except TrialPruned as exc:
            self.study.prune(
                number, "FastBurn",
                f"burn {exc.burn:.1f}x >= {self.s.fast_burn:g}x on {self.s.fast_burn_window_s:g}s",
                constraints=(exc.burn - 1.0,),
            )
            self.obs.trial_finished(number, params, "pruned", None)
            self._event(number, TrialEvent.PRUNED)
            self._restore()
            self._event(number, TrialEvent.ROLLED_BACK)
            self._cool_down()
            return "pruned"
        outcome = score(self.goal, m, self.study.slo)
        if kind == KIND_REMEASURE:
            self.study.tell(number, outcome)
            self.obs.trial_finished(number, params, "complete", outcome)
            return "complete"
        self._compare(number, params, outcome, windows)
        self.study.tell(number, outcome)
        self.obs.trial_finished(number, params, "complete", outcome)
        return "complete"

    def _confirm(self, number: int, params: EngineParams, m: Measurement) -> tuple[Measurement, int]:
        """A first window that would make this trial the best engine is followed by
        `confirm_windows` more; returns the mean of them all (else `m`) and how many windows it holds.
        Raises TrialPruned."""
        first = score(self.goal, m, self.study.slo)
        inc = self.study.incumbent
        leads = first.feasible and (inc is None or (inc.params != params and better(self.goal, first.value, inc.value)))
        # Canary trials need no confirming: each paired window measures the incumbent again
        # (`_refresh_incumbent`), so a lucky reading of it does not last.
        if self.s.confirm_windows < 1 or not leads or self.canary is not None:
            return m, 1
        self.obs.phase(TuningPhase.MEASURING, "ConfirmingBest",
                       f"trial {number} would be the best ({first.value:.3f}); measuring "
                       f"{self.s.confirm_windows} more window(s) of {self.s.window_s:g}s")
        readings = [m]
        for _ in range(self.s.confirm_windows):
            readings.append(self._measure(warmup=False))
        return mean_measurement(readings), len(readings)

    def _compare(self, number: int, params: EngineParams, outcome: Outcome, windows: int = 1) -> None:
        """Make the trial the incumbent if it beats it under comparable load."""
        if not outcome.feasible or outcome.measurement is None:
            return
        load = outcome.measurement.request_rate
        before = self.fallback()
        inc = self.study.incumbent
        drifted = inc is not None and _drifted(inc.request_rate, load, self.s.drift)
        if inc is not None and inc.params == params and not drifted:
            # The incumbent's own config drawn again: its windows join the incumbent's mean rather
            # than replace it, so one lucky (or unlucky) window does not become the bar on its own.
            n = inc.windows + windows
            new = Incumbent(params, (inc.value * inc.windows + outcome.value * windows) / n,
                            (inc.request_rate * inc.windows + load * windows) / n, number, n)
            self.study.incumbent = new
            self.obs.best_changed(new)
            return
        if inc is not None and inc.params != params and drifted:
            inc = self._remeasure(inc)
        if inc is None or better(self.goal, outcome.value, inc.value) or inc.params == params:
            new = Incumbent(params, outcome.value, load, number, windows)
            self.study.incumbent = new
            self.obs.best_changed(new)
            if params != before:  # a new engine is the best (not the one in force measured again)
                self._event(number, TrialEvent.PROMOTED)

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

    # -- canary trials --------------------------------------------------------------------
    def _canary_burn_window(self, serving_since: float) -> float:
        """The canary's burn is read over its own lifetime, capped at the fast-burn window: the canary
        track's series also hold the last canary's requests, whose errors are not this one's."""
        lived = self.clock.monotonic() - serving_since
        return min(self.s.fast_burn_window_s, max(self.s.poll_s, lived))

    def _canary_poll(self, serving_since: float, interval_s: float) -> tuple[Measurement, Measurement]:
        """One poll: the canary's burn (TrialPruned on a fast burn), then both tracks over the last
        `interval_s`.  Raises SignalsUnavailable, TunerStopped."""
        if self.stop_requested:
            raise TunerStopped()
        assert self.tracks is not None
        burn = self.tracks.burn_rate(self._canary_burn_window(serving_since), track=Track.CANARY)
        if burn >= self.s.fast_burn:
            raise TrialPruned(burn)
        return self.tracks.measure_tracks(interval_s)

    def _canary_window(self, serving_since: float) -> tuple[PairedSPRT, Measurement, Measurement]:
        """Warm-up, then the paired window with its sequential test.  Returns (the test, stable, canary)
        measured over the window (or the part of it run before the test decided)."""
        assert self.tracks is not None
        end = self.clock.monotonic() + self.s.warmup_s
        while (left := end - self.clock.monotonic()) > 1e-9:  # warm-up: only the canary's burn counts
            self.clock.sleep(min(self.s.poll_s, left))
            try:
                if self.stop_requested:
                    raise TunerStopped()
                burn = self.tracks.burn_rate(self._canary_burn_window(serving_since), track=Track.CANARY)
            except SignalsUnavailable:
                self._wait_for_signals()
                continue
            if burn >= self.s.fast_burn:
                raise TrialPruned(burn)
        sprt = PairedSPRT(self.s.sequential)
        while True:
            self.obs.phase(TuningPhase.MEASURING, "WindowStarted",
                           f"canary and stable measured side by side over up to {self.s.window_s:g}s")
            start = self.clock.monotonic()
            sprt.reset()
            first, scaled = self._replicas(), False
            try:
                while (left := start + self.s.window_s - self.clock.monotonic()) > 1e-9:
                    step = min(self.s.poll_s, left)
                    self.clock.sleep(step)
                    stable_i, canary_i = self._canary_poll(serving_since, step)
                    first, scaled = self._scaled(first)
                    if scaled:
                        break  # both tracks' shares of the load moved: the paired test starts again
                    cs, ss = latency_score(canary_i, self.study.slo), latency_score(stable_i, self.study.slo)
                    if _usable(cs) and _usable(ss) and sprt.add(cs, ss) is not Verdict.UNDECIDED:
                        break
                if scaled:
                    continue
                # Each track's rate in the service's terms: the canary's share moves with the fleet.
                stable_m, canary_m = service_load(*self.tracks.measure_tracks(self.clock.monotonic() - start))
            except SignalsUnavailable as exc:
                # A window with a hole in it is not a measurement.  The service's own signals may be
                # fine while one track's are not (a canary that gets no connections: clients that keep
                # theirs open stay on the stable track): say so, the canary keeps its share meanwhile.
                self.pauses += 1
                self.obs.phase(TuningPhase.PAUSED, exc.reason,
                               f"canary trial: {exc.message}; the window starts again when both tracks read")
                self.clock.sleep(self.s.pause_poll_s)
                self._wait_for_signals()
                continue
            return sprt, stable_m, canary_m

    def _stop_canary(self) -> bool:
        """Stop the canary; never raises (it runs on the way out of errors).  True when it is gone."""
        assert self.canary is not None
        try:
            self.canary.stop_canary()
            return True
        except Exception as exc:
            log.error("stopping the canary failed: %s", exc)
            return False

    def _run_canary_trial(self, number: int, params: EngineParams) -> str:
        assert self.canary is not None
        self.obs.trial_started(number, params, "trial")
        self._event(number, TrialEvent.STARTED)
        self.obs.phase(TuningPhase.APPLYING, "CanaryStarting", f"trial {number}: canary {params.label()}")
        try:
            self.canary.start_canary(params, number)
        except ApplyFailed as exc:
            self.canary.stop_canary()
            outcome = infeasible(self.goal, exc.reason, exc.message)
            self.study.tell(number, outcome)
            self.obs.trial_finished(number, params, "infeasible", outcome)
            self._event(number, TrialEvent.ROLLED_BACK)
            return "infeasible"
        serving_since = self.clock.monotonic()
        self.obs.phase(TuningPhase.WARMING_UP, "CanaryServing", f"trial {number}: {self.s.warmup_s:g}s warm-up")
        try:
            sprt, stable_m, canary_m = self._canary_window(serving_since)
        except TrialPruned as exc:
            self.canary.stop_canary()  # at once: the stable track is untouched, nothing to put back
            self.study.prune(
                number, "FastBurn",
                f"canary burn {exc.burn:.1f}x >= {self.s.fast_burn:g}x",
                constraints=(exc.burn - 1.0,),
            )
            self.obs.trial_finished(number, params, "pruned", None)
            self._event(number, TrialEvent.PRUNED)
            self._event(number, TrialEvent.ROLLED_BACK)
            self.verdicts.append((number, Verdict.WORSE))
            return "pruned"
        verdict = sprt.verdict
        self.verdicts.append((number, verdict))
        outcome = score(self.goal, canary_m, self.study.slo)
        stable = score(self.goal, stable_m, self.study.slo)
        self._refresh_incumbent(stable, stable_m)
        if verdict is Verdict.BETTER:
            promote = outcome.feasible
        elif verdict is Verdict.WORSE:
            promote = False
        else:
            # Undecided: the whole window decides, as the objective ranks it -- unless the test has
            # already accepted that the canary is not better (its "better" side closed): a lucky
            # window's edge on a quarter of the requests is not a reason to roll the fleet.
            promote = (outcome.feasible and (not self.s.canary_guard or sprt.better_open)
                       and (not stable.feasible or better(self.goal, outcome.value, stable.value)))
        if promote:
            self.obs.phase(TuningPhase.APPLYING, "Promoting", f"trial {number} beat the stable track: "
                           f"{outcome.value:.3f} against {stable.value:.3f}; rolling it out")
            try:
                self.applier.apply(params, number)
            except ApplyFailed as exc:  # ran as a canary, failed as a rollout: not promoted
                log.error("promoting trial %d failed: %s", number, exc)
                promote = False
                self._restore()
        self.canary.stop_canary()
        self.study.tell(number, outcome)
        if promote:
            new = Incumbent(params, outcome.value, canary_m.request_rate, number)
            self.study.incumbent = new
            self.obs.best_changed(new)
            self._event(number, TrialEvent.PROMOTED)
        self.obs.trial_finished(number, params, "complete", outcome)
        return "complete"

    def _refresh_incumbent(self, stable: Outcome, m: Measurement) -> None:
        """The stable track is the incumbent measured in the same window: its value now (this is what
        replaces the drift re-measurement for canary trials)."""
        inc = self.study.incumbent
        if inc is None or inc.params != self.applier.current():
            return
        if not stable.feasible:
            self.study.incumbent = None
            return
        self.study.incumbent = Incumbent(inc.params, stable.value, m.request_rate, inc.trial)

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> EngineParams:
        """Run trials until the budget is spent; leave the best engine in force and return it."""
        try:
            if self.canary is not None:
                self.canary.stop_canary()  # a canary left by a tuner that died mid-trial
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
            if self.canary is not None:
                self._stop_canary()
            self.obs.phase(TuningPhase.IDLE, "Stopped", "stopped; a restarted tuner resumes the study")
            return self.applier.current()
        except Exception:
            if self.canary is not None:
                self._stop_canary()
            self.put_back()
            raise
        self.obs.phase(TuningPhase.DONE, "BudgetSpent", f"best: {best.label()}")
        return best


def mean_measurement(ms: list[Measurement]) -> Measurement:
    """Consecutive windows of one engine as one reading: each p99, rate and burn averaged over the
    windows (a field any window lacks stays unknown), the samples summed."""
    def mean(xs: list[float | None]) -> float | None:
        return None if any(x is None for x in xs) else math.fsum(x for x in xs if x is not None) / len(xs)

    counts = [m.sample_count for m in ms]
    return Measurement(
        ttft_p99=math.fsum(m.ttft_p99 for m in ms) / len(ms), itl_p99=math.fsum(m.itl_p99 for m in ms) / len(ms),
        request_rate=math.fsum(m.request_rate for m in ms) / len(ms), burn_rate=mean([m.burn_rate for m in ms]),
        burn_rate_5m=mean([m.burn_rate_5m for m in ms]),
        sample_count=None if any(c is None for c in counts) else sum(c for c in counts if c is not None),
        extra={"windows": float(len(ms))})


def _drifted(old: float, new: float, limit: float) -> bool:
    if old <= 0:
        return new > 0
    return abs(new - old) / old > limit


def _usable(score_: float) -> bool:
    return math.isfinite(score_) and score_ > 0
