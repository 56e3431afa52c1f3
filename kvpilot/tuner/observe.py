"""Observers of the trial loop: structured logs, and the tuner's own Prometheus metrics."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from kvpilot.api.vocabulary import (
    METRIC_AUTOSCALING_DECISION,
    METRIC_DESIRED_REPLICAS,
    METRIC_REPLICA_GPUS,
    METRIC_TUNING_BEST_VALUE,
    METRIC_TUNING_CURRENT_TRIAL,
    METRIC_TUNING_PAUSED,
    METRIC_TUNING_PROMOTIONS_TOTAL,
    METRIC_TUNING_PRUNED_TOTAL,
    METRIC_TUNING_ROLLBACKS_TOTAL,
    METRIC_TUNING_TRIALS_STARTED_TOTAL,
    METRIC_TUNING_TRIALS_TOTAL,
    TrialStrategy,
    TuningPhase,
)
from kvpilot.tuner.core.gate import REASONS, Closed
from kvpilot.tuner.core.loop import Observer, TrialEvent
from kvpilot.tuner.core.objective import Outcome
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.study import Incumbent
from kvpilot.tuner.scaling import REASONS as SCALING_REASONS

log = logging.getLogger("kvpilot.tuner")


class LogObserver(Observer):
    """One structured log line per phase change and per trial."""

    def __init__(self, target: str = "local") -> None:
        self.target = target

    def phase(self, phase: TuningPhase, reason: str, message: str) -> None:
        log.info("phase=%s reason=%s target=%s %s", phase.value, reason, self.target, message)

    def trial_started(self, number: int, params: EngineParams, kind: str) -> None:
        log.info("trial=%d kind=%s target=%s started %s", number, kind, self.target, params.label())

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None:
        detail = f"value={outcome.value:.4f} reason={outcome.reason} {outcome.message}" if outcome else ""
        log.info("trial=%d state=%s target=%s %s %s", number, state, self.target, params.label(), detail)

    def best_changed(self, incumbent: Incumbent) -> None:
        log.info("best trial=%d value=%.4f target=%s %s", incumbent.trial, incumbent.value, self.target,
                 incumbent.params.label())

    def gate_changed(self, closed: Closed | None) -> None:
        if closed is None:
            log.info("gate=open target=%s trials resume", self.target)
        else:
            log.info("gate=closed reason=%s target=%s %s", closed.reason, self.target, closed.message)

    def trial_event(self, number: int, strategy: TrialStrategy, event: TrialEvent) -> None:
        log.info("trial=%d strategy=%s event=%s target=%s", number, strategy.value, event.value, self.target)


class Fanout(Observer):
    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def phase(self, phase: TuningPhase, reason: str, message: str) -> None:
        for o in self.observers:
            o.phase(phase, reason, message)

    def trial_started(self, number: int, params: EngineParams, kind: str) -> None:
        for o in self.observers:
            o.trial_started(number, params, kind)

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None:
        for o in self.observers:
            o.trial_finished(number, params, state, outcome)

    def best_changed(self, incumbent: Incumbent) -> None:
        for o in self.observers:
            o.best_changed(incumbent)

    def gate_changed(self, closed: Closed | None) -> None:
        for o in self.observers:
            o.gate_changed(closed)

    def trial_event(self, number: int, strategy: TrialStrategy, event: TrialEvent) -> None:
        for o in self.observers:
            o.trial_event(number, strategy, event)


class TunerMetrics:
    """kvpilot_tuning_trials_total{state}, kvpilot_tuning_best_value, kvpilot_tuning_current_trial,
    kvpilot_tuning_paused{reason}, and by trial strategy (rolling|canary) kvpilot_tuning_trials_started_total,
    kvpilot_tuning_promotions_total, kvpilot_tuning_pruned_total and kvpilot_tuning_rollbacks_total, each
    labelled with the InferenceService's namespace and name.  The strategy is a label of counters of their
    own: kvpilot_tuning_trials_total keeps its labels, which dashboards already sum by."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = registry or REGISTRY
        labels = ("namespace", "name")
        self.trials = Counter(METRIC_TUNING_TRIALS_TOTAL, "Tuning trials finished, by state",
                              (*labels, "state"), registry=reg)
        self.best = Gauge(METRIC_TUNING_BEST_VALUE, "Best feasible objective value so far", labels, registry=reg)
        self.current = Gauge(METRIC_TUNING_CURRENT_TRIAL, "Number of the trial in progress (-1: none)",
                             labels, registry=reg)
        self.paused = Gauge(METRIC_TUNING_PAUSED, "1 while the budget gate holds trials back, by reason "
                            "(BudgetLow, BudgetUnknown, OutsideWindow)", (*labels, "reason"), registry=reg)
        by = (*labels, "strategy")
        self.by_event = {
            TrialEvent.STARTED: Counter(METRIC_TUNING_TRIALS_STARTED_TOTAL, "Tuning trials started, by strategy",
                                        by, registry=reg),
            TrialEvent.PROMOTED: Counter(METRIC_TUNING_PROMOTIONS_TOTAL, "Trial engines promoted to the "
                                         "stable track (canary) or made the incumbent (rolling), by strategy",
                                         by, registry=reg),
            TrialEvent.PRUNED: Counter(METRIC_TUNING_PRUNED_TOTAL, "Trials cut short by a fast burn, by strategy",
                                       by, registry=reg),
            TrialEvent.ROLLED_BACK: Counter(METRIC_TUNING_ROLLBACKS_TOTAL, "Trial engines taken out of service "
                                            "after a failure (fast burn, failed start), by strategy",
                                            by, registry=reg),
        }

        # The planner's (kvpilot.tuner.scaler): labelled inferenceservice, as prometheus-adapter maps a
        # series to the object an HPA scales (`resources: {overrides: {inferenceservice: ...}}`).
        scaling = ("namespace", "inferenceservice")
        self.desired = Gauge(METRIC_DESIRED_REPLICAS, "Replicas the planner asks for (spec.autoscaling); an "
                             "external autoscaler reads it", scaling, registry=reg)
        self.decision = Gauge(METRIC_AUTOSCALING_DECISION, "1 on the reason of the planner's last decision, "
                              "0 on the others", (*scaling, "reason"), registry=reg)
        self.replica_gpus = Gauge(METRIC_REPLICA_GPUS, "GPUs one replica holds (tensorParallelSize): replicas "
                                  "times this is the GPUs the service uses", scaling, registry=reg)

    def observer(self, namespace: str, name: str) -> Observer:
        return _MetricsObserver(self, namespace, name)

    def publish_scaling(self, namespace: str, name: str, desired: int, reason: str, replica_gpus: int = 1) -> None:
        self.desired.labels(namespace, name).set(desired)
        self.replica_gpus.labels(namespace, name).set(replica_gpus)
        # Every reason has its series (an enum, as kube-state-metrics writes them): a query for one
        # reason reads 0, not nothing, while another holds.
        for r in SCALING_REASONS:
            self.decision.labels(namespace, name, r).set(1.0 if r == reason else 0.0)

    def forget_scaling(self, namespace: str, name: str) -> None:
        """No series for a service the planner no longer sizes: an HPA must not act on a stale count."""
        for gauge in (self.desired, self.replica_gpus):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
        for r in SCALING_REASONS:
            with contextlib.suppress(KeyError):
                self.decision.remove(namespace, name, r)


