"""The replica planner in the tuner, its pure parts: what it asks Prometheus, what the answers mean,
and what it writes for a decision (`kvpilot.tuner.scaler` does the reading and writing).

- `ScalingQueries`: the PromQL for one InferenceService, on the series the SLO rules select (namespace
  and kvpilot_dev_inferenceservice): the request rate (TTFT observations, one per request that got a
  first token, as the SLO rules and the tuner count them), the mean prompt and output tokens per
  request (the token histograms' sum over count), the p99s, the burn-rate alerts' conditions and the
  budget left (the generated SLO rules' recordings);
- `Readings.demand()` / `Readings.burn()`: the answers as the planner takes them;
- `policy_from_spec`: spec.autoscaling as the planner's `Policy`;
- `Reporter`: from a decision, the scale write, the Event and the Scaling condition (only on change,
  Events throttled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.fleet import planner
from kvpilot.fleet.planner import Burn, Decision, Demand, Policy
from kvpilot.slo import promql
from kvpilot.slo.objectives import BURN_ALERTS, SLIS, BurnAlert, SloTarget
from kvpilot.slo.rules import burn_alert_expr, worst_budget_left

if TYPE_CHECKING:
    from kvpilot.api import InferenceService
    from kvpilot.api.models import AutoscalingSpec, ScalingPolicy

# Reasons the planner in the tuner adds to the planner's own: it holds the count for these.
NO_CAPACITY_MODEL = "NoCapacityModel"  # the twin has no preset for the model or GPU
SCALE_FAILED = "ScaleFailed"  # the scale subresource refused the write
HELD = frozenset({planner.HELD_NO_DATA, NO_CAPACITY_MODEL, SCALE_FAILED})
# Every reason kvpilot_autoscaling_decision can carry: a bounded label set, one series per reason.
REASONS: tuple[str, ...] = (
    planner.STEADY, planner.LOAD_RISING, planner.FAST_BURN, planner.UP_PENDING, planner.LOAD_FELL,
    planner.HELD_STABILIZING, planner.HELD_UNSETTLED, planner.HELD_BURNING, planner.HELD_BUDGET,
    planner.HELD_NO_DATA, planner.AT_MAX, planner.AT_MIN, planner.UP_LIMITED, planner.DOWN_LIMITED,
    NO_CAPACITY_MODEL, SCALE_FAILED,
)
# A reason that changes while the count does not is told at most this often (a count change always is).
EVENT_MIN_INTERVAL_S = 60.0
# Steady state is not news: its Event would follow every scale-up that reached the demand.
QUIET_REASONS = frozenset({planner.STEADY})
# The fast burn is the page alert over the shortest windows (1h and 5m at 14.4x for 30 days); the others
# (6h/30m, and the ticket alerts) are the slow burn that holds scale-down back.
FAST_BURN_ALERTS = BURN_ALERTS[:1]
SLOW_BURN_ALERTS = BURN_ALERTS[1:]


# A model the twin has no preset for (or a config map it cannot read here): vLLM's start-up of a
# mid-sized model from a node cache, cold compile (the twin's model gives 61 s for an 8B, 107 s for a 34B).
FALLBACK_STARTUP_S = 120.0


def startup_seconds(isvc: InferenceService) -> float:
    """How long a new replica of `isvc` takes to serve, the planner's forecast horizon: the twin's
    start-up model (`kvpilot twin startup`: process, weights, torch.compile, profiling, CUDA graphs,
    the startup probe) for its model and tensor-parallel size."""
    from kvpilot.twin.coldstart import predict_cold_start
    from kvpilot.twin.models import resolve_model

    try:
        model = resolve_model(isvc.spec.model)
    except ValueError:
        return FALLBACK_STARTUP_S
    return predict_cold_start(model, tensor_parallel_size=isvc.spec.engine.tensor_parallel_size or 1).total_s


def demand_window_s(interval_s: float) -> float:
    """A rate() over four of the planner's reads: at least two of Prometheus' samples at any scrape
    interval up to the read interval (set it to the scrape interval)."""
    return 4.0 * interval_s


@dataclass(frozen=True)
class ScalingQueries:
    rate: str
    prompt_tokens: str
    output_tokens: str
    ttft_p99: str
    itl_p99: str
    fast_burn: str  # non-empty while the fast-burn alert's condition holds (either SLI)
    slow_burn: str
    budget_left: str
    in_flight: str  # requests running + waiting over the service's engines, now
    e2e_mean: str  # mean request latency over the window (seconds)

    @classmethod
    def for_target(cls, target: SloTarget, window_s: float) -> ScalingQueries:
        sel, w = target.pods, promql.seconds_duration(window_s)

        def any_of(alerts: tuple[BurnAlert, ...]) -> str:
            return " or ".join(f"({burn_alert_expr(target, sli, a)})"
                               for a in alerts for sli in SLIS).replace("\n", " ")

        return cls(
            rate=promql.observations_rate("ttft", sel, w),
            prompt_tokens=promql.token_mean("prompt", sel, w),
            output_tokens=promql.token_mean("generation", sel, w),
            ttft_p99=promql.quantile("ttft", 0.99, sel, w),
            itl_p99=promql.quantile("itl", 0.99, sel, w),
            fast_burn=any_of(FAST_BURN_ALERTS),
            slow_burn=any_of(SLOW_BURN_ALERTS),
            budget_left=worst_budget_left(target.identity_selector),
            in_flight=f"{promql.requests_running(sel)} + {promql.requests_waiting(sel)}",
            e2e_mean=promql.histogram_mean("e2e", sel, w),
        )


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


@dataclass(frozen=True)
class Readings:
    """One read of Prometheus; None where a query had no answer (or NaN)."""

    at: float
    rate: float | None
    prompt_tokens: float | None = None
    output_tokens: float | None = None
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    fast_burn: bool = False
    slow_burn: bool = False
    budget_left: float | None = None
    in_flight: float | None = None
    e2e_mean_s: float | None = None

    def in_flight_rate(self) -> float | None:
        """The arrival rate the requests in flight imply now (Little's law: in flight over the mean
        latency), which sees a step in the load before a rate over the window does; None unknown."""
        in_flight, e2e = _finite(self.in_flight), _finite(self.e2e_mean_s)
        if in_flight is None or e2e is None or in_flight < 0 or e2e <= 0:
            return None
        return in_flight / e2e

    def demand(self) -> Demand | None:
        """The demand, or None when there is none to trust: no rate series (no engine scraped, no
        Prometheus) is not zero demand, and never a reason to scale down."""
        rate = _finite(self.rate)
        if rate is None or rate < 0:
            return None
        return Demand(at=self.at, rate=rate, prompt_tokens=_finite(self.prompt_tokens) or 0.0,
                      output_tokens=_finite(self.output_tokens) or 0.0, in_flight_rate=self.in_flight_rate())

    def burn(self) -> Burn:
        return Burn(fast=self.fast_burn, slow=self.slow_burn, budget_left=_finite(self.budget_left))


def _up_limits(policies: list[ScalingPolicy], select: str) -> tuple[int, float, float]:
    """(pods, percent, period) of the scale-up policies, as the planner's single period takes them."""
    if select == "Disabled":
        return 0, 0.0, 60.0
    pods = [p.value for p in policies if p.type == "Pods"]
    percent = [float(p.value) for p in policies if p.type == "Percent"]
    pick = min if select == "Min" else max
    return (pick(pods) if pods else 0, pick(percent) if percent else 0.0,
            float(min(p.period_seconds for p in policies)))


