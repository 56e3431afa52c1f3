"""The sequential test a canary trial runs on its paired per-poll comparisons.

Each poll measures both tracks over the same interval (same time, same load) and yields one paired
difference: d = ln(score_canary / score_stable), the log-ratio of the two tracks' latency scores
(`objective.latency_score`: the worse p99 relative to its SLO).  Pairing removes the load: a drift
moves both scores together and cancels in d.

Two one-sided Wald SPRTs on the mean of d, run side by side (Lorden's 2-SPRT shape):

- "worse":  H0: mean d = 0   against  H1: mean d = +delta   (the canary is delta worse)
- "better": H0: mean d = 0   against  H1: mean d = -delta   (the canary is delta better)

with Gaussian increments and the variance estimated from the samples so far (plug-in, floored at
`sigma_floor` so that a run of identical polls does not decide on nothing).  The log-likelihood
ratio of H1 to H0 after n samples is, for the worse side, sum(delta*d_i - delta^2/2) / sigma^2, and
the same with -delta for the better side.  A side decides when its ratio reaches ln((1-beta)/alpha)
(Wald's upper boundary); when it falls to ln(beta/(1-alpha)) that side is dropped (H0 accepted: the
canary is not delta worse, or not delta better) and the other side carries on.  Neither side stops
before `min_samples` polls (the plug-in variance needs a few).  No decision by the end of the window:
the trial is judged on the whole window as a rolling trial is, canary against stable.

Defaults: alpha = 0.05 (a false "worse"/"better" call when the tracks are equal), beta = 0.10 (a missed
call when they differ by delta), delta = ln(1.05) (a 5% difference in latency score), min_samples 5,
sigma_floor 0.02 (2% in score).  Wald's boundaries keep the error rates at about alpha and beta
(slightly below, as the overshoot is ignored); the plug-in variance makes them approximate for small
n, which `min_samples` bounds: with 3, the variance of so few samples made false calls at about
twice alpha; with 5, at about alpha.  `benchmarks/canary.py` chose delta: at 10%, the end-of-window
call on configs 2-8% worse than the stable one (a quarter of the requests, so a noisier p99)
promoted more wrong engines than rolling trials did; at 5%, none, with as few trials to a good
engine.
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
