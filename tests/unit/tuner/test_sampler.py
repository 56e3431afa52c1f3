"""The sampler: a Latin hypercube start (every stratum of every knob once), then TPE."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pytest

from kvpilot.tuner.core.sampler import LatinHypercubeStart, make_sampler, startup_trials
from kvpilot.tuner.core.space import LOG2_PREFIX, PARAM_TOKENS, SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _sampler(n: int, seed: int = 0) -> LatinHypercubeStart:
    return LatinHypercubeStart(optuna.samplers.TPESampler(seed=seed, n_startup_trials=n), n_startup_trials=n, seed=seed)


def _draw(study: optuna.Study, k: int) -> list[dict[str, float]]:
    out = []
    for _ in range(k):
        t = study.ask()
        p = {
            "x": t.suggest_float("x", 0.0, 1.0),
            "n": t.suggest_int("n", 1, 1000, log=True),
            "u": t.suggest_float("u", 0.70, 0.95, step=0.01),
        }
        study.tell(t, p["x"] + p["u"])
        out.append(p)
    return out


def _strata(values: list[float], lo: float, hi: float, n: int) -> list[int]:
    return sorted(min(int((v - lo) / (hi - lo) * n), n - 1) for v in values)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_startup_puts_one_draw_in_every_stratum_of_every_knob(seed: int) -> None:
    n = 5
    draws = _draw(optuna.create_study(sampler=_sampler(n, seed)), n)
    assert _strata([d["x"] for d in draws], 0.0, 1.0, n) == list(range(n))
    # A log-scale integer is stratified on the log scale.
    logs = [math.log(d["n"]) for d in draws]
    assert _strata(logs, math.log(0.5), math.log(1000.5), n) == list(range(n))
    for d in draws:
        assert 1 <= d["n"] <= 1000 and 0.70 <= d["u"] <= 0.95
        assert round(d["u"] * 100) == pytest.approx(d["u"] * 100)  # on its 0.01 step


def test_enqueued_trials_count_towards_startup_but_take_no_stratum() -> None:
    n = 4
    study = optuna.create_study(sampler=LatinHypercubeStart(
        optuna.samplers.TPESampler(seed=0, n_startup_trials=n), n_startup_trials=n, seed=0,
        drawn=lambda t: "source" not in t.user_attrs))
    study.enqueue_trial({"x": 0.01, "n": 10, "u": 0.9}, user_attrs={"source": "current"})
    first = _draw(study, 1)[0]
    assert first["x"] == 0.01  # the enqueued one
    drawn = _draw(study, n - 1)
    # 3 drawn start-up trials: distinct strata, the 4th stratum would have been the next draw.
    assert len(set(_strata([d["x"] for d in drawn], 0.0, 1.0, n))) == n - 1


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_claimed_strata_leave_the_draws_the_strata_the_enqueued_trial_did_not_measure(seed: int) -> None:
    """vLLM's defaults as trial 0 measure one stratum of every knob: with `claim`, the start-up
    draws fill the other n - 1 of each, so together the n start-up trials cover every stratum."""
    n = 4
    study = optuna.create_study(sampler=LatinHypercubeStart(
        optuna.samplers.TPESampler(seed=seed, n_startup_trials=n), n_startup_trials=n, seed=seed,
        drawn=lambda t: "source" not in t.user_attrs, claim=True))
    study.enqueue_trial({"x": 0.01, "n": 900, "u": 0.80}, user_attrs={"source": "vllmDefaults"})
    trials = _draw(study, n)
    assert trials[0]["x"] == 0.01
    assert _strata([d["x"] for d in trials], 0.0, 1.0, n) == list(range(n))
    logs = [math.log(d["n"]) for d in trials]
    assert _strata(logs, math.log(0.5), math.log(1000.5), n) == list(range(n))
    # The fraction is discrete (0.70..0.95 by 0.01, 26 values): each value's stratum is its middle's.
    assert _strata([(round((d["u"] - 0.70) / 0.01) + 0.5) / 26 for d in trials], 0.0, 1.0, n) == list(range(n))


def test_without_claim_the_draws_may_repeat_the_enqueued_trials_stratum() -> None:
    """The same study without `claim`: some seed's draws measure trial 0's stratum again (the
    behaviour `claim` removes; if no seed did, the test above would prove nothing)."""
    n = 4
    repeats = 0
    for seed in range(10):
        study = optuna.create_study(sampler=LatinHypercubeStart(
            optuna.samplers.TPESampler(seed=seed, n_startup_trials=n), n_startup_trials=n, seed=seed,
            drawn=lambda t: "source" not in t.user_attrs))
        study.enqueue_trial({"x": 0.01, "n": 900, "u": 0.80}, user_attrs={"source": "vllmDefaults"})
        trials = _draw(study, n)
        repeats += _strata([d["x"] for d in trials], 0.0, 1.0, n) != list(range(n))
    assert repeats > 0


def test_a_resumed_study_continues_the_same_hypercube(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    n = 6
    before = _draw(optuna.create_study(storage=url, study_name="s", sampler=_sampler(n, 3)), 2)
    resumed = optuna.create_study(storage=url, study_name="s", sampler=_sampler(n, 3), load_if_exists=True)
    after = _draw(resumed, n - 2)
    assert _strata([d["x"] for d in before + after], 0.0, 1.0, n) == list(range(n))


def test_the_token_budget_exponents_are_spread_over_the_pow2_range() -> None:
    """On the benchmark's pow2 space (exponents 8..14), the start-up draws spread over the range."""
    space = SearchSpace(scale="pow2", util_step=0.05)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(0, 20))
    assert startup_trials(20) == 6
    exps = []
    for _ in range(startup_trials(20)):
        t = study.ask(space.distributions())
        exps.append(t.params[LOG2_PREFIX + PARAM_TOKENS])
        study.tell(t, 1.0)
    assert len(set(exps)) >= 5  # 6 strata of 7 exponents: at most one repeat
    assert min(exps) <= 9 and max(exps) >= 13


