"""The in-cluster tuner against an API server that fails: each transient error class injected into
KMock (harness/kmock_api.py `fail`) during a trial's apply, during putting back the best
engine, past the client's retries, and a tuner restarted in the middle of a trial.

Nothing here runs the operator: `RolloutPlayer` plays its part of the contract the applier reads
(status.observedGeneration and Progressing=False/RolloutComplete for the new generation, see
`rollout_state`; the real operator against the same applier is tests/.../test_kubernetes_applier.py),
and records every generation's engine, i.e. every rollout a trial cost.  The loop runs on a
virtual clock (harness/tuning_world.py) with signals read from the engine in KMock's spec, so
only the API calls take real time.  Waits the client asks for are recorded, not slept: Retry-After
is checked by what the client asked to wait and by the order of the requests KMock recorded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kopf
import optuna
import pytest
from optuna.trial import TrialState
from prometheus_client import CollectorRegistry

from harness.kmock_api import Fault, FaultRule, KMockAPI, wait_for
from harness.tuning_world import VirtualClock, default_latency
from kvpilot.api.vocabulary import ANNOTATION_TUNING_TRIAL, FIELD_MANAGER_TUNER
from kvpilot.tuner.adapters.kubernetes import KubernetesApplier
from kvpilot.tuner.core.loop import ApplyFailed, LiveSettings, LiveTuner, SignalsUnavailable
from kvpilot.tuner.core.objective import SLO, Goal, Measurement
from kvpilot.tuner.core.space import EngineParams, SearchSpace
from kvpilot.tuner.core.study import TunerStudy
from kvpilot.tuner.incluster import Worker
from kvpilot.tuner.kubeapi import ApiError, KubeAPI, RetryPolicy
from kvpilot.tuner.observe import TunerMetrics

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
NS = "faults"
START = EngineParams(2048, 0.90, 256)
BAD = EngineParams(16384, 0.80, 1024)  # burns the error budget: pruned, the best put back
AGENT = "kvpilot-tuner"  # faults hit only the tuner's requests, not the test's own

# Each fault class, as the API server (or the network in front of it) answers it.
FAULTS: dict[str, list[Fault]] = {
    "409": [Fault(409)],
    "429-retry-after": [Fault(429, retry_after=2)],
    "500": [Fault(500)],
    "503-twice": [Fault(503), Fault(503)],
    "timeout": [Fault(stall=6.0)],  # the client gives up after CLIENT_TIMEOUT_S
    "reset": [Fault(0)],  # the connection dropped without an answer
}


def fail_tuner(api: KMockAPI, method: str, path: str, *faults: Fault) -> FaultRule:
    """Fault the tuner's own requests only (the test's helpers and stand-ins talk to KMock too)."""
    return api.fail(method, path, *faults, agent=AGENT)



class Waits:
    """The client's sleeps: each wait asked for, with how many PATCHes of the service KMock had
    seen by then (when `name` is set)."""

    def __init__(self, api: KMockAPI, name: str = "") -> None:
        self.api, self.name = api, name
        self.asked: list[tuple[float, int]] = []

    def __call__(self, seconds: float) -> None:
        self.asked.append((seconds, len(tuner_calls(self.api, "PATCH", self.name)) if self.name else -1))

    @property
    def seconds(self) -> list[float]:
        return [s for s, _ in self.asked]


# Long enough that no unfaulted call times out on a loaded machine (that would add a retry the
# test does not expect), short enough for the timeout fault to cost a few seconds.
CLIENT_TIMEOUT_S = 2.0


def client(api: KMockAPI, waits: Waits, attempts: int = 9) -> KubeAPI:
    return KubeAPI(kopf.ConnectionInfo(server=api.url), timeout_s=CLIENT_TIMEOUT_S,
                   retry=RetryPolicy(attempts=attempts, sleep=waits))


class RolloutPlayer:
    """The operator's side of a rollout, as the applier reads it; records each generation's engine."""

    def __init__(self, api: KMockAPI, name: str) -> None:
        self.api, self.name = api, name
        self.rollouts: list[EngineParams] = []
        self.hold: Callable[[EngineParams], bool] = lambda engine: False  # rollouts held back while true
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RolloutPlayer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            obj = self.api.get_isvc(NS, self.name)
            generation = obj["metadata"]["generation"]
            if (obj.get("status") or {}).get("observedGeneration") == generation:
                continue
            engine = EngineParams.from_spec(obj["spec"]["engine"])
            if self.hold(engine):
                continue
            if generation > 1:
                self.rollouts.append(engine)
            self.api.patch(self.api.isvc_path(NS, self.name) + "/status", {"status": {
                "observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
                "conditions": [{"type": "Progressing", "status": "False", "reason": "RolloutComplete",
                                "message": "every replica updated and ready"}]}})


class Writes:
    """The engine in the service's spec right after each write to it (KMock `after` hooks, one per
    write), i.e. every engine the tuner put in force, in order.  `on_write(n)` runs after the n-th."""

    def __init__(self, api: KMockAPI, name: str, on_write: Callable[[int], None] = lambda n: None) -> None:
        self.api, self.name, self.on_write = api, name, on_write
        self.engines: list[EngineParams] = []
        self._arm()

    def _arm(self) -> None:
        self.api.after("PATCH", rf"/inferenceservices/{self.name}$", self._written)

    def _written(self) -> None:
        self.engines.append(EngineParams.from_spec(self.api.get_isvc(NS, self.name)["spec"]["engine"]))
        self._arm()
        self.on_write(len(self.engines))


class KubeSignals:
    """Signals from the engine in force in KMock's spec (so a config the tuner failed to put back
    burns on): BAD burns, anything else is judged by harness/tuning_world.py's latency model at a steady load."""

    selector = ""

    def __init__(self, api: KMockAPI, name: str, on_burn: Any = None) -> None:
        self.api, self.name, self.on_burn = api, name, on_burn

    def engine(self) -> EngineParams:
        return EngineParams.from_spec(self.api.get_isvc(NS, self.name)["spec"]["engine"])

    def burn_rate(self, window_s: float) -> float:
        if self.engine() == BAD:
            if self.on_burn is not None:
                self.on_burn()
                self.on_burn = None
            return 60.0
        return 0.2

    def measure(self, window_s: float) -> Measurement:
        ttft, itl = default_latency(self.engine(), 5.0)
        return Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=5.0, burn_rate=0.2)

    def request_rate(self, window_s: float) -> float:  # the warm start's workload estimate: none here
        raise SignalsUnavailable("NoData", "no workload history in this test")


