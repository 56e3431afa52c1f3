"""The replica planner for one InferenceService with spec.autoscaling, in a thread of its own in the tuner.

Every `--scrape-interval` seconds: read the demand, p99s, burn and budget from Prometheus
(`kvpilot.tuner.scaling.ScalingQueries`), the count asked for (spec.replicas), one replica's capacity
from the twin (`kvpilot.tuner.capacity`); ask the planner (`kvpilot.fleet.planner`); publish
kvpilot_desired_replicas and the decision's reason; and, for actor kvpilot, write spec.replicas through
the scale subresource, an Event and the Scaling condition, each only when it changes (`Reporter`).
Prometheus unreachable or silent: the count is held (NoDemandData), never lowered on missing data.

Apart from the tuning worker of the same service, so that a trial (minutes, a rollout) never delays a
scale-up; the two write different fields (spec.replicas vs spec.engine) under different managers.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

from kvpilot.api.conditions import find_condition, now_rfc3339, set_condition
from kvpilot.api.vocabulary import (
    API_VERSION,
    FIELD_MANAGER_PLANNER,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    ConditionType,
)
from kvpilot.fleet.planner import HELD_NO_DATA, Decision, Planner
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.signals import PrometheusReader, SignalsError
from kvpilot.tuner.capacity import NoCapacityModel, TwinCapacity
from kvpilot.tuner.kubeapi import resource_path
from kvpilot.tuner.scaling import (
    NO_CAPACITY_MODEL,
    SCALE_FAILED,
    Actions,
    Readings,
    Reporter,
    ScalingQueries,
    demand_window_s,
    held,
    policy_from_spec,
    startup_seconds,
)

log = logging.getLogger("kvpilot.tuner.scaler")


class PrometheusScalingReader:
    """The readings of one service; a failed demand read gives rate None, a failed guard read the
    cautious answer (no budget known: no scale-down)."""

    def __init__(self, url: str, queries: ScalingQueries, *, timeout_s: float = 5.0) -> None:
        self.queries = queries
        self._reader = PrometheusReader(url.rstrip("/"), timeout=timeout_s)

    def _scalar(self, expr: str) -> float | None:
        try:
            return self._reader.scalar(expr)
        except SignalsError as exc:
            log.debug("query failed: %s: %s", expr, exc)
            return None

    def _firing(self, expr: str) -> bool:
        try:
            return bool(self._reader.query(expr))
        except SignalsError:
            return False

    def read(self, at: float) -> Readings:
        q = self.queries
        try:
            rate = self._reader.scalar(q.rate)
        except SignalsError as exc:
            log.warning("reading the demand failed: %s", exc)
            return Readings(at=at, rate=None)
        return Readings(at=at, rate=rate, prompt_tokens=self._scalar(q.prompt_tokens),
                        output_tokens=self._scalar(q.output_tokens), ttft_p99_s=self._scalar(q.ttft_p99),
                        itl_p99_s=self._scalar(q.itl_p99), fast_burn=self._firing(q.fast_burn),
                        slow_burn=self._firing(q.slow_burn), budget_left=self._scalar(q.budget_left),
                        in_flight=self._scalar(q.in_flight), e2e_mean_s=self._scalar(q.e2e_mean))


class Scaler:
    def __init__(self, api_client: Any, obj: dict[str, Any], *, prometheus: str, interval_s: float, metrics: Any,
                 capacity: TwinCapacity, clock: Callable[[], float] = time.monotonic) -> None:
        from kvpilot.api import InferenceService

        self.isvc = InferenceService.model_validate(obj)
        self.api, self.metrics, self.capacity, self.clock = api_client, metrics, capacity, clock
        self.namespace, self.name = self.isvc.metadata.namespace or "default", self.isvc.metadata.name
        self.interval_s = interval_s
        self.path = resource_path(f"{GROUP}/{VERSION}", PLURAL, self.namespace, self.name)
        self.reader = PrometheusScalingReader(
            prometheus, ScalingQueries.for_target(SloTarget.from_isvc(self.isvc), demand_window_s(interval_s)))
        assert self.isvc.spec.autoscaling is not None
        self.planner = Planner(policy_from_spec(self.isvc.spec.autoscaling), startup_s=startup_seconds(self.isvc))
        self.reporter = Reporter()
        self._logged: tuple[int, int, str] | None = None
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"scale-{self.namespace}/{self.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stopping.set()

    def observe(self, obj: dict[str, Any]) -> None:
        """The spec as the last scan saw it: new bounds and pace apply at the next read; the samples and
        the recommendations made so far are kept (the planner's windows span reads)."""
        from kvpilot.api import InferenceService

        try:
            isvc = InferenceService.model_validate(obj)
        except Exception:
            return  # invalid now: the operator says so; the spec in force stays
        if isvc.spec.autoscaling is None:
            return
        if isvc.spec.autoscaling != self.isvc.spec.autoscaling:
            self.planner.policy = policy_from_spec(isvc.spec.autoscaling)
        self.isvc = isvc
        self.planner.startup_s = startup_seconds(isvc)  # a new engine or model starts in another time

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self.tick()
                except Exception:  # the next read may succeed: a scaler never dies of one
                    log.exception("scaling %s/%s failed; trying again in %gs", self.namespace, self.name,
                                  self.interval_s)
                self._stopping.wait(self.interval_s)
        finally:
            self.metrics.forget_scaling(self.namespace, self.name)

    def tick(self) -> Decision | None:
        """One read, decision and write; None when the object cannot be read (nothing is published)."""
        try:
            obj = cast(dict[str, Any], self.api.get(self.path))
        except Exception as exc:
            log.warning("scaling %s/%s: reading it failed: %s", self.namespace, self.name, exc)
            return None
        self.observe(obj)
        autoscaling = self.isvc.spec.autoscaling
        if autoscaling is None:
            return None
        current = int((obj.get("spec") or {}).get("replicas", self.isvc.spec.replicas))
        now = self.clock()
        decision = self.decide(now, current)
        self.metrics.publish_scaling(self.namespace, self.name, decision.desired, decision.reason,
                                     self.isvc.spec.engine.tensor_parallel_size or 1)
        if autoscaling.actor == "kvpilot":
            written = find_condition((obj.get("status") or {}).get("conditions"), ConditionType.SCALING.value)
            actions = self.reporter.step(now, current, decision,
                                         (written["status"], written["reason"]) if written else None)
            self.act(obj, current, actions)
        return decision

    def decide(self, now: float, current: int) -> Decision:
        readings = self.reader.read(now)
        demand = readings.demand()
        if demand is None:
            return held(current, HELD_NO_DATA, "no request rate from Prometheus for this service: the count is "
                        "held (never lowered on missing data)")
        self.planner.observe(demand)
        try:
            cap = self.capacity.capacity(self.isvc, demand.prompt_tokens, demand.output_tokens, rate=demand.rate,
                                         replicas=current, ttft_p99_s=readings.ttft_p99_s,
                                         itl_p99_s=readings.itl_p99_s)
        except NoCapacityModel as exc:
            return held(current, NO_CAPACITY_MODEL, str(exc))
        except Exception as exc:  # a config the twin cannot run: no capacity is no reason to move the count
            log.exception("scaling %s/%s: the twin's capacity failed", self.namespace, self.name)
            return held(current, NO_CAPACITY_MODEL, f"the engine twin failed on the config in force: {exc}"[:1024])
        decision = self.planner.plan(now, current, cap.per_replica_rps, readings.burn())
        # Every read at DEBUG; a new count or reason at INFO (a read every 30 s per service is noise).
        level = logging.INFO if (current, decision.desired, decision.reason) != self._logged else logging.DEBUG
        self._logged = (current, decision.desired, decision.reason)
        log.log(level, "scaling %s/%s: %d -> %d (%s): %s", self.namespace, self.name, current, decision.desired,
                decision.reason, decision.message)
        return decision

    def act(self, obj: dict[str, Any], current: int, actions: Actions) -> None:
        condition = actions.condition
        event = actions.event
        if actions.replicas is not None:
            try:
                self.api.merge_patch(self.path + "/scale", {"spec": {"replicas": actions.replicas}},
                                     field_manager=FIELD_MANAGER_PLANNER)
            except Exception as exc:
                message = f"writing spec.replicas {actions.replicas} (from {current}) through the scale subresource " \
                          f"failed: {exc}"[:1024]
                log.warning("scaling %s/%s: %s", self.namespace, self.name, message)
                event, condition = ("Warning", SCALE_FAILED, message), ("False", SCALE_FAILED, message)
                self.reporter = Reporter()  # the next read decides afresh and tells again
        if event is not None:
            self._event(obj, *event)
        if condition is not None:
            self._condition(obj, *condition)

    def _event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        now = now_rfc3339()
        ev = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{self.name}.{uuid.uuid4().hex[:12]}", "namespace": self.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": self.name,
                               "namespace": self.namespace, "uid": (obj.get("metadata") or {}).get("uid")},
            "reason": reason, "message": message[:1024], "type": type_, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "reportingComponent": FIELD_MANAGER_PLANNER,
            "source": {"component": FIELD_MANAGER_PLANNER},
        }
        try:
            self.api.create(resource_path("v1", "events", self.namespace), ev, field_manager=FIELD_MANAGER_PLANNER)
        except Exception as exc:  # Events are best effort
            log.warning("could not post an Event for %s/%s: %s", self.namespace, self.name, exc)

    def _condition(self, obj: dict[str, Any], status: str, reason: str, message: str) -> None:
        """The Scaling condition, the other writers' conditions carried over as read this tick (the
        operator carries over the types it does not own the same way)."""
        current = list((obj.get("status") or {}).get("conditions") or [])
        conditions = set_condition(current, ConditionType.SCALING.value, status, reason, message[:1024],
                                   (obj.get("metadata") or {}).get("generation"), now_rfc3339())
        try:
            self.api.merge_patch(self.path + "/status", {"status": {"conditions": conditions}},
                                 field_manager=FIELD_MANAGER_PLANNER)
        except Exception as exc:  # status is best effort: the next change writes it again
            log.warning("could not write the Scaling condition of %s/%s: %s", self.namespace, self.name, exc)
