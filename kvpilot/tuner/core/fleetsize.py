"""The fleet's size during a trial window: a window in which the replica count moved is not a measurement.

A service with autoscaling changes its replica count while trials run.  A window that spans a scale
event mixes two loads per replica (and, on the way up, replicas still warming their caches), so its
p99s belong to neither fleet.  Normalising them per replica would not help: a p99 is not linear in
the per-replica load, least of all near saturation, where the autoscaler acts.  So such a window is
left out and measured again; that costs one window, and telling a trial on a clean window later is
harmless (the study holds the trial RUNNING meanwhile).

Pure: the adapter reads the counts (`FleetSize`); `moved` says whether two readings differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Replicas:
    """The replica count asked for (spec.replicas) and the replicas ready to serve."""

    desired: int
    ready: int

    def label(self) -> str:
        return f"{self.ready}/{self.desired} ready"


class FleetSize(Protocol):
    def replicas(self) -> Replicas | None:
        """The stable track's replica counts now; None when they cannot be read (the window is then
        judged on the readings that could be taken)."""
        ...


def moved(first: Replicas | None, now: Replicas | None) -> str | None:
    """Why a window that started at `first` and reads `now` is confounded by scaling, or None."""
    if first is None or now is None or first == now:
        return None
    if first.desired != now.desired:
        return f"spec.replicas went from {first.desired} to {now.desired}"
    return f"ready replicas went from {first.ready} to {now.ready}"
