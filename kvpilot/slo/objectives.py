"""SLO targets and the burn-rate maths of multi-window, multi-burn-rate alerts.

A burn rate of 1 spends exactly the error budget over the SLO period.  The Google SRE
workbook pages when 2% of a 30-day budget burns in an hour (14.4x) or 5% in six hours (6x),
and opens a ticket when 10% burns in a day (3x) or in three days (1x).  Each alert also
checks a short window (1/12 of the long one) so it stops firing soon after the burn stops.

The factors are derived from the budget fraction, the long window and the period, so a
30-day SLO gets exactly the workbook's numbers and a 7-day SLO gets proportionally smaller
ones (the same share of its budget in the same time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvpilot.slo import promql
from kvpilot.slo.promql import Selector

if TYPE_CHECKING:  # the InferenceService model is only read, never built, here
    from kvpilot.api import InferenceService

Sli = Literal["ttft", "itl"]
SLIS: tuple[Sli, ...] = ("ttft", "itl")
SLI_TITLES: dict[str, str] = {"ttft": "time to first token", "itl": "inter-token latency"}
SLI_SHORT: dict[str, str] = {"ttft": "TTFT", "itl": "ITL"}

# Windows the recording rules keep for each SLI's error ratio.
RECORDED_WINDOWS: tuple[str, ...] = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")


@dataclass(frozen=True)
class BurnAlert:
    """One multi-window burn-rate alert: fire when both windows burn faster than `factor`."""

    severity: Literal["page", "ticket"]
    long_window: str
    short_window: str
    budget_fraction: float  # share of the period's budget this alert tolerates in long_window

    def factor(self, period: str) -> float:
        """Burn-rate threshold for an SLO period (30d: 14.4, 6, 3, 1)."""
        return round(
            self.budget_fraction * promql.duration_seconds(period) / promql.duration_seconds(self.long_window), 6
        )


BURN_ALERTS: tuple[BurnAlert, ...] = (
    BurnAlert("page", "1h", "5m", 0.02),
    BurnAlert("page", "6h", "30m", 0.05),
    BurnAlert("ticket", "1d", "2h", 0.10),
    BurnAlert("ticket", "3d", "6h", 0.10),
)


@dataclass(frozen=True)
class SloTarget:
    """What the SLO code needs to know about one serving target.

    Built from an InferenceService (`from_isvc`), or by hand for a local process the tuner
    runs.  `namespace` and `name` identify it in recorded series and alert labels; the
    selector picks its engine's series.
    """

    namespace: str
    name: str
    ttft_seconds: float = 0.5
    itl_seconds: float = 0.05
    objective: float = 0.99
    period: str = "30d"
    replicas: int = 1
    selector: Selector | None = None
    model_name: str | None = None

    def __post_init__(self) -> None:
        for fld in ("namespace", "name"):
            if not isinstance(getattr(self, fld), str) or not getattr(self, fld):
                raise ValueError(f"{fld} must be a non-empty string")
        promql.check_bucket_edge("ttft", self.ttft_seconds)
        promql.check_bucket_edge("itl", self.itl_seconds)
        promql.error_budget(self.objective)
        promql.validate_duration(self.period)

    @classmethod
    def from_isvc(cls, isvc: InferenceService) -> SloTarget:
        spec = isvc.spec
        return cls(
            namespace=isvc.metadata.namespace or "default",
            name=isvc.metadata.name,
            ttft_seconds=spec.slo.ttft_seconds,
            itl_seconds=spec.slo.itl_seconds,
            objective=spec.slo.objective,
            period=spec.slo.period,
            replicas=spec.replicas,
            model_name=spec.served_model_name or spec.model,
        )

    @property
    def pods(self) -> Selector:
        """The engine series of this target (its pods, in a cluster)."""
        return self.selector or Selector.for_inferenceservice(self.namespace, self.name)

    @property
    def budget(self) -> float:
        return promql.error_budget(self.objective)

    def threshold(self, sli: Sli) -> float:
        return self.ttft_seconds if sli == "ttft" else self.itl_seconds

    @property
    def identity(self) -> dict[str, str]:
        """Labels kvpilot's own series (recordings, alerts) carry for this target."""
        return {"namespace": self.namespace, "inferenceservice": self.name}

    @property
    def identity_selector(self) -> Selector:
        return Selector.of(self.identity)


def target_for(isvc_or_target: InferenceService | SloTarget) -> SloTarget:
    if isinstance(isvc_or_target, SloTarget):
        return isvc_or_target
    return SloTarget.from_isvc(isvc_or_target)
