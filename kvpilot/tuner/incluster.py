"""`kvpilot tuner`: the in-cluster tuner, a process of its own beside the operator.

Why a separate process rather than a kopf daemon inside the operator: a trial lasts minutes and a
study holds Optuna, SQLAlchemy and NumPy (about 150 MB of RSS) - none of which the operator
needs to reconcile.  Apart, the operator stays small and quick to restart; a tuner crash or a
stuck Prometheus query cannot stall reconciliation; the tuner can be scaled to zero (or left
out) without touching serving; and its RBAC is narrower (patch InferenceServices, write their
status and Events; no Deployments).  The operator stays the only writer of Deployments: the
tuner speaks to it through the InferenceService, like a user would.

One worker thread per InferenceService with `spec.tuning.enabled`, and one replica planner thread
(`kvpilot.tuner.scaler`) per InferenceService with `spec.autoscaling`, tuned or not; a scan every `--resync`
seconds starts workers for new services and stops those whose tuning was switched off (between
trials: one engine change at a time, always finished).  A worker whose loop fails is started
again with back-off, not dropped (see `Worker`); the tuner's API client rides out transient
API-server errors itself (`kvpilot.tuner.kubeapi.RetryPolicy`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from argparse import Namespace
from typing import Any, cast

from kvpilot.api.rest import ApiError
from kvpilot.api.vocabulary import TrialStrategy, TuningPhase
from kvpilot.tuner.capacity import TwinCapacity
from kvpilot.tuner.core.loop import LiveSettings, LiveTuner
from kvpilot.tuner.core.objective import SLO, Goal
from kvpilot.tuner.core.space import EngineParams, SearchSpace, SpaceError
from kvpilot.tuner.core.study import TunerStudy, study_name

log = logging.getLogger("kvpilot.tuner")

# The shortest window a canary trial's per-track reads use: four scrapes at Prometheus Operator's 30s.
CANARY_MIN_WINDOW_S = 120.0


class Worker:
    """Tunes one InferenceService in a thread of its own, and keeps tuning it through failures.

    A trial loop that breaks on something other than the config (the API server down past the
    client's retries, the study's storage failing) has put back the best engine known
    (`LiveTuner.put_back`); the worker says so in status.tuning (phase Failed) and a Warning Event,
    then starts the study again after a back-off that doubles from RESTART_BASE_S to RESTART_MAX_S,
    as the kubelet does a crashing container.  Reopening the study fails the trial that was cut off
    and queues its config again.  Only an invalid tuning spec ends the worker: starting again
    cannot help, a changed spec starts a new worker (`run_tuner`).  A start after a failure plans
    from the spec as it is then, not as it was when the worker began."""

    RESTART_BASE_S = 10.0
    RESTART_MAX_S = 300.0

    def __init__(self, api_client: Any, obj: dict[str, Any], args: Namespace, metrics: Any) -> None:
        from kvpilot.api import InferenceService

        self.isvc = InferenceService.model_validate(obj)
        self.api_client, self.args, self.metrics = api_client, args, metrics
        self.namespace = self.isvc.metadata.namespace
        self.name = self.isvc.metadata.name
        self.tuner: LiveTuner | None = None
        self.thread = threading.Thread(target=self._run, name=f"tune-{self.namespace}/{self.name}", daemon=True)
        self.finished = False
        self.restarts = 0
        self._stopping = threading.Event()
        self._study: str | None = None
        self._status: Any = None  # the last start's KubeStatusObserver (it knows the trial in progress)
        self._owe_put_back = False  # the last put-back failed: the next start puts back first
        self.gate: Any = None  # the budget gate, when spec.tuning.budgetGate is set (see observe)
        self._seen: dict[str, Any] | None = None  # the object as the last scan saw it

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self.tuner is not None:
            self.tuner.stop_requested = True

    def _run(self) -> None:
        target = f"{self.namespace}/{self.name}"
        try:
            try:
                plan = self._plan()
            except (SpaceError, ValueError) as exc:  # the spec: the same spec would fail again
                log.error("tuning %s: %s", target, exc)
                return
            while not self._stopping.is_set():
                try:
                    self._tune(plan)
                    return
                except Exception as exc:
                    self.restarts += 1
                    delay = min(self.RESTART_MAX_S, self.RESTART_BASE_S * 2 ** (self.restarts - 1))
                    # An API error is an answer that says what went wrong (a 403 from an API server
                    # whose RBAC has not synced since it restarted, a 503 past the client's tries): its
                    # words, not a traceback, which is kept for what nobody expected.
                    log.error("tuning %s failed; starting again in %gs (restart %d)%s", target, delay,
                              self.restarts, f": {exc}" if isinstance(exc, ApiError) else "",
                              exc_info=not isinstance(exc, ApiError))
                    try:
                        self._report_failure(exc, delay)
                    except Exception:  # the API server may be what failed: the loop goes on regardless
                        log.exception("tuning %s: reporting the failure failed", target)
                    self._back_off(delay)
                if self._stopping.is_set():
                    return
                try:
                    plan = self._replan()
                except (SpaceError, ValueError) as exc:
                    log.error("tuning %s: %s", target, exc)
                    return
                if not self.isvc.spec.tuning.enabled:
                    return  # switched off during the back-off
        finally:
            self.finished = True

    def _back_off(self, delay: float) -> None:
        self._stopping.wait(delay)

    def _replan(self) -> tuple[SearchSpace, SLO, Goal, str]:
        """The plan from the spec as it is now, which may have changed during the back-off: read afresh,
        else (the API server may be what failed) as the last scan saw it."""
        from kvpilot.api import InferenceService
        from kvpilot.api.vocabulary import GROUP, PLURAL, VERSION
        from kvpilot.tuner.kubeapi import resource_path

        obj = self._seen
        try:
            obj = self.api_client.get(resource_path(f"{GROUP}/{VERSION}", PLURAL, self.namespace, self.name))
        except Exception as exc:
            log.warning("tuning %s/%s: reading the spec failed (%s); using the last scan's", self.namespace,
                        self.name, exc)
        if obj is not None:
            self.isvc = InferenceService.model_validate(obj)
        return self._plan()

    def _report_failure(self, exc: Exception, delay: float) -> None:
        """status.tuning phase Failed and a Warning Event: what broke, which engine is in force."""
        from kvpilot.tuner.adapters.kubernetes import KubeStatusObserver

        tuner, self.tuner = self.tuner, None
        what = f"{type(exc).__name__}: {exc}"[:400]
        try:
            best = tuner.fallback().label() if tuner is not None else ""
        except Exception:  # the study's storage may be what failed: reporting must not end the loop
            best = "unknown while the study cannot be read"
        if tuner is None:
            reason, kept = "TuningFailed", "the engine was not changed by this start"
        elif tuner.put_back_failed is None:
            reason, kept = "TuningFailed", f"the best engine known is in force ({best})"
        else:
            self._owe_put_back = True
            reason = "RestoreFailed"
            kept = (f"putting back the best engine known ({best}) failed too; "
                    "the next start puts it back before any trial")
        message = f"{what}; {kept}; starting again in {delay:g}s (restart {self.restarts})"
        status = self._status or KubeStatusObserver(self.api_client, self.namespace, self.name, self._study or "")
        status.phase(TuningPhase.FAILED, reason, message)
        status.event("Warning", reason, message)

    def observe(self, obj: dict[str, Any]) -> None:
        """The object as the last scan saw it: a budget gate added, changed or removed applies at the
        loop's next check, in the same study (its trials and space are unchanged); the rest of the
        spec at the next start after a failure (`_replan`)."""
        from kvpilot.api import InferenceService
        from kvpilot.tuner.core.gate import GatePolicy

        self._seen = obj
        try:
            gate = InferenceService.model_validate(obj).spec.tuning.budget_gate
        except Exception:
            return  # invalid now: the operator says so; the gate in force stays
        if gate == self.isvc.spec.tuning.budget_gate:
            return
        self.isvc.spec.tuning.budget_gate = gate
        if gate is not None and self.gate is not None:
            self.gate.policy = GatePolicy.from_spec(gate)
        else:
            self.gate = self._gate()
        if self.tuner is not None:
            self.tuner.gate = self.gate

    def _gate(self) -> Any:
        """The budget gate over this service's budget recordings in Prometheus, or None."""
        gate = self.isvc.spec.tuning.budget_gate
        if gate is None:
            return None
        from kvpilot.tuner.adapters.prometheus import BudgetLeft
        from kvpilot.tuner.core.gate import GatePolicy, PolicyGate

        return PolicyGate(GatePolicy.from_spec(gate), BudgetLeft(self.args.prometheus, self.namespace, self.name),
                          now=self._now())

    def _now(self) -> Any:
        return None  # the wall clock

    def _signals(self, slo: SLO) -> Any:
        """Where the trials' measurements come from: the Prometheus that scrapes this service."""
        from kvpilot.tuner.adapters.prometheus import PrometheusSignals

        canary = self.isvc.spec.effective_trial_strategy == TrialStrategy.CANARY
        # A canary track is one pod: its per-poll reads need a window holding a few of Prometheus's scrapes.
        return PrometheusSignals.for_inferenceservice(self.args.prometheus, self.namespace, self.name,
                                                      slo=slo, objective=self.isvc.spec.slo.objective,
                                                      min_window_s=CANARY_MIN_WINDOW_S if canary else 0.0)

    def _clock(self) -> Any:
        return None  # the loop's real clock

    def _plan(self) -> tuple[SearchSpace, SLO, Goal, str]:
        """What the spec asks for (the space, SLO and goal) and the study's storage, which is the
        tuner's own: a tenant must not choose which database a cluster-wide process opens.  Raises
        ValueError (or SpaceError) for a spec no restart can fix."""
        from kvpilot.tuner.jobs import sqlite_url

        spec = self.isvc.spec
        space = SearchSpace.from_spec(spec.tuning.space)
        goal = Goal(spec.tuning.goal)
        self._study = study_name(self.namespace, self.name, space, goal)
        return (space, SLO(spec.slo.ttft_seconds, spec.slo.itl_seconds), goal,
                sqlite_url(self.args.storage))

    def _tune(self, plan: tuple[SearchSpace, SLO, Goal, str]) -> None:
        from kvpilot.tuner.adapters.kubernetes import (
            KubernetesApplier,
            KubernetesCanaryApplier,
            KubeStatusObserver,
        )
        from kvpilot.tuner.observe import Fanout, LogObserver

        spec = self.isvc.spec
        target = f"{self.namespace}/{self.name}"
        space, slo, goal, storage = plan
        name = self._study or ""
        status = self._status = KubeStatusObserver(self.api_client, self.namespace, self.name, name)
        observer = Fanout(LogObserver(target), self.metrics.observer(self.namespace, self.name), status)
        study = TunerStudy(storage=storage, name=name, goal=Goal.LATENCY if goal is Goal.CAPACITY else goal,
                           space=space, slo=slo, seed=0, n_trials=spec.tuning.max_trials)
        strategy = TrialStrategy(spec.effective_trial_strategy)
        # Canary trials need an applier that runs the trial engine beside the stable one; a rolling
        # one rolls the whole fleet (spec.tuning.trialStrategy; canary by default from 2 replicas).
        applier_type = KubernetesCanaryApplier if strategy is TrialStrategy.CANARY else KubernetesApplier
        applier = applier_type(self.api_client, self.namespace, self.name,
                               timeout_s=spec.rollout.progress_deadline_seconds + 300.0)
        signals = self._signals(slo)
        current = applier.current()
        study.enqueue(current, "current")
        defaults = self._vllm_defaults()
        if defaults is not None:
            study.enqueue(defaults, "vllmDefaults")
        self._warm_start(study, signals, space, slo, goal, current, observer)
        if goal is Goal.CAPACITY and study.finished_count() == 0:
            # capacity is an offline goal: the twin's best config is applied once, then kept.
            best = next((t for t in study.study.trials if t.user_attrs.get("source") == "warmStart"), None)
            if best is not None:
                applier.apply(study.engine_of(best), best.number)
            observer.phase(TuningPhase.DONE, "TwinBest", "capacity goal: the twin's best config is in force")
            return
        settings = LiveSettings(warmup_s=float(spec.tuning.warmup_seconds),
                                window_s=float(spec.tuning.trial_seconds), poll_s=self.args.poll,
                                pause_poll_s=self.args.poll, max_trials=spec.tuning.max_trials,
                                strategy=strategy)
        self.gate = self._gate()
        # fleet: a window in which the replica count moved (an autoscaler, kubectl scale) is measured again.
        self.tuner = LiveTuner(study, applier, signals, settings, clock=self._clock(), observer=observer,
                               gate=self.gate, fleet=applier)
        if self._stopping.is_set():
            return
        if self._owe_put_back:  # a trial's engine may still be in force from the last start
            if not self.tuner.put_back():
                raise self.tuner.put_back_failed or RuntimeError("putting back the best engine failed")
            self._owe_put_back = False
        self.tuner.run()

    def _vllm_defaults(self) -> EngineParams | None:
        """vLLM's own defaults on this service's GPU, which the twin knows for engine.kind twin; for a
        real vLLM the GPU model is not in the spec, so no trial is labelled with defaults it may not have."""
        engine = self.isvc.spec.engine
        if engine.kind != "twin":
            log.info("%s/%s: GPU model unknown; vLLM's defaults are not tried", self.namespace, self.name)
            return None
        from kvpilot.twin.hardware import resolve_gpu, serve_defaults

        try:
            return EngineParams.vllm_defaults(serve_defaults(resolve_gpu(engine.twin.gpu)))
        except ValueError as exc:
            log.info("%s/%s: vLLM's defaults are not tried: %s", self.namespace, self.name, exc)
            return None

    def _warm_start(self, study: TunerStudy, signals: Any, space: SearchSpace, slo: SLO, goal: Goal,
                    current: EngineParams, observer: Any) -> None:
        """Search the twin under the live workload for the spec's goal (capacity, or latency at the
        measured rate); enqueue its best 3.  Skipped (logged) when the model or GPU has no twin
        preset, or Prometheus has no workload to show yet."""
        if study.finished_count() > 0:
            return  # resumed: the warm start already happened
        from kvpilot.tuner.adapters.offline import TwinEvaluator, TwinTarget, workload_from_estimate
        from kvpilot.tuner.adapters.prometheus import estimate_workload
        from kvpilot.tuner.core.loop import SignalsUnavailable
        from kvpilot.tuner.core.warmstart import enqueue_warm_start, twin_best, twin_goal

        observer.phase(TuningPhase.WARM_START, "SearchingTwin", "estimating the workload and searching the twin")
        engine = self.isvc.spec.engine
        try:
            twin = TwinTarget(model=self.isvc.spec.model, gpu=engine.twin.gpu,
                              max_model_len=engine.max_model_len or 8192,
                              tensor_parallel_size=engine.tensor_parallel_size)
            twin.engine_config(current)
            est = estimate_workload(signals, window_s=3600.0)
        except (ValueError, SignalsUnavailable) as exc:
            log.info("warm start skipped for %s/%s: %s", self.namespace, self.name, exc)
            return
        ev = TwinEvaluator(twin, workload_from_estimate(est), slo)
        goal = twin_goal(goal, self.isvc.spec.autoscaling is not None)
        picks = twin_best(space, slo, ev.evaluator(goal, est.request_rate), goal=goal, trials=20, k=3,
                          first=[current])
        enqueue_warm_start(study, picks)


