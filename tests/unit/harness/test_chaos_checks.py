"""The chaos run's checkers and schedule (harness/chaos.py), on hand-made histories: each invariant is
seen broken when it is, and not when it is not (a checker that never fires would pass any chaos run)."""

from __future__ import annotations

from typing import Any

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from harness.chaos import KINDS, DeploymentLedger, check_trials, schedule


def deployment(name: str, generation: int, tokens: int, ready: int, replicas: int = 2) -> dict[str, Any]:
    args = ["--max-num-batched-tokens", str(tokens), "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256"]
    return {"metadata": {"name": name, "generation": generation, "resourceVersion": str(generation * 10 + ready)},
            "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"image": "vllm", "args": args}]}}},
            "status": {"readyReplicas": ready}}


def test_a_rollout_keeping_a_ready_pod_and_a_new_engine_per_generation_is_clean() -> None:
    ledger = DeploymentLedger()
    problems, excused = ledger.feed([("ADDED", deployment("steady", 1, 2048, 0)),
                                     ("MODIFIED", deployment("steady", 1, 2048, 2)),
                                     ("MODIFIED", deployment("steady", 2, 4096, 2)),
                                     ("MODIFIED", deployment("steady", 2, 4096, 1)),
                                     ("MODIFIED", deployment("steady", 3, 2048, 2))])  # back to an older engine
    assert (problems, excused) == ([], [])
    assert ledger.engines_applied["steady"] == {(2048.0, 0.9, 256.0), (4096.0, 0.9, 256.0)}


def test_zero_ready_replicas_after_some_were_ready_is_a_violation() -> None:
    ledger = DeploymentLedger()
    problems, _ = ledger.feed([("ADDED", deployment("steady", 1, 2048, 2)),
                               ("MODIFIED", deployment("steady", 2, 4096, 0))])
    assert len(problems) == 1 and "steady at zero ready replicas" in problems[0]


def test_zero_ready_after_a_node_took_every_ready_pod_is_excused_once() -> None:
    ledger = DeploymentLedger()
    ledger.feed([("ADDED", deployment("steady", 1, 2048, 2))])
    ledger.excuse("steady", "node kwok-0 went")
    problems, excused = ledger.feed([("MODIFIED", deployment("steady", 1, 2048, 0)),
                                     ("MODIFIED", deployment("steady", 1, 2048, 1))])
    assert problems == [] and excused == ["Deployment steady at zero ready replicas after node kwok-0 went"]
    problems, _ = ledger.feed([("MODIFIED", deployment("steady", 1, 2048, 0))])  # the excuse is spent
    assert len(problems) == 1


def test_writes_from_before_the_node_went_do_not_spend_its_excuse() -> None:
    """The watch delivers the writes before the fault after it is excused: a ready write among them is
    history, not the Deployment recovering (a 200-fault run reported the zero that followed)."""
    ledger = DeploymentLedger()
    ledger.feed([("ADDED", deployment("tuned", 1, 2048, 1, replicas=1))])  # resourceVersion 11
    ledger.excuse("tuned", "node kwok-5 went", after_version=11)
    problems, excused = ledger.feed([("MODIFIED", deployment("tuned", 1, 2048, 1, replicas=1)),  # rv 11 again
                                     ("MODIFIED", deployment("tuned", 2, 4096, 0, replicas=1))])  # rv 20
    assert problems == [] and excused == ["Deployment tuned at zero ready replicas after node kwok-5 went"]


def test_a_generation_that_applies_the_engine_in_force_again_is_a_violation() -> None:
    ledger = DeploymentLedger()
    problems, _ = ledger.feed([("ADDED", deployment("steady", 1, 2048, 2)),
                               ("MODIFIED", deployment("steady", 2, 2048, 2))])
    assert problems == ["Deployment steady generation 2 applied again the engine already in force at "
                        "generation 1: ('vllm', 2048.0, 0.9, 256.0)"]


def trial(number: int, state: TrialState, tokens: int, source: str = "sampler") -> optuna.trial.FrozenTrial:
    engine = {"maxNumBatchedTokens": tokens, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256}
    t = create_trial(state=state, value=1.0 if state is TrialState.COMPLETE else None,
                     params={"tokens": tokens}, distributions={"tokens": IntDistribution(1, 100000)},
                     user_attrs={"source": source, "engine": engine})
    t.number = number
    return t


def event(reason: str, number: int) -> dict[str, Any]:
    return {"reason": reason, "message": f"trial {number} (rolling): x", "count": 1}