def test_after_startup_tpe_draws_near_the_good_region() -> None:
    """A one-knob landscape: after the start-up, TPE proposes near the optimum far more often than
    uniform draws would (30% of them land within 0.15 of it)."""
    study = optuna.create_study(direction="maximize", sampler=_sampler(5, 2))

    def objective(t: optuna.Trial) -> float:
        return -abs(t.suggest_float("x", 0.0, 1.0) - 0.3)

    study.optimize(objective, n_trials=25)
    late = [t.params["x"] for t in study.trials[10:]]
    assert sum(abs(x - 0.3) < 0.15 for x in late) >= 0.6 * len(late)


def test_unknown_sampler_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="expected one of tpe, random"):
        make_sampler(0, 20, "cmaes")


def _startup_budgets(space: SearchSpace, seed: int, bounded: bool) -> list[tuple[int, int]]:
    """(drawn, applied) token budget of each start-up trial on a pow2 space: `resolve` raises the
    budget to the cap where the cap is larger."""
    study = optuna.create_study(direction="maximize", sampler=make_sampler(
        seed, 20, bounds=space.bounds() if bounded else None))
    out = []
    for _ in range(startup_trials(20)):
        t = study.ask(space.distributions())
        p = space.resolve(t.params)
        assert p.max_num_seqs <= p.max_num_batched_tokens
        out.append((2 ** t.params[LOG2_PREFIX + PARAM_TOKENS], p.max_num_batched_tokens))
        study.tell(t, 1.0)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_bounded_startup_applies_the_token_budgets_it_draws(seed: int) -> None:
    """With the cap kept within the drawn budget, the clamp never raises a start-up budget: each
    stratum of the budget (the knob that matters most) is applied as drawn."""
    space = SearchSpace(scale="pow2", util_step=0.05)
    budgets = _startup_budgets(space, seed, bounded=True)
    assert all(drawn == applied for drawn, applied in budgets)


def test_unbounded_startup_loses_small_budgets_to_the_clamp() -> None:
    """Without the bound, some seed's small-budget draw is raised to its cap: the behaviour the
    bound removes (if no seed lost one, the test above would prove nothing)."""
    space = SearchSpace(scale="pow2", util_step=0.05)
    raised = sum(drawn != applied for seed in range(8) for drawn, applied in _startup_budgets(space, seed, False))
    assert raised > 0


def test_a_study_resumed_by_a_new_process_draws_what_the_uninterrupted_one_drew(tmp_path: Path) -> None:
    """Start-up and TPE draws alike: each trial's draws are seeded by its number, so a sampler made
    afresh (the process killed and started again) continues with the draws the first would have made."""
    space = SearchSpace()

    def draw(study: optuna.Study, k: int) -> list[dict[str, float]]:
        out = []
        for _ in range(k):
            t = study.ask(space.distributions())
            study.tell(t, t.params[PARAM_TOKENS] / 1000 - abs(t.params["gpuMemoryUtilization"] - 0.85))
            out.append(dict(t.params))
        return out

    n = 12  # startup_trials(12) == 4: the last 8 draws are TPE's
    whole = draw(optuna.create_study(direction="maximize", sampler=make_sampler(5, n)), n)
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = draw(optuna.create_study(storage=url, study_name="s", direction="maximize", sampler=make_sampler(5, n)), 2)
    rest = draw(optuna.create_study(storage=url, study_name="s", direction="maximize", sampler=make_sampler(5, n),
                                    load_if_exists=True), n - 2)
    assert first + rest == whole