def policy_from_spec(spec: AutoscalingSpec) -> Policy:
    """spec.autoscaling as the planner applies it.  The planner keeps one period per direction, so the
    shortest of the policies' periods is used, and scale-down is limited by Percent policies only (a
    Pods scale-down policy alone leaves it unlimited, as 100%); selectPolicy Disabled stops that direction."""
    up, down = spec.behavior.scale_up, spec.behavior.scale_down
    pods, percent, period = _up_limits(up.policies, up.select_policy)
    down_pct = [float(p.value) for p in down.policies if p.type == "Percent"]
    if down.select_policy == "Disabled":
        down_percent = 0.0
    elif down_pct:
        down_percent = (min if down.select_policy == "Min" else max)(down_pct)
    else:
        down_percent = 100.0
    return Policy(min_replicas=spec.min_replicas, max_replicas=spec.max_replicas,
                  scale_up_stabilization_s=float(up.stabilization_window_seconds),
                  scale_up_max_pods=pods, scale_up_max_percent=percent, scale_up_period_s=period,
                  scale_down_stabilization_s=float(down.stabilization_window_seconds),
                  scale_down_max_percent=min(100.0, down_percent),
                  scale_down_period_s=float(min(p.period_seconds for p in down.policies)))


def held(current: int, reason: str, message: str) -> Decision:
    """The count left as it is, for a reason the planner cannot see past (no data, no model)."""
    return Decision(current, reason, message, 0.0, current)


@dataclass(frozen=True)
class Actions:
    """What to write for one decision (actor kvpilot): None where nothing is to be written."""

    replicas: int | None = None  # spec.replicas through the scale subresource
    event: tuple[str, str, str] | None = None  # (type, reason, message)
    condition: tuple[str, str, str] | None = None  # Scaling condition (status, reason, message)


class Reporter:
    """Turns each decision into writes, only on change: the scale when the count moves; an Event when
    it moves, or when the reason changes and the last Event is EVENT_MIN_INTERVAL_S old (a held reason
    flapping between reads tells once a minute at most); the Scaling condition when its status or
    reason changes, or the count moves."""

    def __init__(self, min_interval_s: float = EVENT_MIN_INTERVAL_S) -> None:
        self.min_interval_s = min_interval_s
        self._reason: str | None = None  # the last decision's
        self._event_at: float | None = None
        self._condition: tuple[str, str] | None = None

    def step(self, now: float, current: int, decision: Decision, written: tuple[str, str] | None) -> Actions:
        """`written`: the Scaling condition's (status, reason) on the object, if any."""
        moves = decision.desired != current
        status = "False" if decision.reason in HELD else "True"
        event = None
        if moves:
            event = ("Normal", decision.reason,
                     f"Scaling from {current} to {decision.desired} replicas: {decision.message}")
        elif decision.reason != self._reason and decision.reason not in QUIET_REASONS and (
                self._event_at is None or now - self._event_at >= self.min_interval_s):
            event = ("Warning" if status == "False" else "Normal", decision.reason, decision.message)
        if event is not None:
            self._event_at = now
        self._reason = decision.reason
        condition = None
        if moves or written != (status, decision.reason):
            condition = (status, decision.reason, decision.message)
        return Actions(replicas=decision.desired if moves else None, event=event, condition=condition)


def mix_bucket(prompt_tokens: float, output_tokens: float) -> tuple[int, int]:
    """Mean tokens per request, rounded to a grid of quarter powers of two (about 19% apart): the
    twin's capacity barely moves within a step, and a service's mix stays in a few buckets."""
    def snap(tokens: float) -> int:
        return max(1, round(2 ** (round(4 * math.log2(max(tokens, 1.0))) / 4)))
    return snap(prompt_tokens), snap(output_tokens)