class _MetricsObserver(Observer):
    def __init__(self, m: TunerMetrics, namespace: str, name: str) -> None:
        self.m, self.labels = m, (namespace, name)
        self.gate_changed(None)
        for counter in m.by_event.values():  # a series per strategy from the start, to graph a rate on
            for strategy in TrialStrategy:
                counter.labels(*self.labels, strategy.value)

    def trial_started(self, number: int, params: EngineParams, kind: str) -> None:
        self.m.current.labels(*self.labels).set(number)

    def trial_finished(self, number: int, params: EngineParams, state: str, outcome: Outcome | None) -> None:
        self.m.trials.labels(*self.labels, state).inc()
        self.m.current.labels(*self.labels).set(-1)

    def best_changed(self, incumbent: Incumbent) -> None:
        self.m.best.labels(*self.labels).set(incumbent.value)

    def gate_changed(self, closed: Closed | None) -> None:
        # Every reason is exported (0 or 1), so a series exists to alert or graph on before any pause.
        for reason in REASONS:
            self.m.paused.labels(*self.labels, reason).set(1 if closed and closed.reason == reason else 0)

    def trial_event(self, number: int, strategy: TrialStrategy, event: TrialEvent) -> None:
        self.m.by_event[event].labels(*self.labels, strategy.value).inc()
