"""The sequential test a canary trial runs on its paired per-poll comparisons.

`PairedSPRT`: two one-sided Wald SPRTs on d = ln(score_canary / score_stable), "worse" and "better",
each deciding at Wald's boundaries.  The test and its defaults: docs/architecture.md, "The canary's
sequential test".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


class Verdict(StrEnum):
    UNDECIDED = "Undecided"
    WORSE = "CanaryWorse"
    BETTER = "CanaryBetter"


@dataclass(frozen=True)
class SequentialSettings:
    alpha: float = 0.05
    beta: float = 0.10
    delta: float = math.log(1.05)
    min_samples: int = 5
    sigma_floor: float = 0.02

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not 0.0 < v < 0.5:
                raise ValueError(f"sequential test: {name} must be in (0, 0.5), got {v}")
        if self.delta <= 0:
            raise ValueError(f"sequential test: delta must be > 0, got {self.delta}")
        if self.min_samples < 2:
            raise ValueError(f"sequential test: min_samples must be >= 2, got {self.min_samples}")
        if self.sigma_floor <= 0:
            raise ValueError(f"sequential test: sigma_floor must be > 0, got {self.sigma_floor}")

    @property
    def upper(self) -> float:
        return math.log((1.0 - self.beta) / self.alpha)

    @property
    def lower(self) -> float:
        return math.log(self.beta / (1.0 - self.alpha))


@dataclass
class PairedSPRT:
    """Feed it paired scores (canary, stable) one poll at a time; `verdict` says when it has decided."""

    settings: SequentialSettings = field(default_factory=SequentialSettings)
    diffs: list[float] = field(default_factory=list)
    worse_open: bool = True
    better_open: bool = True
    verdict: Verdict = Verdict.UNDECIDED

    def reset(self) -> None:
        self.diffs.clear()
        self.worse_open = self.better_open = True
        self.verdict = Verdict.UNDECIDED

    def llr(self) -> tuple[float, float]:
        """(worse side, better side) log-likelihood ratios of H1 to H0 so far."""
        n = len(self.diffs)
        if n == 0:
            return 0.0, 0.0
        mean = sum(self.diffs) / n
        var = sum((d - mean) ** 2 for d in self.diffs) / (n - 1) if n > 1 else 0.0
        var = max(var, self.settings.sigma_floor ** 2)
        delta, total = self.settings.delta, sum(self.diffs)
        half = n * delta * delta / 2.0
        return (delta * total - half) / var, (-delta * total - half) / var

    def add(self, canary_score: float, stable_score: float) -> Verdict:
        """One poll's paired scores (both finite and > 0; others are skipped by the caller)."""
        if self.verdict is not Verdict.UNDECIDED:
            return self.verdict
        self.diffs.append(math.log(canary_score / stable_score))
        if len(self.diffs) < self.settings.min_samples:
            return self.verdict
        worse, better = self.llr()
        s = self.settings
        if self.worse_open and worse >= s.upper:
            self.verdict = Verdict.WORSE
        elif self.better_open and better >= s.upper:
            self.verdict = Verdict.BETTER
        else:
            if worse <= s.lower:
                self.worse_open = False
            if better <= s.lower:
                self.better_open = False
        return self.verdict