def new_isvc(api: KMockAPI, max_trials: int = 3) -> str:
    name = f"svc-{uuid.uuid4().hex[:6]}"
    api.create_isvc({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1, "engine": START.as_spec(),
                 "slo": {"ttftSeconds": 0.5, "itlSeconds": 0.05},
                 "tuning": {"enabled": True, "maxTrials": max_trials, "trialSeconds": 60, "warmupSeconds": 10}},
    })
    return name


def tuner_calls(api: KMockAPI, method: str, name: str) -> list[int]:
    """Indexes in KMock's record of the tuner's `method` requests on the InferenceService itself."""
    path = api.isvc_path(NS, name)
    return [i for i, (m, p) in enumerate(api.calls) if m == method and p == path]


def in_force(api: KMockAPI, name: str) -> tuple[EngineParams, str]:
    obj = api.get_isvc(NS, name)
    return EngineParams.from_spec(obj["spec"]["engine"]), obj["metadata"]["annotations"][ANNOTATION_TUNING_TRIAL]


SETTINGS = LiveSettings(warmup_s=10, window_s=60, poll_s=5, pause_poll_s=5, fast_burn_window_s=30, max_trials=4)


def live_tuner(api: KMockAPI, kube: KubeAPI, name: str, storage: Any, signals: KubeSignals,
               settings: LiveSettings = SETTINGS) -> LiveTuner:
    study = TunerStudy(storage=storage, name=name, goal=Goal.LATENCY, space=SearchSpace(), slo=SLO(0.5, 0.05),
                       seed=0, n_trials=settings.max_trials)
    study.enqueue(START, "current")
    applier = KubernetesApplier(kube, NS, name, timeout_s=30, poll_s=0.02)
    return LiveTuner(study, applier, signals, settings, clock=VirtualClock())


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_trials_apply_rides_out_a_transient_error(api: KMockAPI, fault: str) -> None:
    name = new_isvc(api)
    waits = Waits(api, name)
    applier = KubernetesApplier(client(api, waits), NS, name, timeout_s=30, poll_s=0.02)
    target = EngineParams(4096, 0.85, 128)
    injected = fail_tuner(api, "PATCH", rf"/inferenceservices/{name}$", *FAULTS[fault])
    with RolloutPlayer(api, name) as player:
        applier.apply(target, 1)
    assert in_force(api, name) == (target, "1")
    assert player.rollouts == [target]
    assert len(injected.served) == len(FAULTS[fault])
    assert waits.seconds == WAITS[fault]
    # Each refused apply was sent once more, and only after the wait: at the k-th wait KMock had
    # seen k PATCHes (all refused), so the client waited as asked (for a 429, the Retry-After)
    # before sending again.
    assert len(tuner_calls(api, "PATCH", name)) == len(injected.served) + 1
    assert [seen for _, seen in waits.asked] == list(range(1, len(injected.served) + 1))


