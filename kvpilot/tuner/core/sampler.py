"""The tuner's sampler: a stratified (Latin hypercube) start, then multivariate TPE.

`make_sampler` builds it; `LatinHypercubeStart` is the start. Why a Latin hypercube, and how `redo`,
`claim` and `bounds` keep its strata: docs/architecture.md, "The tuner's sampler".
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

SAMPLERS = ("tpe", "random")



def _every_trial_drawn(trial: FrozenTrial) -> bool:
    return True


def startup_trials(n_trials: int) -> int:
    """Start-up trials for a budget: a third of it, at least 4 and at most 10 (Optuna's default).

    Measured on the quality benchmark (8 scenarios x 60 seeds, 20 trials, mean regret after 5 /
    10 / 20 trials): random search 27.0% / 13.7% / 6.2%; TPE with Optuna's default 10 uniform
    start-up trials 30.5% / 15.0% / 4.5%; 5 uniform 30.5% / 10.3% / 3.6%; 6 stratified (this)
    23.6% / 10.0% / 3.7%.  A short start-up is what beats random search; stratifying it helps
    the first few trials (each a rollout and a measurement window, live) and is a wash later.
    """
    return max(4, min(10, n_trials // 3))


def make_sampler(seed: int | None, n_trials: int, sampler: str = "tpe",
                 redo: Callable[[FrozenTrial], bool] | None = None,
                 drawn: Callable[[FrozenTrial], bool] | None = None,
                 constant_liar: bool = False, claim: bool = False,
                 bounds: Mapping[str, str] | None = None) -> BaseSampler:
    if sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler != "tpe":
        raise ValueError(f"sampler: expected one of {', '.join(SAMPLERS)}, got {sampler!r}")
    n = startup_trials(n_trials)

    # Optuna 5's TPE is multivariate (the joint density keeps "bigger budget <-> fewer KV blocks").
    # constant_liar (several workers on one study): trials still running count as bad ones, so a
    # worker does not draw next to what another is measuring (Optuna's advice for parallel TPE).
    def tpe(trial_seed: int | None) -> BaseSampler:
        return optuna.samplers.TPESampler(seed=trial_seed, n_startup_trials=n, constant_liar=constant_liar)

    return LatinHypercubeStart(tpe(seed), n_startup_trials=n, seed=seed, redo=redo, drawn=drawn, claim=claim,
                               bounds=bounds, per_trial=tpe)


def trial_seed(seed: int, number: int, salt: str = "") -> int:
    """The seed of one trial's draws: a function of the study's seed and the trial's number alone,
    so that a study resumed after a kill draws what the uninterrupted one drew (a generator carried
    from trial to trial restarts with the process, and every later draw would differ)."""
    digest = hashlib.sha256(f"{seed}/{number}/{salt}".encode()).digest()
    return int.from_bytes(digest[:4], "little")  # numpy's RandomState takes 32 bits


class LatinHypercubeStart(BaseSampler):
    """`main` after `n_startup_trials` trials; before that, Latin hypercube draws.

    `drawn(trial)` tells a trial the sampler drew from one that was enqueued with its params (the
    caller marks those; Optuna's own mark is private): only drawn trials take a stratum.

    With a seed, every trial's draws are seeded by its number (`trial_seed`): the start-up's
    offsets within strata, and `main` made afresh by `per_trial(seed)` before each trial."""

    def __init__(self, main: BaseSampler, *, n_startup_trials: int, seed: int | None = None,
                 redo: Callable[[FrozenTrial], bool] | None = None,
                 drawn: Callable[[FrozenTrial], bool] | None = None,
                 claim: bool = False, bounds: Mapping[str, str] | None = None,
                 per_trial: Callable[[int | None], BaseSampler] | None = None) -> None:
        if n_startup_trials < 1:
            raise ValueError(f"n_startup_trials must be >= 1, got {n_startup_trials}")
        self._main = main
        self._redo = redo or (lambda t: False)
        self._drawn = drawn or _every_trial_drawn
        self._n = n_startup_trials
        self._seed = seed
        self._claim = claim
        self._bounds = dict(bounds or {})
        self._rng = random.Random(seed)
        self._per_trial = per_trial

    # -- which phase ----------------------------------------------------------------------
    def _earlier(self, study: optuna.Study, trial: FrozenTrial) -> list[FrozenTrial]:
        return [t for t in study.get_trials(deepcopy=False) if t.number < trial.number]

    def _in_startup(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        # As TPE counts: trials that finished (complete or pruned), enqueued ones included; a
        # drawn trial whose stratum is drawn again does not count, up to twice the start-up.
        finished = [t for t in self._earlier(study, trial) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
        done = sum(1 for t in finished if not self._redone(t))
        return done < self._n and len(finished) < 2 * self._n

    def _redone(self, t: FrozenTrial) -> bool:
        return self._drawn(t) and t.state.is_finished() and self._redo(t)

    def _stratum_index(self, study: optuna.Study, trial: FrozenTrial) -> int:
        """Which start-up draw this is: earlier trials that were drawn (not enqueued), any state,
        but those whose stratum is drawn again (`redo`: a config that could not start, say)."""
        return sum(1 for t in self._earlier(study, trial) if self._drawn(t) and not self._redone(t))

    # -- BaseSampler ----------------------------------------------------------------------
    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if self._in_startup(study, trial):
            return {}
        return self._main.infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        return self._main.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        if not self._in_startup(study, trial):
            return self._main.sample_independent(study, trial, param_name, param_distribution)
        index = self._stratum_index(study, trial)
        free = self._permutation(param_name)
        if self._claim:
            claimed = self._claimed(study, trial, param_name, param_distribution)
            free = [s for s in free if s not in claimed]
        if index >= len(free):  # more drawn trials than strata (pruned or failed ones): plain random
            return self._uniform(param_name, param_distribution, self._offset(trial, param_name))
        stratum = free[index]
        u = (stratum + self._offset(trial, param_name)) / self._n
        value = self._uniform(param_name, param_distribution, u)
        upper = self._bounds.get(param_name)
        if upper is not None and upper in trial.params and isinstance(param_distribution, IntDistribution):
            # The caller resolves a draw that breaks the bound by raising `upper` to it (vLLM needs
            # maxNumBatchedTokens >= maxNumSeqs), which would undo `upper`'s stratum: about a third of
            # the smallest-budget draws were lost that way.  Keep this knob within it instead.
            value = max(min(value, int(trial.params[upper])), param_distribution.low)
        return value

    def _offset(self, trial: FrozenTrial, param_name: str) -> float:
        """Where in its stratum a start-up draw lies: seeded by the trial and the knob, so a trial cut
        off between two of its knobs draws the rest as it would have."""
        if self._seed is None:
            return self._rng.random()
        return random.Random(trial_seed(self._seed, trial.number, param_name)).random()

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if self._seed is not None and self._per_trial is not None:
            self._main = self._per_trial(trial_seed(self._seed, trial.number))
        self._main.before_trial(study, trial)

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        self._main.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._main.reseed_rng()
        self._rng = random.Random()

    # -- the hypercube --------------------------------------------------------------------
    def _claimed(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                 dist: BaseDistribution) -> set[int]:
        """Strata of this knob that enqueued trials (vLLM's defaults, the current engine) already
        measure: the draws fill the others, so no start-up trial repeats what trial 0 showed."""
        return {self._stratum_of(dist, t.params[param_name]) for t in self._earlier(study, trial)
                if not self._drawn(t) and t.state != TrialState.FAIL and param_name in t.params}

    def _stratum_of(self, dist: BaseDistribution, value: Any) -> int:
        """The stratum a value lies in: the inverse of `_uniform` (a discrete value: its middle)."""
        if isinstance(dist, CategoricalDistribution):
            u = (dist.choices.index(value) + 0.5) / len(dist.choices)
        elif isinstance(dist, IntDistribution) and dist.log:
            lo, hi = math.log(dist.low - 0.5), math.log(dist.high + 0.5)
            u = (math.log(value) - lo) / (hi - lo)
        elif isinstance(dist, IntDistribution) or (isinstance(dist, FloatDistribution) and dist.step is not None):
            step = dist.step or 1
            n_steps = int(round((dist.high - dist.low) / step)) + 1
            u = (round((value - dist.low) / step) + 0.5) / n_steps
        elif isinstance(dist, FloatDistribution) and dist.log:
            u = (math.log(value) - math.log(dist.low)) / (math.log(dist.high) - math.log(dist.low))
        elif isinstance(dist, FloatDistribution):
            u = (value - dist.low) / (dist.high - dist.low)
        else:
            raise TypeError(f"unsupported distribution {dist!r}")
        return min(max(int(u * self._n), 0), self._n - 1)

    def _permutation(self, param_name: str) -> list[int]:
        """Each knob's strata in its own seeded order (the same after a restart)."""
        order = list(range(self._n))
        random.Random(f"{self._seed}/{param_name}").shuffle(order)
        return order

    def _uniform(self, param_name: str, dist: BaseDistribution, u: float) -> Any:
        """The value at quantile `u` of the distribution's range, on its own scale."""
        if isinstance(dist, CategoricalDistribution):
            return dist.choices[min(int(u * len(dist.choices)), len(dist.choices) - 1)]
        if isinstance(dist, IntDistribution):
            if dist.log:
                lo, hi = math.log(dist.low - 0.5), math.log(dist.high + 0.5)  # log ints have low >= 1
                v = round(math.exp(lo + u * (hi - lo)))
            else:
                # Every step gets an equal share of [0, 1).
                n_steps = (dist.high - dist.low) // dist.step + 1
                v = dist.low + min(int(u * n_steps), n_steps - 1) * dist.step
            return int(min(max(v, dist.low), dist.high))
        if isinstance(dist, FloatDistribution):
            if dist.step is not None:
                n_steps = int(round((dist.high - dist.low) / dist.step)) + 1
                return min(dist.low + min(int(u * n_steps), n_steps - 1) * dist.step, dist.high)
            if dist.log:
                return math.exp(math.log(dist.low) + u * (math.log(dist.high) - math.log(dist.low)))
            return dist.low + u * (dist.high - dist.low)
        raise TypeError(f"{param_name}: unsupported distribution {dist!r}")
