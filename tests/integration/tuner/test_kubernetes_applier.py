"""The kubernetes applier against KMock with the real operator (`kopf run`) reconciling.

KMock has no Deployment controller: the test plays it by writing the Deployment's status, which
is what lets it check that the applier really waits for the operator's "rollout complete".
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

import harness.kmock_api as kmock_api
from harness.kmock_api import KMockAPI, OperatorProcess, wait_for
from kvpilot.api.vocabulary import ANNOTATION_TUNING_TRIAL as TRIAL_ANNOTATION
from kvpilot.api.vocabulary import FIELD_MANAGER_TUNER as FIELD_MANAGER
from kvpilot.api.vocabulary import TuningPhase
from kvpilot.tuner.adapters.kubernetes import KubernetesApplier, KubeStatusObserver
from kvpilot.tuner.core.fleetsize import Replicas
from kvpilot.tuner.core.loop import ApplyFailed
from kvpilot.tuner.core.space import EngineParams

pytestmark = pytest.mark.integration

NS = "tuning"


@attrs.define(kw_only=True)
class RecordingEmulator(kmock_api.KvpilotEmulator):
    """Also keeps every PATCH's query, content type and body."""

    patches: list[tuple[str, dict[str, str], str, bytes]] = attrs.field(factory=list)

    async def __call__(self, raw_request: Any) -> Any:
        if raw_request.method == "PATCH":
            body = await raw_request.read()
            self.patches.append((raw_request.path, dict(raw_request.query),
                                 raw_request.headers.get("Content-Type", ""), body))
        return await super().__call__(raw_request)


@pytest.fixture(scope="module")
def api() -> Iterator[KMockAPI]:
    mp = pytest.MonkeyPatch()
    mp.setattr(kmock_api, "KvpilotEmulator", RecordingEmulator)  # the harness builds this class
    try:
        with KMockAPI() as server:
            yield server
    finally:
        mp.undo()


def dep_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def engine_arg(dep: dict[str, Any], flag: str) -> str:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index(flag) + 1])


def play_deployment_controller(api: KMockAPI, name: str, **status: Any) -> None:
    generation = api.get(dep_path(name))["metadata"]["generation"]
    api.patch(dep_path(name) + "/status", {"status": {"observedGeneration": generation, **status}})


COMPLETE = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1,
            "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]}


def _isvc(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS, "labels": {"team": "search"},
                     "annotations": {"argocd.argoproj.io/sync-wave": "2"}},
        "spec": {
            "model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1,
            "engine": {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256,
                       "maxModelLen": 8192, "extraArgs": ["--enable-prefix-caching"]},
            "slo": {"ttftSeconds": 0.5, "itlSeconds": 0.05},
            "tuning": {"enabled": True, "maxTrials": 5},
        },
    }


@pytest.fixture(scope="module")
def ready(api: KMockAPI, operator: OperatorProcess) -> str:
    api.create_isvc(_isvc("llama"))
    wait_for(lambda: api.get_or_none(dep_path("llama")), what="the Deployment")
    play_deployment_controller(api, "llama", **COMPLETE)
    wait_for(lambda: api.get_isvc(NS, "llama").get("status", {}).get("readyReplicas") == 1, what="ready")
    return "llama"


