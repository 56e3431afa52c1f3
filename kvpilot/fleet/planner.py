"""The replica planner: the fewest replicas that carry the demand within the SLO, guarded by the error budget.

Each scrape gives the demand Prometheus sees (request rate and the token mix) and the burn rates; the
capacity of one replica at that mix comes from the engine twin for the config in force, corrected by
what the fleet measures (`corrected_capacity`). The planner then:

- forecasts the rate over the time a new replica takes to start (the twin's start-up model: weights,
  CUDA-graph capture), from the trend of the recent samples, so that capacity is there when the load is;
- scales up at once to what the forecast needs, within the scale-up policy (as an HPA's behavior);
- on a fast burn (the page threshold on both windows) adds replicas now even where the capacity model
  says there are enough: the model is wrong there, the users are not;
- scales down only with budget left, no burn, a settled load, and to the highest count recommended
  over the scale-down stabilization window (an HPA's rule, so that a dip does not flap the fleet).

Pure: the caller passes every reading and the clock; `Planner` keeps only the recent samples and the
recommendations it made, so telling it the same scrape twice is harmless (a sample at a time it has
already seen replaces the earlier one).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Reasons, CamelCase as Kubernetes condition reasons are.
STEADY = "AtDemand"
LOAD_RISING = "LoadRising"
FAST_BURN = "FastBurn"
UP_PENDING = "ScaleUpPending"
LOAD_FELL = "LoadFell"
HELD_STABILIZING = "ScaleDownStabilizing"
HELD_UNSETTLED = "LoadUnsettled"
HELD_BURNING = "BudgetBurning"
HELD_BUDGET = "BudgetLow"
HELD_NO_DATA = "NoDemandData"
AT_MAX = "AtMaxReplicas"
AT_MIN = "AtMinReplicas"
UP_LIMITED = "ScaleUpLimited"
DOWN_LIMITED = "ScaleDownLimited"


@dataclass(frozen=True)
class Demand:
    """What Prometheus saw over the last scrape interval, at `at` (seconds, any monotonic origin)."""

    at: float
    rate: float  # requests per second
    prompt_tokens: float = 0.0  # mean per request
    output_tokens: float = 0.0  # mean per request
    # The arrival rate the requests in flight imply now (vLLM's running + waiting over the mean e2e
    # latency: Little's law). A gauge read at the scrape sees a step in the load that a rate over the
    # scrape window has only begun to show; None where it is not known.
    in_flight_rate: float | None = None


@dataclass(frozen=True)
class Burn:
    """The SLO's burn rates as the alerts read them, and the share of the period's budget left."""

    fast: bool = False  # the page threshold on the long and short window (e.g. 14.4x on 1h and 5m)
    slow: bool = False  # the ticket threshold (e.g. 6x on 6h and 30m)
    budget_left: float | None = None  # 0..1 of the SLO period's error budget; None: no recording to read


@dataclass(frozen=True)
class Policy:
    """spec.autoscaling, as the planner applies it (the HPA v2 behavior fields it keeps)."""

    min_replicas: int = 1
    max_replicas: int = 10
    target_utilization: float = 0.8  # of one replica's sustained capacity within the SLO
    scale_up_stabilization_s: float = 0.0
    scale_up_max_pods: int = 4  # per scale_up_period_s
    scale_up_max_percent: float = 100.0  # per scale_up_period_s; the larger of the two limits applies
    scale_up_period_s: float = 60.0
    scale_down_stabilization_s: float = 300.0
    scale_down_max_percent: float = 50.0  # per scale_down_period_s
    scale_down_period_s: float = 60.0
    min_budget_to_scale_down: float = 0.25  # share of the period's budget that must be left
    settle_tolerance: float = 0.10  # the rate's trend over the window, relative, for a "settled" load
    trend_window_s: float = 300.0  # the samples the trend is fitted on
    step_tolerance: float = 0.20  # in-flight rate above the windowed rate by more than this: a step under way

    def __post_init__(self) -> None:
        problems = []
        if self.min_replicas < 0:
            problems.append(f"minReplicas must be >= 0 (got {self.min_replicas})")
        if self.max_replicas < max(1, self.min_replicas):
            problems.append(f"maxReplicas must be >= minReplicas and >= 1 (got {self.max_replicas}, "
                            f"minReplicas {self.min_replicas})")
        if not 0 < self.target_utilization <= 1:
            problems.append(f"targetUtilization must be in (0, 1] (got {self.target_utilization})")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Decision:
    desired: int
    reason: str
    message: str
    forecast_rate: float  # requests per second the count was sized for
    needed: int  # replicas the forecast needs before the policy's limits and bounds


def corrected_capacity(twin_rps: float, predicted_p99_s: float | None, measured_p99_s: float | None,
                       *, floor: float = 0.25, ceiling: float = 1.5) -> float:
    """One replica's sustained rate within the SLO: the twin's, scaled by how the fleet's measured p99
    compares with the twin's prediction at the same per-replica load (measured slower than predicted:
    less capacity). Bounded, so one noisy scrape cannot zero or double the fleet."""
    if not predicted_p99_s or not measured_p99_s or predicted_p99_s <= 0 or measured_p99_s <= 0:
        return twin_rps
    return twin_rps * min(ceiling, max(floor, predicted_p99_s / measured_p99_s))


class Planner:
    def __init__(self, policy: Policy, *, startup_s: float) -> None:
        self.policy = policy
        self.startup_s = startup_s
        self._samples: deque[Demand] = deque()
        self._recommended: deque[tuple[float, int]] = deque()  # (at, needed), for the down window
        self._changes: deque[tuple[float, int, int]] = deque()  # (at, from, to) the planner asked for

    # -- readings ------------------------------------------------------------------------------
    def observe(self, demand: Demand) -> None:
        while self._samples and self._samples[-1].at >= demand.at:
            self._samples.pop()  # the same scrape told again (or the clock went back): the newest wins
        self._samples.append(demand)
        keep = max(self.policy.trend_window_s, self.policy.scale_down_stabilization_s)
        while self._samples and self._samples[0].at < demand.at - keep:
            self._samples.popleft()

    def trend(self) -> float:
        """The rate's slope (requests per second, per second) over the trend window: least squares."""
        if not self._samples:
            return 0.0
        now = self._samples[-1].at
        pts = [(d.at, d.rate) for d in self._samples if d.at >= now - self.policy.trend_window_s]
        if len(pts) < 3:
            return 0.0
        mean_t = sum(t for t, _ in pts) / len(pts)
        mean_r = sum(r for _, r in pts) / len(pts)
        var = sum((t - mean_t) ** 2 for t, _ in pts)
        if var <= 0:
            return 0.0
        return sum((t - mean_t) * (r - mean_r) for t, r in pts) / var

    def level(self) -> float:
        """The rate now: the windowed rate, or the in-flight rate where that is above it by more than
        step_tolerance (a step the window has only partly seen; below the band it is noise, and a fall
        is left to the window, so that scale-down stays slow)."""
        if not self._samples:
            return 0.0
        last = self._samples[-1]
        if last.in_flight_rate is not None and last.in_flight_rate > last.rate * (1 + self.policy.step_tolerance):
            return last.in_flight_rate
        return last.rate

    def forecast(self) -> float:
        """The rate a replica started now meets once it serves: now, plus the rising trend over start-up."""
        if not self._samples:
            return 0.0
        return self.level() + max(0.0, self.trend()) * self.startup_s

    def settled(self) -> bool:
        """The trend over the window moves the rate by less than settle_tolerance of it."""
        if not self._samples:
            return False
        rate = max(self._samples[-1].rate, 1e-9)
        return abs(self.trend()) * self.policy.trend_window_s <= self.policy.settle_tolerance * rate

    # -- the decision --------------------------------------------------------------------------
    def needed(self, rate: float, per_replica_rps: float) -> int:
        if rate <= 0:
            return 0
        if per_replica_rps <= 0:
            return self.policy.max_replicas
        return math.ceil(rate / (per_replica_rps * self.policy.target_utilization) - 1e-9)

    def plan(self, now: float, current: int, per_replica_rps: float, burn: Burn) -> Decision:
        """The replica count to ask for now, with `current` replicas asked for so far."""
        p = self.policy
        if not self._samples:
            return Decision(current, HELD_NO_DATA, "no demand sample yet: the count is left as it is", 0.0, current)
        rate = self.forecast()
        needed = self.needed(rate, per_replica_rps)
        self._recommended.append((now, needed))
        while self._recommended and self._recommended[0][0] < now - p.scale_down_stabilization_s:
            self._recommended.popleft()
        shown = f"{rate:.2f} req/s forecast over {self.startup_s:.0f} s of start-up, " \
                f"{per_replica_rps:.2f} req/s per replica at {p.target_utilization:.0%}"

        if burn.fast and needed <= current and self._up_pending(now):
            # Replicas asked for are still starting: the burn is what they are coming to stop.
            desired, reason = current, UP_PENDING
            message = (f"the error budget burns at the page rate; the replicas asked for within the last "
                       f"{self.startup_s:.0f} s of start-up are not serving yet")
        elif burn.fast and needed <= current:
            # The capacity model says enough; the SLO says otherwise. Half again, at least one more.
            desired, reason = current + max(1, math.ceil(current * 0.5)), FAST_BURN
            message = f"the error budget burns at the page rate with {current} replicas ({shown} needs {needed})"
        elif needed > current:
            desired, reason = needed, LOAD_RISING
            message = f"{shown}: {needed} replicas needed, {current} asked for"
        elif needed < current:
            desired, reason, message = self._down(now, current, needed, burn, shown)
        else:
            desired, reason, message = current, STEADY, f"{shown}: {needed} replicas needed"

        desired, reason, message = self._limit(now, current, desired, reason, message)
        bounded = min(p.max_replicas, max(p.min_replicas, desired))
        if bounded != desired:
            which = AT_MAX if bounded < desired else AT_MIN
            message = f"{message}; held at {'maxReplicas' if which == AT_MAX else 'minReplicas'} {bounded}"
            desired, reason = bounded, which
        if desired != current:
            self._changes.append((now, current, desired))
        return Decision(desired, reason, message, rate, needed)

    def _up_pending(self, now: float) -> bool:
        """A scale-up was asked for less than a start-up ago."""
        return any(after > before and when > now - self.startup_s for when, before, after in self._changes)

    def _down(self, now: float, current: int, needed: int, burn: Burn, shown: str) -> tuple[int, str, str]:
        p = self.policy
        if burn.fast or burn.slow:
            return current, HELD_BURNING, f"{shown}: {needed} would do, but the error budget is burning"
        if burn.budget_left is None or burn.budget_left < p.min_budget_to_scale_down:
            left = "unknown" if burn.budget_left is None else f"{burn.budget_left:.0%}"
            return current, HELD_BUDGET, (f"{shown}: {needed} would do, but the budget left ({left}) is under "
                                          f"{p.min_budget_to_scale_down:.0%}")
        if not self.settled():
            return current, HELD_UNSETTLED, f"{shown}: {needed} would do once the load settles"
        highest = max(n for _, n in self._recommended)
        if highest >= current:
            return current, HELD_STABILIZING, (f"{shown}: {needed} would do, but {highest} were needed within "
                                               f"the last {p.scale_down_stabilization_s:.0f} s")
        return highest, LOAD_FELL, f"{shown}: {highest} replicas needed over the last " \
                                   f"{p.scale_down_stabilization_s:.0f} s, {current} asked for"

    def _limit(self, now: float, current: int, desired: int, reason: str, message: str) -> tuple[int, str, str]:
        """The HPA behavior's rate limits: how far the count may move within a period."""
        p = self.policy
        if desired > current:
            base = self._count_at(now - p.scale_up_period_s, current)
            ceiling = max(base + p.scale_up_max_pods, math.floor(base * (1 + p.scale_up_max_percent / 100)))
            if desired > ceiling:
                return max(current, ceiling), UP_LIMITED, f"{message}; scale-up limited to {ceiling} this period"
        elif desired < current:
            base = self._count_at(now - p.scale_down_period_s, current)
            floor = math.ceil(base * (1 - p.scale_down_max_percent / 100))
            if desired < floor:
                return min(current, floor), DOWN_LIMITED, f"{message}; scale-down limited to {floor} this period"
        return desired, reason, message

    def _count_at(self, at: float, current: int) -> int:
        """The count asked for at time `at` (the base a period's limit is taken from)."""
        while self._changes and self._changes[0][0] < at - 3600:
            self._changes.popleft()
        base = current
        for when, before, _after in reversed(self._changes):
            if when <= at:
                break
            base = before
        return base
