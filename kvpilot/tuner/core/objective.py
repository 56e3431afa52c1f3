"""Scoring: what a measurement is worth to Optuna, and which constraints it violates.

Three goals:
- `latency` (online): minimise max(p99 TTFT / TTFT SLO, p99 ITL / ITL SLO); the SLO burn rates over
  the trial window are constraints (burn <= 1 means the window spent no more than its share of
  the error budget).
- `capacity` (offline, on the twin): maximise the highest request rate at which both p99s stay
  within the SLO.
- `gpus` (offline, on the twin, for a service that autoscales): minimise the GPUs its replicas
  need to carry a load (rate and token mix) within the SLO: the rate over one replica's capacity
  at that mix, at the planner's target utilization, times the tensor-parallel size
  (`kvpilot.fleet.regime.gpus_needed`, computed by the adapter into `Measurement.gpus`).

A config that cannot start, runs out of memory, or fails its rollout is still told to Optuna as
a COMPLETE trial, with a penalty value and a violated constraint: Optuna's samplers read
constraints only from completed trials, so a FAIL would teach the sampler nothing and it would
keep proposing the same region.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

from kvpilot.api.slo import SLO
from kvpilot.tuner.core.startup import StartupMemory, memory_report

__all__ = ["SLO", "Goal", "Measurement", "Outcome", "better", "infeasible", "score"]


class Goal(StrEnum):
    LATENCY = "latency"
    CAPACITY = "capacity"
    GPUS = "gpus"

    @property
    def direction(self) -> Literal["minimize", "maximize"]:
        return "maximize" if self is Goal.CAPACITY else "minimize"


# Values told for infeasible configs: worse than anything a running engine can score, but finite
# (TPE sorts by value within the infeasible group, and inf breaks its density estimates).
LATENCY_PENALTY = 100.0
CAPACITY_PENALTY = 0.0
GPUS_PENALTY = 1.0e6  # GPUs: more than any fleet kvpilot sizes (maxReplicas 1000 x a tensor-parallel 8 node)
# Constraint value for a config that could not run at all, for a reason that says nothing of how
# far it was from running (a crash, a failed rollout): far beyond any burn-rate violation.
INFEASIBLE_VIOLATION = 1000.0
# A config that could not start for lack of memory is graded by how much was missing
# (`startup.memory_shortfall`): MEMORY_VIOLATION x (1 + tier + shortfall), so 100..400 -- above
# any burn rate a running engine shows in practice (a fast burn is 14.4x), below the ungraded
# constant, and lower the nearer the config came to starting.  TPE ranks infeasible trials by
# this value when too few feasible ones fill its "good" group, so it heads for the memory that
# is missing (a higher gpuMemoryUtilization, a smaller token budget) instead of sampling blind.
MEMORY_VIOLATION = 100.0


@dataclass(frozen=True)
class Measurement:
    """What a trial window measured.  Optional fields are None where the source cannot tell."""

    ttft_p99: float
    itl_p99: float
    request_rate: float  # the offered load during the window (req/s): drift is judged on it
    burn_rate: float | None = None  # SLO burn over the trial window (1.0 = spending exactly on budget)
    burn_rate_5m: float | None = None
    sample_count: int | None = None
    capacity: float | None = None  # capacity goal: highest rate within SLO (req/s)
    gpus: float | None = None  # gpus goal: GPUs the load `request_rate` needs at `capacity` per replica
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        known: dict[str, Any] = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)


@dataclass(frozen=True)
class Outcome:
    """What to tell Optuna about one trial."""

    value: float
    constraints: tuple[float, ...]
    feasible: bool
    reason: str  # short CamelCase reason, as in Kubernetes conditions
    message: str = ""
    measurement: Measurement | None = None
    memory: StartupMemory | None = None  # what a start-up failure for lack of memory reported


def latency_score(m: Measurement, slo: SLO) -> float:
    """The worse of the two p99s relative to its SLO: 1.0 is exactly on the SLO."""
    return max(m.ttft_p99 / slo.ttft_seconds, m.itl_p99 / slo.itl_seconds)


def score(goal: Goal, m: Measurement, slo: SLO) -> Outcome:
    if goal is Goal.LATENCY:
        value = latency_score(m, slo)
        if not math.isfinite(value):
            return infeasible(goal, "NoLatency", "the window produced no finite p99", m)
        # Burn over the window above 1 spends budget faster than the objective allows.
        burn = m.burn_rate if m.burn_rate is not None else value  # no burn signal: p99 vs SLO stands in
        constraints = (burn - 1.0,)
        feasible = constraints[0] <= 0
        reason = "WithinSLO" if feasible else "BurningBudget"
        return Outcome(value, constraints, feasible, reason, f"score {value:.3f}, burn {burn:.2f}x", m)
    cap = m.capacity if m.capacity is not None else 0.0
    if cap <= 0:
        # Even the lightest load misses the SLO: a real constraint violation, graded by how far.
        over = max(latency_score(m, slo) - 1.0, 0.0) + 1.0
        return Outcome(penalty(goal), (over,), False, "SLOUnreachable", "misses the SLO at any load", m)
    if goal is Goal.CAPACITY:
        return Outcome(cap, (-1.0,), True, "WithinSLO", f"capacity {cap:.3f} req/s", m)
    if m.gpus is None or not math.isfinite(m.gpus):
        raise ValueError("the gpus goal scores Measurement.gpus: the adapter computes it from the capacity "
                         "(kvpilot.fleet.regime.gpus_needed)")
    return Outcome(m.gpus, (-1.0,), True, "WithinSLO",
                   f"{m.gpus:.2f} GPUs for {m.request_rate:g} req/s at {cap:.3f} req/s per replica", m)


def penalty(goal: Goal) -> float:
    """The value told for a config that could not run, or misses the SLO at any load."""
    return {Goal.LATENCY: LATENCY_PENALTY, Goal.CAPACITY: CAPACITY_PENALTY, Goal.GPUS: GPUS_PENALTY}[goal]


def infeasible(goal: Goal, reason: str, message: str, m: Measurement | None = None,
               memory: StartupMemory | None = None) -> Outcome:
    """A config that could not run (start-up failure, OOM, failed rollout).

    Still a completed trial with a violated constraint; the violation is graded by the memory
    shortfall the failure reports: `memory` where the engine gave its numbers (the twin), else
    what a real vLLM's `message` says.
    """
    value = penalty(goal)
    memory = memory if memory is not None else memory_report(message)
    return Outcome(value, (memory_violation(memory),), False, reason, message, m, memory)


def infeasible_violation(message: str) -> float:
    """The constraint value for a config that could not run, from vLLM's message."""
    return memory_violation(memory_report(message))


def memory_violation(memory: StartupMemory | None) -> float:
    """Graded by memory shortfall, else constant."""
    if memory is None:
        return INFEASIBLE_VIOLATION
    return MEMORY_VIOLATION * (1.0 + memory.shortfall().distance)


def better(goal: Goal, a: float, b: float) -> bool:
    """Is value a strictly better than b under this goal."""
    return a < b if goal.direction == "minimize" else a > b