def test_apply_changes_only_the_tuned_fields_and_waits_for_the_rollout(
    api: KMockAPI, client: Any, ready: str
) -> None:
    before = api.get_isvc(NS, ready)
    applier = KubernetesApplier(client, NS, ready, timeout_s=60, poll_s=0.1)
    assert applier.current() == EngineParams(2048, 0.9, 256)
    target = EngineParams(4096, 0.85, 128)
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            applier.apply(target, 3)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    wait_for(lambda: engine_arg(api.get(dep_path(ready)), "--max-num-batched-tokens") == "4096",
             what="the operator rolls the new template")
    # The operator is rolling out; until the Deployment says so, the applier keeps waiting.
    assert not done.wait(1.0), "apply returned before the rollout completed"
    play_deployment_controller(api, ready, **COMPLETE)
    assert done.wait(30), "apply did not return after the rollout completed"
    assert not errors, errors

    after = api.get_isvc(NS, ready)

    def annotations(obj: dict[str, Any]) -> dict[str, str]:
        # kopf's own bookkeeping (written by the operator after it handled the change) aside.
        return {k: v for k, v in obj["metadata"]["annotations"].items() if not k.endswith("last-handled-configuration")}

    assert annotations(after) == {**annotations(before), TRIAL_ANNOTATION: "3"}
    assert after["metadata"]["labels"] == before["metadata"]["labels"]
    expected = json.loads(json.dumps(before["spec"]))
    expected["engine"].update(maxNumBatchedTokens=4096, gpuMemoryUtilization=0.85, maxNumSeqs=128)
    assert after["spec"] == expected
    assert applier.current() == target

    # The write was a server-side apply by kvpilot-tuner holding only the tuned fields.
    ours = [p for p in api.emulator.patches
            if p[0].endswith(f"/inferenceservices/{ready}") and p[1].get("fieldManager") == FIELD_MANAGER]
    assert len(ours) == 1
    path, query, ctype, body = ours[0]
    assert query.get("force") == "true"
    assert ctype.startswith("application/apply-patch+yaml")
    sent = json.loads(body)
    assert sent["spec"] == {"engine": {"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128}}
    assert set(sent["metadata"]) == {"name", "namespace", "annotations"}
    assert sent["metadata"]["annotations"] == {TRIAL_ANNOTATION: "3"}


def test_a_rolled_back_config_is_a_failed_apply(api: KMockAPI, client: Any, ready: str) -> None:
    applier = KubernetesApplier(client, NS, ready, timeout_s=60, poll_s=0.1)
    errors: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            applier.apply(EngineParams(16384, 0.95, 1024), 4)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    wait_for(lambda: engine_arg(api.get(dep_path(ready)), "--max-num-batched-tokens") == "16384",
             what="the new template")
    play_deployment_controller(
        api, ready, replicas=2, updatedReplicas=1, readyReplicas=1, availableReplicas=1,
        conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                     "message": 'ReplicaSet "llama-x" has timed out progressing.'}],
    )
    assert done.wait(30), "apply did not give up after the operator rolled back"
    assert len(errors) == 1 and isinstance(errors[0], ApplyFailed), errors
    assert errors[0].reason == "RolloutFailed"


def test_status_and_events(api: KMockAPI, client: Any, ready: str) -> None:
    from kvpilot.tuner.core.study import Incumbent

    obs = KubeStatusObserver(client, NS, ready, study="tuning.llama.latency.abc")
    p = EngineParams(1024, 0.9, 64)
    obs.trial_started(7, p, "trial")
    obs.phase(TuningPhase.MEASURING, "WarmingUp", "trial 7")
    obs.best_changed(Incumbent(p, 0.42, 3.0, 7))
    obs.trial_finished(7, p, "pruned", None)
    tuning = wait_for(lambda: (api.get_isvc(NS, ready).get("status") or {}).get("tuning", {}).get("best"),
                      what="status.tuning.best") and api.get_isvc(NS, ready)["status"]["tuning"]
    assert tuning["phase"] == "Measuring" and tuning["trial"] == 7
    assert tuning["best"] == {"trial": 7, "value": 0.42, "params": p.as_spec()}
    events = [e for e in api.events(NS) if e.get("source", {}).get("component") == FIELD_MANAGER]
    assert [e["reason"] for e in events][-2:] == ["TrialStarted", "TrialPruned"]
    assert events[-1]["type"] == "Warning"
    assert events[-1]["involvedObject"]["name"] == ready


class _Flowing:
    """Signals that say traffic flows: this trial never gets as far as measuring."""

    def burn_rate(self, window_s: float) -> float:
        return 0.0

    def measure(self, window_s: float) -> Any:
        raise AssertionError("a config that could not start is never measured")