APPLIED: set[tuple[float, ...]] = {(2048.0, 0.9, 256.0), (4096.0, 0.9, 256.0)}


def test_a_cut_trial_measured_again_is_clean() -> None:
    trials = [trial(0, TrialState.COMPLETE, 2048), trial(1, TrialState.FAIL, 4096),
              trial(2, TrialState.COMPLETE, 4096, "resume")]
    events = [event("TrialStarted", 0), event("TrialComplete", 0), event("TrialStarted", 1),
              event("TrialStarted", 2), event("TrialComplete", 2)]
    assert check_trials(trials, events, APPLIED) == []


def test_a_cut_trial_queued_again_by_its_engine_is_the_same_config_whatever_the_float() -> None:
    # The 200-fault run reported trial 2 lost: cut with the sampler's 0.8099999999999999, measured again
    # as 0.81 (the engine it had applied, queued whole).
    cut, again = trial(0, TrialState.FAIL, 4096), trial(1, TrialState.COMPLETE, 4096, "resume")
    cut.params = {"tokens": 4096, "util": 0.8099999999999999}
    again.params = {"tokens": 4096, "util": 0.81}
    cut.user_attrs["engine"] = {**cut.user_attrs["engine"], "gpuMemoryUtilization": 0.81}
    again.user_attrs["engine"] = {**again.user_attrs["engine"], "gpuMemoryUtilization": 0.81}
    assert check_trials([cut, again], [], APPLIED | {(4096.0, 0.81, 256.0)}) == []


def test_a_cut_trial_whose_re_measurement_has_just_been_asked_for_is_not_lost() -> None:
    # The 200-fault run on main reported trial 81 lost while trial 82, its re-measurement, was RUNNING
    # without its attributes written yet; the end-of-run check found it measured.
    asked = create_trial(state=TrialState.RUNNING, params={}, distributions={})
    asked.number = 1
    assert check_trials([trial(0, TrialState.FAIL, 4096), asked], [], APPLIED) == []


def test_a_cut_trial_whose_config_is_queued_but_not_yet_asked_for_is_not_lost() -> None:
    queued = create_trial(state=TrialState.WAITING, params={}, distributions={})
    queued.number = 1
    assert check_trials([trial(0, TrialState.FAIL, 4096), queued], [], APPLIED) == []


def test_a_lost_trial_a_told_trial_measured_again_and_double_events_are_violations() -> None:
    lost = [trial(0, TrialState.FAIL, 4096), trial(1, TrialState.COMPLETE, 2048)]
    assert check_trials(lost, [], APPLIED) == ["trial 0 was cut ({'tokens': 4096}) and never measured again"]
    twice = [trial(0, TrialState.COMPLETE, 4096), trial(1, TrialState.COMPLETE, 4096, "resume")]
    assert check_trials(twice, [], APPLIED) == [
        "trial 1 measured again trial 0's config, which was COMPLETE, not cut"]
    never_applied = [trial(0, TrialState.COMPLETE, 8192)]
    assert check_trials(never_applied, [], APPLIED) == [
        "trial 0 was measured on (8192.0, 0.9, 256.0), an engine never rolled out"]
    events = [event("TrialStarted", 0), event("TrialStarted", 0), event("TrialComplete", 0),
              event("TrialComplete", 0)]
    assert check_trials([trial(0, TrialState.COMPLETE, 2048)], events, APPLIED) == [
        "trial 0 started 2 times (Events)", "trial 0 told 2 times (Events)"]


def test_the_schedule_is_the_seeds_and_mixes_every_kind_in_each_round() -> None:
    plan = schedule(2 * len(KINDS) + 3, seed=7)
    assert plan == schedule(2 * len(KINDS) + 3, seed=7)
    assert plan != schedule(2 * len(KINDS) + 3, seed=8)
    for start in (0, len(KINDS)):
        assert sorted(f.kind for f in plan[start:start + len(KINDS)]) == sorted(KINDS)
    assert all(a.tokens != b.tokens for a, b in zip(plan, plan[1:], strict=False)), "each fault starts a rollout"
    assert [f.number for f in plan] == list(range(1, len(plan) + 1))


@pytest.mark.parametrize("kinds", [("operator-kill",), ("api-errors", "tuner-kill")])
def test_a_schedule_of_some_kinds_has_only_those(kinds: tuple[str, ...]) -> None:
    assert {f.kind for f in schedule(5, seed=1, kinds=kinds)} == set(kinds)