def run_tuner(args: Namespace) -> int:
    import optuna
    from prometheus_client import start_http_server

    from kvpilot.api.vocabulary import GROUP, PLURAL, VERSION
    from kvpilot.tuner.kubeapi import KubeAPI, resource_path
    from kvpilot.tuner.observe import TunerMetrics

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    api_client = KubeAPI.from_environment()
    listing_path = resource_path(f"{GROUP}/{VERSION}", PLURAL, args.namespace or None)
    metrics = TunerMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port)
    workers: dict[tuple[str, str], Worker] = {}
    scalers: dict[tuple[str, str], Any] = {}
    capacity = TwinCapacity()
    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: finishing the trials in progress, then exiting", signum)
        stopping.set()
        for w in workers.values():
            w.stop()
        for s in scalers.values():
            s.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    from kvpilot.tuner.storage import redacted

    log.info("kvpilot tuner: watching InferenceServices in %s; studies in %s",
             args.namespace or "all namespaces", redacted(args.storage))
    while not stopping.is_set():
        items: list[dict[str, Any]] | None
        try:
            items = list(cast(dict[str, Any], api_client.get(listing_path))["items"])
        except Exception as exc:
            log.warning("listing InferenceServices failed: %s", exc)
            items = None
        if items is not None:
            seen = set()
            for obj in items:
                meta = obj.get("metadata") or {}
                key = (meta.get("namespace", ""), meta.get("name", ""))
                seen.add(key)
                enabled = bool(((obj.get("spec") or {}).get("tuning") or {}).get("enabled"))
                w = workers.get(key)
                if enabled and (w is None or (w.finished and _changed(w, obj))):
                    try:
                        workers[key] = Worker(api_client, obj, args, metrics)
                    except Exception as exc:  # an invalid object: the operator reports it; skip
                        log.warning("not tuning %s/%s: %s", *key, exc)
                        continue
                    workers[key].start()
                elif not enabled and w is not None:
                    w.stop()
                elif enabled and w is not None and not w.finished:
                    w.observe(obj)
            for key in set(workers) - seen:
                workers.pop(key).stop()
            _scan_scalers(api_client, items, scalers, args, metrics, capacity)
        stopping.wait(args.resync)
    deadline = time.monotonic() + 60
    for w in workers.values():
        w.thread.join(timeout=max(0.0, deadline - time.monotonic()))
    for s in scalers.values():
        s.thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return 0