def test_an_engine_that_could_not_start_is_graded_by_vllms_numbers_and_raises_the_memory_floor(
    api: KMockAPI, client: Any, operator: OperatorProcess
) -> None:
    """The in-cluster path end to end: a trial's pod fails with vLLM's start-up error, the operator rolls
    it back at once and keeps vLLM's words in status.lastFailure, and the tuner's loop tells the study
    an infeasible trial with vLLM's memory figures, so its memory floor rules out what cannot start either."""
    import optuna

    from kvpilot.tuner.core.loop import LiveSettings, LiveTuner
    from kvpilot.tuner.core.objective import INFEASIBLE_VIOLATION, SLO, Goal
    from kvpilot.tuner.core.space import SearchSpace
    from kvpilot.tuner.core.study import ATTR_MEMORY, TunerStudy
    from tests.support.vllm_text import KV_SHORT, startup_failure_log, termination_message

    name = "qwen"
    api.create_isvc({**_isvc(name), "metadata": {"name": name, "namespace": NS}})
    wait_for(lambda: api.get_or_none(dep_path(name)), what="the Deployment")
    play_deployment_controller(api, name, **COMPLETE)
    wait_for(lambda: api.get_isvc(NS, name).get("status", {}).get("lastGoodEngine"), what="lastGoodEngine")
    good_hash = api.get(dep_path(name))["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/config-hash"]

    applier = KubernetesApplier(client, NS, name, timeout_s=60, poll_s=0.1)
    study = TunerStudy(storage=optuna.storages.InMemoryStorage(), name="qwen", goal=Goal.LATENCY,
                       space=SearchSpace(util_step=0.05), slo=SLO(), seed=0, n_trials=10)
    tuner = LiveTuner(study, applier, _Flowing(), LiveSettings(warmup_s=0, window_s=1))
    trial = EngineParams(2048, 0.75, 256)
    assert study.enqueue(trial, "test")
    number, params = study.ask()
    assert params == trial
    result: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(tuner.run_trial(number, params))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    dep = wait_for(lambda: (d := api.get(dep_path(name))) and engine_arg(d, "--gpu-memory-utilization") == "0.75"
                   and d, what="the trial's template")
    log = startup_failure_log(KV_SHORT)
    api.create_engine_pod(dep, f"{name}-trial-1", {
        "restartCount": 1, "ready": False, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": termination_message(log)}}},
        previous_log=log)
    # The loop then puts the starting engine back (a new generation): play its rollout to the end.
    wait_for(lambda: api.get_isvc(NS, name)["metadata"]["annotations"].get(TRIAL_ANNOTATION) == "restore",
             what="the tuner restoring its starting engine")
    restore_generation = api.get_isvc(NS, name)["metadata"]["generation"]
    wait_for(lambda: api.get_isvc(NS, name)["status"]["observedGeneration"] == restore_generation,
             what="the operator reconciling the restore")
    assert api.get(dep_path(name))["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/config-hash"] == \
        good_hash
    play_deployment_controller(api, name, **COMPLETE)
    worker.join(30)
    assert not worker.is_alive() and not errors, errors
    assert result == ["infeasible"]

    told = study.study.get_trials(deepcopy=False)[number]
    assert told.user_attrs["reason"] == "EngineStartupFailed"
    assert KV_SHORT in told.user_attrs["message"]
    memory = told.user_attrs[ATTR_MEMORY]
    assert memory["kind"] == "kv_short"
    assert memory["needed"] == pytest.approx(16.0 * 2**30) and memory["available"] == pytest.approx(3.64 * 2**30)
    # Graded (nearer than an unexplained failure), and the floor now rules the failed fraction out.
    assert 0 < max(told.constraints.values()) < INFEASIBLE_VIOLATION
    assert study.util_floor()(2048, 256) > 0.75


def test_the_replica_count_read_for_trial_windows_follows_spec_and_the_deployments_ready_pods(
    api: KMockAPI, client: Any, operator: OperatorProcess
) -> None:
    # FleetSize: the loop leaves out a window in which this reading moved; spec.replicas moves first
    # (an HPA or kubectl scale), the ready count once the Deployment's pods serve (copied by the operator).
    obj = _isvc("scaled")
    obj["spec"]["replicas"] = 2
    api.create_isvc(obj)
    wait_for(lambda: api.get_or_none(dep_path("scaled")), what="the Deployment")
    play_deployment_controller(api, "scaled", **{**COMPLETE, "replicas": 2, "updatedReplicas": 2,
                                                  "readyReplicas": 2, "availableReplicas": 2})
    applier = KubernetesApplier(client, NS, "scaled", timeout_s=60, poll_s=0.1)
    wait_for(lambda: applier.replicas() == Replicas(2, 2), what="2 of 2 ready")
    api.patch(api.isvc_path(NS, "scaled"), {"spec": {"replicas": 3}})
    assert applier.replicas() == Replicas(3, 2)
    wait_for(lambda: api.get(dep_path("scaled"))["spec"]["replicas"] == 3, what="the operator scales the Deployment")
    play_deployment_controller(api, "scaled", **{**COMPLETE, "replicas": 3, "updatedReplicas": 3,
                                                  "readyReplicas": 3, "availableReplicas": 3})
    wait_for(lambda: applier.replicas() == Replicas(3, 3), what="3 of 3 ready")