def test_a_refused_config_is_not_retried(api: KMockAPI) -> None:
    """422 Invalid is the API's (or its admission webhook's) answer to the config: the trial is
    infeasible at once, as before."""
    name = new_isvc(api)
    waits = Waits(api, name)
    applier = KubernetesApplier(client(api, waits), NS, name, timeout_s=30, poll_s=0.02)
    fail_tuner(api, "PATCH", rf"/inferenceservices/{name}$", Fault(422))
    with pytest.raises(ApplyFailed) as refused:
        applier.apply(EngineParams(4096, 0.85, 128), 1)
    assert refused.value.reason == "Invalid"
    assert waits.asked == [] and len(tuner_calls(api, "PATCH", name)) == 1
# What the client waits before each try again (RetryPolicy: 0.5 s doubling; never under Retry-After).
WAITS = {"409": [0.5], "429-retry-after": [2.0], "500": [0.5], "503-twice": [0.5, 1.0], "timeout": [0.5],
         "reset": [0.5]}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_putting_back_the_best_rides_out_a_transient_error_and_the_study_converges(
    api: KMockAPI, fault: str
) -> None:
    name = new_isvc(api)
    waits = Waits(api)
    armed: list[Any] = []
    path = rf"/inferenceservices/{name}$"
    # The moment the tuner sees BAD burn, its next write to the service is the put-back: fail it.
    signals = KubeSignals(api, name, on_burn=lambda: armed.append(
        fail_tuner(api, "PATCH", path, *FAULTS[fault])))
    tuner = live_tuner(api, client(api, waits), name, None, signals)
    tuner.study.enqueue(BAD, "planted")
    with RolloutPlayer(api, name) as player:
        best = tuner.run()
    study = tuner.study
    assert armed and len(armed[0].served) == len(FAULTS[fault])
    assert waits.seconds == WAITS[fault]
    pruned = [t for t in study.trials() if t.state is TrialState.PRUNED]
    assert [study.engine_of(t) for t in pruned] == [BAD]
    assert player.rollouts[player.rollouts.index(BAD) + 1] == START  # put back right after the prune
    assert study.finished_count() == SETTINGS.max_trials  # the study went on to its budget
    inc = study.incumbent
    assert inc is not None and best == inc.params and in_force(api, name)[0] == best


def test_a_loop_that_gives_up_puts_the_best_engine_back(api: KMockAPI) -> None:
    """The API server stays down past the client's retries while a trial's rollout is awaited: the
    loop gives up, and the trial's engine is not left in force."""
    name = new_isvc(api)
    waits = Waits(api)
    tuner = live_tuner(api, client(api, waits, attempts=3), name, None, KubeSignals(api, name))
    trial_engine = EngineParams(4096, 0.85, 128)
    tuner.study.enqueue(trial_engine, "planted")
    with RolloutPlayer(api, name) as player:
        n0, p0 = tuner.study.ask()
        tuner.run_trial(n0, p0)  # START: the incumbent
        # Right after the trial's engine is written, every read of the service fails three times:
        # all the tries the client has.  The put-back's reads then get through.
        writes = Writes(api, name, lambda n: fail_tuner(api, "GET", rf"/inferenceservices/{name}$",
                                                        *[Fault(503)] * 3) if n == 1 else None)
        with pytest.raises(ApiError) as raised:
            tuner.run()
    assert raised.value.status == 503
    assert writes.engines == [trial_engine, START]
    assert in_force(api, name) == (START, "restore")
    assert player.rollouts[-1] == START
    assert tuner.put_back_failed is None


class ScriptedWorker(Worker):
    """The in-cluster worker with KMock's signals and a virtual clock; restarts after 0.05 s."""

    RESTART_BASE_S = 0.05

    def __init__(self, kmock: KMockAPI, kube: KubeAPI, obj: dict[str, Any], storage: str) -> None:
        args = Namespace(storage=storage, prometheus="http://127.0.0.1:9", poll=5.0)
        super().__init__(kube, obj, args, TunerMetrics(CollectorRegistry()))
        self.kmock = kmock

    def _signals(self, slo: SLO) -> Any:
        return KubeSignals(self.kmock, self.name)

    def _clock(self) -> Any:
        return VirtualClock()