def _scan_scalers(api_client: Any, items: list[dict[str, Any]], scalers: dict[tuple[str, str], Any],
                  args: Namespace, metrics: Any, capacity: TwinCapacity) -> None:
    """A scaler per service with spec.autoscaling, whether or not it is tuned; stopped when the field or
    the service goes.  The scaler reads its spec afresh on each tick; the scan only starts and stops."""
    from kvpilot.tuner.scaler import Scaler

    wanted = set()
    for obj in items:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if not (obj.get("spec") or {}).get("autoscaling"):
            continue
        wanted.add(key)
        if key in scalers:
            continue
        try:
            scalers[key] = Scaler(api_client, obj, prometheus=args.prometheus, interval_s=args.scrape_interval,
                                  metrics=metrics, capacity=capacity)
        except Exception as exc:  # an invalid object: the operator reports it; skip
            log.warning("not scaling %s/%s: %s", *key, exc)
            continue
        log.info("scaling %s/%s (actor %s) every %gs", *key, scalers[key].isvc.spec.autoscaling.actor,
                 args.scrape_interval)
        scalers[key].start()
    for key in set(scalers) - wanted:
        log.info("no longer scaling %s/%s", *key)
        scalers.pop(key).stop()


def _changed(w: Worker, obj: dict[str, Any]) -> bool:
    """A finished study restarts only when its tuning settings changed (a new space is a new study)."""
    from kvpilot.api import InferenceService

    try:
        new = InferenceService.model_validate(obj).spec.tuning
    except Exception:
        return False  # invalid now: the operator says so in a condition; nothing to tune
    # The gate applies to a running study (Worker.observe): it alone starts nothing new.
    exclude = {"budget_gate"}
    return new.model_dump(mode="json", exclude=exclude) != w.isvc.spec.tuning.model_dump(mode="json", exclude=exclude)
