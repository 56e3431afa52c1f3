"""The budget gate: whether a trial may start now (spec.tuning.budgetGate).

A trial is a risk taken with the error budget, so one starts only while enough of the SLO period's
budget is left and, where maintenance windows are given, inside one of them.  The gate is asked
before every trial (never in the middle of one: a trial started is measured or pruned as usual).
When it is closed the loop keeps the best engine known in force and reports Paused with the
reason: BudgetLow, BudgetUnknown (no budget recording to read: the gate does not guess) or
OutsideWindow.

Pure: the time and the budget left come from callables, so tests drive both.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from zoneinfo import ZoneInfo

if TYPE_CHECKING:
    from kvpilot.api.models import BudgetGate

DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
BUDGET_LOW = "BudgetLow"
BUDGET_UNKNOWN = "BudgetUnknown"
OUTSIDE_WINDOW = "OutsideWindow"
REASONS = (BUDGET_LOW, BUDGET_UNKNOWN, OUTSIDE_WINDOW)


def _minutes(hh_mm: str) -> int:
    hours, minutes = hh_mm.split(":")
    return int(hours) * 60 + int(minutes)


@dataclass(frozen=True)
class Window:
    """Open on `days` (0 = Monday) from `start` to `end` minutes after local midnight; an end at or
    before the start runs past midnight into the next day (the day it opened on is what counts)."""

    days: frozenset[int]
    start: int
    end: int

    @classmethod
    def parse(cls, days: Sequence[str], start: str, end: str) -> Window:
        return cls(frozenset(DAYS.index(d) for d in days), _minutes(start), _minutes(end))

    def contains(self, local: dt.datetime) -> bool:
        minute = local.hour * 60 + local.minute
        today = local.weekday()
        if self.start < self.end:
            return today in self.days and self.start <= minute < self.end
        # Past midnight: the evening part opened today, the morning part opened yesterday.
        return (today in self.days and minute >= self.start) or (
            (today - 1) % 7 in self.days and minute < self.end
        )

    def describe(self) -> str:
        days = ",".join(DAYS[d] for d in sorted(self.days))
        return f"{days} {self.start // 60:02d}:{self.start % 60:02d}-{self.end // 60:02d}:{self.end % 60:02d}"


@dataclass(frozen=True)
class Closed:
    """Why no trial may start now."""

    reason: str
    message: str


@dataclass(frozen=True)
class GatePolicy:
    min_remaining: float = 0.5
    windows: tuple[Window, ...] = ()
    zone: dt.tzinfo = dt.UTC

    @classmethod
    def from_spec(cls, gate: BudgetGate) -> GatePolicy:
        return cls(
            min_remaining=gate.min_remaining,
            windows=tuple(Window.parse(w.days, w.start, w.end) for w in gate.windows),
            zone=ZoneInfo(gate.time_zone),
        )

    def check(self, now: dt.datetime, remaining: float | None) -> Closed | None:
        """None when a trial may start at `now` (aware) with `remaining` of the budget left
        (None: unknown)."""
        return self.outside(now) or self.short(remaining)

    def outside(self, now: dt.datetime) -> Closed | None:
        """OutsideWindow when windows are given and `now` is in none of them."""
        if not self.windows:
            return None
        local = now.astimezone(self.zone)
        if any(w.contains(local) for w in self.windows):
            return None
        spans = "; ".join(w.describe() for w in self.windows)
        return Closed(OUTSIDE_WINDOW, f"outside the maintenance windows ({spans} {self.zone}); "
                      f"it is {local:%a %H:%M} there")

    def short(self, remaining: float | None) -> Closed | None:
        """BudgetUnknown or BudgetLow when less than min_remaining of the budget is known to be left."""
        if self.min_remaining <= 0.0:
            return None
        if remaining is None:
            return Closed(BUDGET_UNKNOWN, "the error budget left cannot be read (no "
                          "kvpilot:slo_*_error_budget_remaining:ratio series: the SLO rules not loaded, or no "
                          f"traffic yet); trials need at least {self.min_remaining:.0%} of it")
        if remaining < self.min_remaining:
            return Closed(BUDGET_LOW, f"{max(remaining, 0.0):.1%} of the error budget is left over the SLO "
                          f"period; trials need at least {self.min_remaining:.0%}")
        return None

    @property
    def reads_budget(self) -> bool:
        return self.min_remaining > 0.0


class Gate(Protocol):
    def closed(self) -> Closed | None:
        """Why no trial may start now, or None."""
        ...


class PolicyGate:
    """A GatePolicy over live readings.  The policy can be swapped while the loop runs (a changed
    spec applies at the next check); `budget` returns the share left, None when it cannot be read."""

    def __init__(self, policy: GatePolicy, budget: Callable[[], float | None],
                 now: Callable[[], dt.datetime] | None = None) -> None:
        self.policy, self.budget = policy, budget
        self.now = now or (lambda: dt.datetime.now(dt.UTC))

    def closed(self) -> Closed | None:
        policy = self.policy  # one read: a swap mid-check must not mix two policies
        # Outside the windows the budget is not even read (a Prometheus query saved per poll).
        return policy.outside(self.now()) or policy.short(self.budget() if policy.reads_budget else None)
