"""The GPUs a config needs for a load, and when a cheaper config is worth a rolling update.

For a service that autoscales, the bill is GPUs, and a config's worth is the GPUs its replicas need
to carry the load within the SLO: the load over one replica's sustained capacity at the load's token
mix (at the planner's target utilization, as `Planner.needed` sizes the fleet), times the GPUs each
replica shards the model over.  That count moves with the mix: by night long prompts make a
1,024-token chunk carry several times the requests per replica that 8,192 does.  So when the mix
changes, another config may need fewer GPUs; but switching is a rolling update (with maxSurge 1, one
replica more for a start-up per replica, and the fleet's caches cold again), so it is only done when
the saving is real: at least `min_saving_gpus` and `min_saving_ratio` of what the config in force
needs, sustained over the window the counts are taken on (the caller passes counts at the window's
mean rate and mix, e.g. the last 15 minutes, so that a minute's burst of long prompts does not
roll the fleet).

Pure: no twin, no clock; the capacities are the caller's (the twin's, or measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.fleet.planner import Policy

TARGET_UTILIZATION = Policy().target_utilization

# Reasons, CamelCase as Kubernetes condition reasons are.
SWITCH = "FewerGPUs"
KEEP_SMALL = "SavingUnderMinGPUs"
KEEP_RATIO = "SavingUnderRatio"
KEEP_NONE = "NoSaving"
KEEP_UNKNOWN = "NoCapacity"


def gpus_needed(rate: float, per_replica_rps: float, *, tensor_parallel_size: int = 1,
                target_utilization: float = TARGET_UTILIZATION) -> float:
    """GPUs the replicas carrying `rate` req/s need, before rounding up to whole replicas: the day's
    fleet follows the load, so this (not one instant's whole count) is what a config costs over it.
    inf when a replica sustains nothing within the SLO."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensorParallelSize must be >= 1, got {tensor_parallel_size}")
    if not 0 < target_utilization <= 1:
        raise ValueError(f"targetUtilization must be in (0, 1], got {target_utilization}")
    if rate < 0 or not math.isfinite(rate):
        raise ValueError(f"the request rate must be a finite number >= 0, got {rate}")
    if rate == 0:
        return 0.0
    if per_replica_rps <= 0:
        return math.inf
    return rate / (per_replica_rps * target_utilization) * tensor_parallel_size


def whole_gpus(gpus: float, tensor_parallel_size: int = 1) -> int:
    """The whole replicas' GPUs a fractional need takes (as `Planner.needed` rounds)."""
    if math.isinf(gpus):
        raise ValueError("no whole count of GPUs carries a load no replica sustains")
    return math.ceil(gpus / tensor_parallel_size - 1e-9) * tensor_parallel_size


@dataclass(frozen=True)
class RegimeRule:
    """When a config needing fewer GPUs replaces the one in force: both thresholds must hold."""

    min_saving_gpus: float = 1.0
    min_saving_ratio: float = 0.10

    def __post_init__(self) -> None:
        if self.min_saving_gpus < 0 or not math.isfinite(self.min_saving_gpus):
            raise ValueError(f"minSavingGPUs must be a finite number >= 0, got {self.min_saving_gpus}")
        if not 0 <= self.min_saving_ratio < 1:
            raise ValueError(f"minSavingRatio must be in [0, 1), got {self.min_saving_ratio}")


@dataclass(frozen=True)
class Switch:
    switch: bool
    reason: str
    message: str
    saving_gpus: float


def regime_change(current_gpus: float, candidate_gpus: float, rule: RegimeRule | None = None) -> Switch:
    """Switch from the config in force (needing `current_gpus` at the window's load and mix) to a
    candidate (needing `candidate_gpus`) only when the saving is worth a rolling update."""
    rule = rule or RegimeRule()
    for name, value in (("current", current_gpus), ("candidate", candidate_gpus)):
        if value < 0 or math.isnan(value):
            raise ValueError(f"{name} GPUs must be >= 0, got {value}")
    if math.isinf(candidate_gpus):
        return Switch(False, KEEP_UNKNOWN, "the candidate sustains no load within the SLO", 0.0)
    if math.isinf(current_gpus):
        return Switch(True, SWITCH, f"the config in force sustains no load within the SLO; the candidate needs "
                      f"{candidate_gpus:.2f} GPUs", math.inf)
    saving = current_gpus - candidate_gpus
    shown = f"{current_gpus:.2f} GPUs in force, {candidate_gpus:.2f} with the candidate"
    if saving <= 0:
        return Switch(False, KEEP_NONE, f"{shown}: no saving", saving)
    if saving < rule.min_saving_gpus:
        return Switch(False, KEEP_SMALL, f"{shown}: saves {saving:.2f}, under {rule.min_saving_gpus:g} GPU",
                      saving)
    ratio = saving / current_gpus
    if ratio < rule.min_saving_ratio:
        return Switch(False, KEEP_RATIO, f"{shown}: saves {ratio:.1%}, under {rule.min_saving_ratio:.0%}", saving)
    return Switch(True, SWITCH, f"{shown}: saves {saving:.2f} GPUs ({ratio:.1%}), worth a rolling update", saving)