def test_a_worker_stopped_while_it_waits_to_start_again_ends(api: KMockAPI, tmp_path: Path) -> None:
    name = new_isvc(api)
    worker = ScriptedWorker(api, client(api, Waits(api), attempts=1), api.get_isvc(NS, name),
                            f"sqlite:///{tmp_path / 'tuner.db'}")
    worker.RESTART_BASE_S = 3600.0  # were it not woken, it would wait an hour
    fail_tuner(api, "GET", rf"/inferenceservices/{name}$", Fault(503))  # its first read of the service
    worker.start()
    wait_for(lambda: worker.restarts == 1, what="the worker to fail once")
    assert not worker.finished
    worker.stop()  # tuning switched off
    worker.thread.join(30)
    assert not worker.thread.is_alive() and worker.finished and worker.restarts == 1
    tuning = api.get_isvc(NS, name)["status"]["tuning"]
    assert tuning["phase"] == "Failed" and "the engine was not changed by this start" in tuning["message"]


def test_a_worker_failed_by_an_api_error_logs_its_words_without_a_traceback(
        api: KMockAPI, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As an API server answers while its RBAC cache fills after a restart (a chaos run saw it): a 403
    the client does not retry fails the start; the log says so in the API's words, with no traceback."""
    name = new_isvc(api)
    worker = ScriptedWorker(api, client(api, Waits(api), attempts=1), api.get_isvc(NS, name),
                            f"sqlite:///{tmp_path / 'tuner.db'}")
    worker.RESTART_BASE_S = 3600.0
    fail_tuner(api, "GET", rf"/inferenceservices/{name}$", Fault(403))
    with caplog.at_level("ERROR", logger="kvpilot.tuner"):
        worker.start()
        wait_for(lambda: worker.restarts == 1, what="the worker to fail once")
        worker.stop()
        worker.thread.join(30)
    (failed,) = [r for r in caplog.records if "failed; starting again" in r.getMessage()]
    assert not failed.exc_info, "a traceback for an API error"
    assert "403" in failed.getMessage()


def test_a_worker_for_a_spec_no_restart_can_fix_ends_without_restarting(api: KMockAPI) -> None:
    name = new_isvc(api)
    obj = api.get_isvc(NS, name)
    # A storage URL no driver reads: the tuner's own configuration, which no restart can fix.
    worker = ScriptedWorker(api, client(api, Waits(api)), obj, "nosuchdb://study")
    worker.start()
    worker.thread.join(30)
    assert worker.finished and worker.restarts == 0


class BackOffWorker(ScriptedWorker):
    """A ScriptedWorker whose back-off lasts until the test ends it (the spec changes in between)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.backing_off, self.resume = threading.Event(), threading.Event()

    def _back_off(self, delay: float) -> None:
        self.backing_off.set()
        self.resume.wait(30)


def test_a_worker_in_back_off_starts_again_on_the_spec_as_it_is_then(api: KMockAPI, tmp_path: Path) -> None:
    """Its first start fails; while it waits to start again, maxTrials goes from 3 to 2: the next start
    runs 2 trials (the worker began with 3, and kept that spec before)."""
    name = new_isvc(api, max_trials=3)
    storage = f"sqlite:///{tmp_path / 'tuner.db'}"
    worker = BackOffWorker(api, client(api, Waits(api), attempts=1), api.get_isvc(NS, name), storage)
    fail_tuner(api, "GET", rf"/inferenceservices/{name}$", Fault(503))  # its first read of the service
    with RolloutPlayer(api, name):
        worker.start()
        try:
            wait_for(worker.backing_off.is_set, what="the worker waiting to start again")
            api.patch(api.isvc_path(NS, name), {"spec": {"tuning": {"maxTrials": 2}}})
            worker.resume.set()
            wait_for(lambda: worker.finished, timeout=60, what="the worker to finish its study")
        finally:
            worker.stop()
            worker.resume.set()
            worker.thread.join(30)
    assert worker.restarts == 1
    status = api.get_isvc(NS, name)["status"]["tuning"]
    assert status["phase"] == "Done", status
    study = optuna.load_study(study_name=status["study"], storage=storage)
    done = [t for t in study.trials if t.state is TrialState.COMPLETE and t.user_attrs.get("kind") == "trial"]
    assert len(done) == 2


@pytest.mark.parametrize(("failed_reads", "reason", "said"), [
    (3, "TuningFailed", "the best engine known is in force"),
    # The put-back's reads fail too: the next start puts the best back before any trial.
    (6, "RestoreFailed", "the next start puts it back before any trial"),
])
def test_a_worker_whose_loop_fails_puts_back_the_best_says_so_and_starts_again(
    api: KMockAPI, tmp_path: Path, failed_reads: int, reason: str, said: str
) -> None:
    name = new_isvc(api, max_trials=3)
    waits = Waits(api)
    kube = client(api, waits, attempts=3)
    storage = f"sqlite:///{tmp_path / 'tuner.db'}"
    obj = api.get_isvc(NS, name)
    # During the first trial after the starting engine's, reads fail past the client's 3 tries.
    writes = Writes(api, name, lambda n: fail_tuner(api, "GET", rf"/inferenceservices/{name}$",
                                                    *[Fault(503)] * failed_reads) if n == 2 else None)
    worker = ScriptedWorker(api, kube, obj, storage)
    with RolloutPlayer(api, name) as player:
        worker.start()
        try:
            wait_for(lambda: worker.finished, timeout=60, what="the worker to finish its study")
        finally:
            worker.stop()
            worker.thread.join(30)
    assert worker.restarts == 1
    status = api.get_isvc(NS, name)["status"]["tuning"]
    assert status["phase"] == "Done", status
    events = [e for e in api.events(NS) if e["involvedObject"]["name"] == name
              and e.get("source", {}).get("component") == FIELD_MANAGER_TUNER]
    failed = [e for e in events if e["reason"] in ("TuningFailed", "RestoreFailed")]
    assert [(e["reason"], e["type"]) for e in failed] == [(reason, "Warning")]
    assert "503" in failed[0]["message"] and said in failed[0]["message"]
    assert "restart 1" in failed[0]["message"]
    study = optuna.load_study(study_name=status["study"], storage=storage)
    cut = [t for t in study.trials if t.state is TrialState.FAIL]
    assert len(cut) == 1
    cut_engine = EngineParams.from_spec(cut[0].user_attrs["engine"])
    # The cut trial's engine was put back to START (at once, or first thing on the restart when the
    # API server refused that too), then measured again after the restart.
    assert writes.engines[:4] == [START, cut_engine, START, cut_engine]
    assert player.rollouts[-1] == writes.engines[-1]
    resumed = [t for t in study.trials if t.user_attrs.get("source") == "resume"]
    assert len(resumed) == 1 and resumed[0].state is TrialState.COMPLETE
    assert EngineParams.from_spec(resumed[0].user_attrs["engine"]) == cut_engine
    done = [t for t in study.trials if t.state is TrialState.COMPLETE and t.user_attrs.get("kind") == "trial"]
    assert len(done) == 3
    told = [e["message"].split()[1] for e in events if e["reason"] == "TrialComplete"]
    assert sorted(told) == sorted(str(t.number) for t in done)  # each trial told once


def rollouts_after(tuner: LiveTuner, number: int, best: EngineParams) -> list[EngineParams]:
    """The rollouts a tuner makes after trial `number`: each later trial's engine, then the best put
    back unless the last trial's engine is the best (the cut trial may well be the best: a count of
    its rollouts says nothing about the resume)."""
    engines = [tuner.study.engine_of(t) for t in tuner.study.study.trials if t.number > number]
    return engines + [best] if engines and engines[-1] != best else engines


class Killed(BaseException):
    """The tuner process dying (SIGKILL, OOM): nothing runs after it, no put-back, no tell."""


def test_a_tuner_killed_mid_trial_resumes_that_trial_in_place(api: KMockAPI, tmp_path: Path) -> None:
    name = new_isvc(api)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'tuner.db'}")
    waits = Waits(api)
    kube = client(api, waits)
    measured: list[EngineParams] = []

    class DiesOnSecondMeasure(KubeSignals):
        """Dies measuring the second engine (the first's own windows, confirming included, go through)."""

        def measure(self, window_s: float) -> Measurement:
            engine = self.engine()
            if measured and engine != measured[0]:
                raise Killed()
            measured.append(engine)
            return super().measure(window_s)

    with RolloutPlayer(api, name) as player:
        first = live_tuner(api, kube, name, storage, DiesOnSecondMeasure(api, name))
        with pytest.raises(Killed):
            first.run()
        before = {t.number: (t.state, t.value) for t in first.study.study.trials}
        cut_engine = in_force(api, name)[0]
        assert cut_engine != START
        rolled_before = len(player.rollouts)
        # A new tuner on the same storage, as a restarted pod would be.
        second = live_tuner(api, kube, name, storage, KubeSignals(api, name))
        best = second.run()
    trials = second.study.study.trials
    cut = [t for t in trials if t.state is TrialState.FAIL]
    assert len(cut) == 1 and second.study.engine_of(cut[0]) == cut_engine
    resumed = [t for t in trials if t.user_attrs.get("source") == "resume"]
    assert len(resumed) == 1 and resumed[0].state is TrialState.COMPLETE
    assert resumed[0].number == cut[0].number + 1  # the first trial the new tuner ran
    # Nothing lost: what the first tuner told stands as it was.
    for number, (state, value) in before.items():
        if state is TrialState.COMPLETE:
            assert (trials[number].state, trials[number].value) == (state, value)
    # The resumed trial's apply wrote the same fields (no new generation): the second tuner rolled out
    # only its later trials and, at the end, the best put back.
    assert player.rollouts[:rolled_before] == [cut_engine]
    assert player.rollouts[rolled_before:] == rollouts_after(second, resumed[0].number, best)
    assert second.study.finished_count() == SETTINGS.max_trials
    inc = second.study.incumbent
    assert inc is not None and inc.params == best == in_force(api, name)[0]


def tuner_process(port: int, name: str, db: Path) -> None:
    """What the killed process runs (`python -c`): the same tuner as `live_tuner`, on KMock."""
    remote = KMockAPI()
    remote.port = port  # the test's KMock, reached over HTTP like any client
    kube = KubeAPI(kopf.ConnectionInfo(server=remote.url), timeout_s=5)
    live_tuner(remote, kube, name, f"sqlite:///{db}", KubeSignals(remote, name)).run()


def test_a_tuner_killed_mid_rollout_resumes_that_trial_without_rolling_it_out_again(
    api: KMockAPI, tmp_path: Path
) -> None:
    name = new_isvc(api)
    db = tmp_path / "tuner.db"
    log_path = tmp_path / "tuner.log"
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO); "
            "from tests.integration.tuner.test_kube_faults import tuner_process; "
            f"tuner_process({api.port}, {name!r}, __import__('pathlib').Path({str(db)!r}))")
    with RolloutPlayer(api, name) as player:
        player.hold = lambda engine: engine != START  # a trial's rollout does not complete while it runs
        with log_path.open("wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                    cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            def rolling() -> EngineParams | None:
                if proc.poll() is not None:
                    raise AssertionError(f"the tuner exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                engine = EngineParams.from_spec(api.get_isvc(NS, name)["spec"]["engine"])
                return engine if engine != START else None

            # Once the trial's engine is written, the tuner waits on its rollout: kill it there.
            held = wait_for(rolling, timeout=60, what="a trial's rollout")
        finally:
            proc.kill()
            proc.wait(10)
        storage = optuna.storages.RDBStorage(f"sqlite:///{db}")
        running = [t for t in optuna.load_study(study_name=name, storage=storage).trials
                   if t.state is TrialState.RUNNING]
        assert [EngineParams.from_spec(t.user_attrs["engine"]) for t in running] == [held]
        player.hold = lambda engine: False  # the operator finishes the rollout while no tuner runs
        wait_for(lambda: player.rollouts == [held], what="the held rollout to complete")
        second = live_tuner(api, client(api, Waits(api)), name, storage, KubeSignals(api, name))
        best = second.run()
    trials = second.study.study.trials
    cut = [t for t in trials if t.state is TrialState.FAIL]
    assert [second.study.engine_of(t) for t in cut] == [held]
    resumed = [t for t in trials if t.user_attrs.get("source") == "resume"]
    assert len(resumed) == 1 and resumed[0].state is TrialState.COMPLETE
    assert resumed[0].number == cut[0].number + 1 and second.study.engine_of(resumed[0]) == held
    # Resumed in place: no second rollout of it, only the later trials' and the best put back.
    assert player.rollouts == [held, *rollouts_after(second, resumed[0].number, best)]
    assert second.study.finished_count() == SETTINGS.max_trials
    assert second.fallback() == best == in_force(api, name)[0]
