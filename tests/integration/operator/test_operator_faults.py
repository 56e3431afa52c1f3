"""API faults and restarts: a real `kvpilot operator` process (kopf, standalone) against KMock,
with KMock answering chosen requests with a fault (harness/kmock_api.py: `KMockAPI.fail`).

Each fault class of a Kubernetes API server is injected into the operator's own calls during a
reconcile (create) and during a rollback: 409 Conflict, 429 with Retry-After, 500, 503 (more of them
than one call's retries), a request that times out, a dropped connection.  The end state must be
the one without faults, and a Retry-After is checked by the order and the KMock-side times of the
requests (the retry arrives no sooner than the wait after the fault left KMock).  Then the operator
is killed (SIGKILL) at the worst moments of a rollout and a rollback, and a new one started: nothing
lost (lastGoodEngine, the rollback), nothing applied twice (no second create, no second patch).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kmock_api import (
    Fault,
    KMockAPI,
    OperatorProcess,
    operator_process,
    wait_for,
)
from tests.integration.operator.test_operator_kmock import (
    condition,
    dep_path,
    engine_arg,
    events_for,
    isvc,
    make,
    write_deployment_status,
)

pytestmark = pytest.mark.integration

NS = "serving"
# One call: 1 try + 3 retries (about 0.2 + 0.4 + 0.8 s); a reconcile or a rollback that still fails
# runs again after about 1 s; a call that takes over 1 s has timed out.
FLAGS = ("--api-retries", "3", "--retry-delay", "1", "--api-timeout", "1", "--retry-seed", "1")
ALL_TRIES_OF_ONE_CALL = 4


@pytest.fixture(scope="module")
def operator_args() -> tuple[str, ...]:
    return FLAGS


@pytest.fixture(scope="module")
def operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    yield operator
    operator.assert_alive()


def requests_to(api: KMockAPI, method: str, path: str) -> list[float]:
    """KMock's arrival time of each `method` request to exactly `path`, faulted ones included."""
    return [t for t, m, p in api.emulator.timed_requests if m == method and p == path]


def converged(api: KMockAPI, name: str, generation: int = 1) -> dict[str, Any]:
    """The object once its status says the generation is rolled out as far as KMock lets it."""
    def ready() -> dict[str, Any] | None:
        obj = isvc(api, name)
        status = obj.get("status") or {}
        if status.get("observedGeneration") == generation and condition(obj, "Degraded").get("status") == "False":
            return obj
        return None
    return dict(wait_for(ready, timeout=30, what=f"{name}: generation {generation} reconciled, not Degraded"))


def children(api: KMockAPI, name: str) -> list[str]:
    paths = [dep_path(name), f"/api/v1/namespaces/{NS}/services/{name}",
             f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{name}"]
    return [p for p in paths if api.get_or_none(p) is not None]


CREATE_FAULTS = {
    # 409 on the status write (it carries the resourceVersion it was computed from): read again, recompute.
    "409-status": ("PATCH", "/inferenceservices/{name}/status", [Fault(409)]),
    # 429 with Retry-After on the Deployment's create: wait at least that long, once.
    "429-retry-after": ("POST", "/deployments", [Fault(429, retry_after=2)]),
    "500": ("POST", "/services", [Fault(500), Fault(500)]),
    # More 503s than one call's tries: the reconcile fails, says so (Degraded ApplyFailed, an
    # Event) and kopf runs it again.
    "503-outlasting-the-retries": ("POST", "/deployments", [Fault(503)] * (ALL_TRIES_OF_ONE_CALL + 1)),
    "timeout": ("POST", "/poddisruptionbudgets", [Fault(503, stall=3)]),
    "dropped-connection": ("POST", "/deployments", [Fault(0), Fault(0)]),
}


@pytest.mark.parametrize("case", sorted(CREATE_FAULTS))
def test_a_create_converges_through_each_fault_class(api: KMockAPI, operator: OperatorProcess, case: str) -> None:
    name = f"create-{case}"
    method, suffix, faults = CREATE_FAULTS[case]
    rule = api.fail(method, f"/namespaces/{NS}{suffix.format(name=name)}$", *faults)
    api.create_isvc(make(name, replicas=2))
    obj = converged(api, name)
    assert rule.exhausted and len(rule.served) == len(faults)
    assert children(api, name) == [dep_path(name), f"/api/v1/namespaces/{NS}/services/{name}",
                                   f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{name}"]
    assert condition(obj, "Progressing")["reason"] == "RollingOut"
    assert obj["status"]["engineArgs"][:3] == ["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
    # One Created event naming each child once: no pass created (or failed to create) a child twice.
    (created,) = wait_for(lambda: events_for(api, name, "Created"), what="the Created event")
    assert created["message"] == f"Created Deployment {name}, Service {name}, PodDisruptionBudget {name}"
    if case == "503-outlasting-the-retries":
        (failed,) = events_for(api, name, "ApplyFailed")
        assert "503 ServiceUnavailable" in failed["message"]


def test_a_forbidden_apply_as_at_an_api_server_restart_is_retried_not_dropped(api: KMockAPI,
                                                                               operator: OperatorProcess) -> None:
    """kube-apiserver answers 403 for a few seconds after it restarts (its RBAC caches still empty): the
    chaos run saw a change's Deployment write and its status write both refused so, and the change was
    never applied. A 403 on the apply is retried like a 503."""
    name = "create-403"
    deployment = api.fail("POST", f"/namespaces/{NS}/deployments$", *[Fault(403)] * ALL_TRIES_OF_ONE_CALL)
    status = api.fail("PATCH", f"/namespaces/{NS}/inferenceservices/{name}/status$", Fault(403))
    api.create_isvc(make(name, replicas=2))
    converged(api, name)
    assert deployment.exhausted and status.exhausted
    assert dep_path(name) in children(api, name)


def test_a_status_write_forbidden_through_every_try_is_retried_not_dropped(api: KMockAPI,
                                                                           operator: OperatorProcess) -> None:
    """The status write of a change meets 403 through all of one call's tries (an API server whose RBAC
    caches are still empty after a restart): the reconcile is run again, so the status reaches the
    spec's generation. Dropped, it kept the old observedGeneration (a chaos run: 240 s, two changes)."""
    name = "status-403"
    api.create_isvc(make(name, replicas=1))
    converged(api, name)
    status = api.fail("PATCH", f"/namespaces/{NS}/inferenceservices/{name}/status$",
                      *[Fault(403)] * ALL_TRIES_OF_ONE_CALL)
    api.patch(api.isvc_path(NS, name), {"spec": {"engine": {"maxNumBatchedTokens": 4096}}})
    converged(api, name, generation=2)
    assert status.exhausted


def test_a_retry_after_is_honoured_by_the_next_request(api: KMockAPI, operator: OperatorProcess) -> None:
    """The create-429 case above, read from KMock's side: one retry, no sooner than Retry-After."""
    name = "retry-after"
    path = f"/apis/apps/v1/namespaces/{NS}/deployments"
    rule = api.fail("POST", f"/namespaces/{NS}/deployments$", Fault(429, retry_after=2))
    api.create_isvc(make(name, replicas=1))
    converged(api, name)
    (answered, status), = rule.served
    assert status == 429
    after = [t for t in requests_to(api, "POST", path) if t > answered]
    assert after, "the Deployment was never created again"
    assert after[0] - answered >= 2.0  # the operator's own first backoff is about 0.2 s


def _rollout_complete(api: KMockAPI, name: str, replicas: int = 1) -> None:
    write_deployment_status(api, name, replicas=replicas, updatedReplicas=replicas, readyReplicas=replicas,
                            availableReplicas=replicas,
                            conditions=[{"type": "Progressing", "status": "True",
                                         "reason": "NewReplicaSetAvailable", "message": "done"}])


def _deadline_exceeded(api: KMockAPI, name: str) -> None:
    write_deployment_status(api, name, replicas=2, updatedReplicas=1, readyReplicas=1, availableReplicas=1,
                            conditions=[{"type": "Progressing", "status": "False",
                                         "reason": "ProgressDeadlineExceeded", "message": "timed out"}])


def _good_then_bad(api: KMockAPI, name: str) -> None:
    """A service with lastGoodEngine 2048 whose spec now asks for 8192, rolled out but not progressing yet."""
    api.create_isvc(make(name, replicas=1))
    wait_for(lambda: api.get_or_none(dep_path(name)), what=f"{name}'s Deployment")
    wait_for(lambda: isvc(api, name).get("status", {}).get("observedGeneration") == 1, what="generation 1")
    _rollout_complete(api, name)
    wait_for(lambda: isvc(api, name)["status"].get("lastGoodEngine"), what="lastGoodEngine")
    api.patch(api.isvc_path(NS, name), {"spec": {"engine": {"maxNumBatchedTokens": 8192}}})
    wait_for(lambda: engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "8192",
             what="the 8192 template")
    wait_for(lambda: isvc(api, name)["status"]["observedGeneration"] == 2, what="generation 2")


def test_a_rollback_whose_patch_keeps_failing_is_retried_until_it_holds(api: KMockAPI,
                                                                        operator: OperatorProcess) -> None:
    """The rollback's patch fails through all of one call's tries (503), so the first rollback
    fails: Degraded says RollbackFailed and an Event says it is tried again; the second try meets
    a 429 with Retry-After and then holds."""
    name = "rollback-faults"
    _good_then_bad(api, name)
    rule = api.fail("PATCH", f"/namespaces/{NS}/deployments/{name}$",
                    *[Fault(503)] * ALL_TRIES_OF_ONE_CALL, Fault(503), Fault(429, retry_after=2))
    _deadline_exceeded(api, name)
    failed = wait_for(lambda: events_for(api, name, "RollbackFailed"), timeout=30, what="the RollbackFailed event")
    assert failed[0]["type"] == "Warning"
    assert "putting lastGoodEngine back" in failed[0]["message"] and "trying again in" in failed[0]["message"]
    pending = wait_for(lambda: condition(o := isvc(api, name), "Degraded").get("reason") == "RollbackFailed" and o,
                       what="Degraded/RollbackFailed")
    assert condition(pending, "Progressing")["reason"] == "ProgressDeadlineExceeded"  # the tuner reads it failed
    assert condition(pending, "Degraded")["message"] == failed[0]["message"]
    dep = wait_for(lambda: (d := api.get(dep_path(name))) and
                   engine_arg(d, "--max-num-batched-tokens") == "2048" and d, timeout=30, what="2048 back")
    assert json.loads(dep["metadata"]["annotations"]["kvpilot.dev/engine"])["maxNumBatchedTokens"] == 2048
    obj = wait_for(lambda: condition(o := isvc(api, name), "Degraded").get("reason") == "RolledBack" and o,
                   what="Degraded/RolledBack")
    assert "maxNumBatchedTokens=8192 (was 2048)" in condition(obj, "Degraded")["message"]
    assert obj["spec"]["engine"]["maxNumBatchedTokens"] == 8192
    wait_for(lambda: events_for(api, name, "RolledBack"), what="the RolledBack event")
    assert rule.exhausted
    # The retry after the 429 came no sooner than its Retry-After, and nothing patched it after that.
    (answered_429, _) = rule.served[-1]
    after = [t for t in requests_to(api, "PATCH", dep_path(name)) if t > answered_429]
    assert len(after) == 1 and after[0] - answered_429 >= 2.0


ROLLBACK_FAULTS = {
    # One call's tries and one more, of each class: the first rollback fails, the second holds.
    "409": Fault(409),
    "500": Fault(500),
    "timeout": Fault(503, stall=3),
    "dropped-connection": Fault(0),
}


@pytest.mark.parametrize("case", sorted(ROLLBACK_FAULTS))
def test_a_rollback_converges_through_each_fault_class(api: KMockAPI, operator: OperatorProcess, case: str) -> None:
    name = f"rollback-{case}"
    _good_then_bad(api, name)
    rule = api.fail("PATCH", f"/namespaces/{NS}/deployments/{name}$",
                    *[ROLLBACK_FAULTS[case]] * (ALL_TRIES_OF_ONE_CALL + 1))
    _deadline_exceeded(api, name)
    obj = wait_for(lambda: condition(o := isvc(api, name), "Degraded").get("reason") == "RolledBack" and
                   engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048" and o,
                   timeout=40, what="rolled back to 2048")
    assert rule.exhausted
    assert obj["status"]["lastGoodEngine"]["maxNumBatchedTokens"] == 2048
    (failed,) = events_for(api, name, "RollbackFailed")
    assert "failed attempts: 1" in failed["message"]
    assert {"409": "409 Conflict", "500": "500 InternalError", "timeout": "0 Timeout: no answer within 1s",
            "dropped-connection": "0 ServerDisconnectedError"}[case] in failed["message"]
    assert len(events_for(api, name, "RolledBack")) == 1


def _kill_after(api: KMockAPI, method: str, path: str, op: OperatorProcess) -> Any:
    """SIGKILL the operator right after KMock served this request, before the operator reads the answer."""
    return api.after(method, path, op.proc.kill)


def _resumed(op: OperatorProcess, name: str) -> bool:
    records = [json.loads(line) for line in op.log().splitlines() if line.strip()]
    return any(r.get("object", {}).get("name") == name
               and str(r.get("message", "")).startswith(("Resuming is processed", "Updating is processed",
                                                          "Handler 'reconcile' succeeded"))
               for r in records)


def test_an_operator_killed_between_a_rollout_patch_and_its_status_loses_and_repeats_nothing(
        tmp_path: Path) -> None:
    name = "phoenix"
    with KMockAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with operator_process(kubeconfig, tmp_path, *FLAGS, log_name="first.log") as first:
            api.create_isvc(make(name, replicas=1))
            wait_for(lambda: isvc(api, name).get("status", {}).get("observedGeneration") == 1, what="generation 1")
            _rollout_complete(api, name)
            wait_for(lambda: isvc(api, name)["status"].get("lastGoodEngine"), what="lastGoodEngine")
            hook = _kill_after(api, "PATCH", f"/namespaces/{NS}/deployments/{name}$", first)
            api.patch(api.isvc_path(NS, name), {"spec": {"engine": {"maxNumSeqs": 128}}})
            wait_for(hook.done.is_set, what="the operator killed after patching the Deployment")
            wait_for(lambda: first.proc.poll() is not None, what="the first operator gone")
        assert engine_arg(api.get(dep_path(name)), "--max-num-seqs") == "128"
        assert isvc(api, name)["status"]["observedGeneration"] == 1  # the status write never happened
        patches_before = len(requests_to(api, "PATCH", dep_path(name)))
        with operator_process(kubeconfig, tmp_path, *FLAGS, log_name="second.log"):
            obj = wait_for(lambda: (o := isvc(api, name))["status"]["observedGeneration"] == 2 and o,
                           what="generation 2 reconciled by the new operator")
            assert condition(obj, "Progressing")["reason"] == "RollingOut"
            assert obj["status"]["lastGoodEngine"]["maxNumSeqs"] == 256  # kept until the new one is good
            _rollout_complete(api, name)
            obj = wait_for(lambda: condition(o := isvc(api, name), "Ready").get("status") == "True" and o,
                           what="Ready")
            assert obj["status"]["lastGoodEngine"]["maxNumSeqs"] == 128
        assert len(requests_to(api, "POST", f"/apis/apps/v1/namespaces/{NS}/deployments")) == 1
        assert len(requests_to(api, "PATCH", dep_path(name))) == patches_before  # the template was not sent again
        deployments = api.get(f"/apis/apps/v1/namespaces/{NS}/deployments")["items"]
        assert [d["metadata"]["name"] for d in deployments] == [name]


def test_an_operator_killed_between_a_rollback_patch_and_its_status_keeps_the_rollback(tmp_path: Path) -> None:
    """Killed right after the rollback's patch: the new operator must not render the failed engine
    again (its resumed reconcile reads the status, which must already say the generation failed)."""
    name = "lazarus"
    with KMockAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with operator_process(kubeconfig, tmp_path, *FLAGS, log_name="first.log") as first:
            _good_then_bad(api, name)
            hook = _kill_after(api, "PATCH", f"/namespaces/{NS}/deployments/{name}$", first)
            _deadline_exceeded(api, name)
            wait_for(hook.done.is_set, what="the operator killed after the rollback's patch")
            wait_for(lambda: first.proc.poll() is not None, what="the first operator gone")
        assert engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048"
        patches_before = len(requests_to(api, "PATCH", dep_path(name)))
        with operator_process(kubeconfig, tmp_path, *FLAGS, log_name="second.log") as second:
            wait_for(lambda: _resumed(second, name), what="the resumed reconcile")
            obj = wait_for(lambda: condition(o := isvc(api, name), "Degraded").get("reason") == "RolledBack" and o,
                           what="Degraded/RolledBack")
            assert obj["status"]["lastGoodEngine"]["maxNumBatchedTokens"] == 2048
            # The decision is written before the Deployment is patched: the template follows it.
            wait_for(lambda: engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048",
                     what="2048 back")
            _rollout_complete(api, name)  # the restored engine's rollout finishes
            wait_for(lambda: condition(isvc(api, name), "Ready").get("status") == "True", what="Ready")
        assert len(requests_to(api, "PATCH", dep_path(name))) == patches_before  # 8192 never sent again
        assert engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048"



def _handled(op: OperatorProcess, name: str) -> int:
    """How many times kopf logged the reconcile of `name` as succeeded."""
    records = [json.loads(line) for line in op.log().splitlines() if line.strip()]
    return sum(1 for r in records if r.get("object", {}).get("name") == name
               and str(r.get("message", "")).startswith("Handler 'reconcile' succeeded"))


def test_a_failed_reconcile_of_a_rolled_back_generation_keeps_the_rollback(api: KMockAPI,
                                                                           operator: OperatorProcess) -> None:
    """After generation 2 is rolled back, a reconcile of generation 2 (a label changed) fails past the
    client's retries: it says ApplyFailed, and kopf runs it again.  That run must still render
    lastGoodEngine (2048), not the failed 8192: Degraded RolledBack, which keeps it there, stands."""
    name = "rolled-back-apply-failed"
    _good_then_bad(api, name)
    _deadline_exceeded(api, name)
    wait_for(lambda: condition(isvc(api, name), "Degraded").get("reason") == "RolledBack" and
             engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048", what="rolled back to 2048")
    patches = len(requests_to(api, "PATCH", dep_path(name)))
    handled = _handled(operator, name)
    rule = api.fail("GET", f"/namespaces/{NS}/deployments/{name}$", *[Fault(503)] * ALL_TRIES_OF_ONE_CALL)
    api.patch(api.isvc_path(NS, name), {"metadata": {"labels": {"team": "search"}}})
    (failed,) = wait_for(lambda: events_for(api, name, "ApplyFailed"), what="the ApplyFailed event")
    assert "503 ServiceUnavailable" in failed["message"]
    wait_for(lambda: _handled(operator, name) > handled, timeout=30, what="the reconcile run again, and done")
    assert rule.exhausted
    obj = isvc(api, name)
    assert condition(obj, "Degraded")["reason"] == "RolledBack"
    assert obj["status"]["lastGoodEngine"]["maxNumBatchedTokens"] == 2048
    assert engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048"
    assert len(requests_to(api, "PATCH", dep_path(name))) == patches  # 8192 never sent again


# As FLAGS, but a failed rollback is tried again only after 30 s: what completes it first is the test's choice.
SLOW_RETRY = ("--api-retries", "3", "--retry-delay", "30", "--api-timeout", "1", "--retry-seed", "1")


def rollbacks_total(op: OperatorProcess) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(op.http_get("/metrics")[1]) for s in family.samples]
    return sum(s.value for s in samples if s.name == "kvpilot_rollbacks_total")


def config_hash_of(api: KMockAPI, name: str) -> str:
    return str(api.get(dep_path(name))["metadata"]["annotations"]["kvpilot.dev/config-hash"])


def test_a_rollback_a_reconcile_completes_after_its_patch_failed_is_counted_and_said_once(tmp_path: Path) -> None:
    """The rollback's patch fails through all of one call's tries (Degraded RollbackFailed, its next try
    30 s away) and a reconcile of the generation (a label changed) puts lastGoodEngine back first: that
    rollback is counted (kvpilot_rollbacks_total) and said (one RolledBack Event, Degraded RolledBack)
    like one whose own patch held, lastFailure names the failed rollout, and nothing is patched twice."""
    name = "second-try"
    with KMockAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with operator_process(kubeconfig, tmp_path, *SLOW_RETRY) as op:
            _good_then_bad(api, name)
            failed_hash = config_hash_of(api, name)
            rule = api.fail("PATCH", f"/namespaces/{NS}/deployments/{name}$", *[Fault(503)] * ALL_TRIES_OF_ONE_CALL)
            _deadline_exceeded(api, name)
            wait_for(lambda: condition(isvc(api, name), "Degraded").get("reason") == "RollbackFailed",
                     what="Degraded/RollbackFailed")
            assert rule.exhausted and rollbacks_total(op) == 0
            patches = len(requests_to(api, "PATCH", dep_path(name)))
            api.patch(api.isvc_path(NS, name), {"metadata": {"labels": {"team": "search"}}})
            obj = wait_for(lambda: condition(o := isvc(api, name), "Degraded").get("reason") == "RolledBack" and o,
                           what="Degraded/RolledBack")
            assert engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048"
            assert rollbacks_total(op) == 1
            (said,) = wait_for(lambda: events_for(api, name, "RolledBack"), what="the RolledBack event")
            assert f"rollout of configHash {failed_hash} failed (ProgressDeadlineExceeded: timed out)" in said["message"]
            assert condition(obj, "Degraded")["message"] == said["message"]
            failure = obj["status"]["lastFailure"]
            assert failure["observedGeneration"] == 2 and failure["configHash"] == failed_hash
            assert failure["reason"] == "ProgressDeadlineExceeded"
            assert len(requests_to(api, "PATCH", dep_path(name))) == patches + 1


def test_an_operator_killed_between_the_fast_rollbacks_decision_and_its_patch_completes_it_once(
        tmp_path: Path) -> None:
    """vLLM cannot start: the fast rollback writes its decision, and the operator is killed before its
    patch.  Restarted (the failed pod gone meanwhile, so only the resumed reconcile is left to act), it
    puts lastGoodEngine back once, counts and says that rollback once, and lastFailure keeps vLLM's words."""
    from tests.integration.operator.test_engine_failure_rollback import crash_looping
    from tests.support.vllm_text import KV_SHORT, startup_failure_log, termination_message

    name = "icarus"
    pod = f"/api/v1/namespaces/{NS}/pods/{name}-new-1"
    with KMockAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with operator_process(kubeconfig, tmp_path, *FLAGS, log_name="first.log") as first:
            _good_then_bad(api, name)
            killed = threading.Event()

            def kill_once_decided() -> None:
                if condition(isvc(api, name), "Degraded").get("reason") == "RolledBack":
                    first.proc.kill()
                    killed.set()
                else:  # another status write: wait for the decision's
                    api.after("PATCH", rf"/inferenceservices/{name}/status$", kill_once_decided)

            api.after("PATCH", rf"/inferenceservices/{name}/status$", kill_once_decided)
            log = startup_failure_log(KV_SHORT)
            api.create_engine_pod(api.get(dep_path(name)), f"{name}-new-1", crash_looping(termination_message(log)),
                                  previous_log=log)
            wait_for(killed.is_set, what="the operator killed right after the rollback's decision")
            wait_for(lambda: first.proc.poll() is not None, what="the first operator gone")
        assert engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "8192"  # no patch yet
        api.delete(pod)
        patches = len(requests_to(api, "PATCH", dep_path(name)))
        with operator_process(kubeconfig, tmp_path, *FLAGS, log_name="second.log") as second:
            wait_for(lambda: engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048",
                     what="2048 back")
            wait_for(lambda: rollbacks_total(second) == 1, what="the rollback counted")
            (said,) = wait_for(lambda: events_for(api, name, "RolledBack"), what="the RolledBack event")
            assert "(EngineStartupFailed: " in said["message"] and KV_SHORT in said["message"]  # vLLM's words
            assert "put lastGoodEngine back" in said["message"]
            obj = wait_for(lambda: (o := isvc(api, name)) and condition(o, "Degraded")["message"] == said["message"]
                           and o, what="Degraded says it")
            assert condition(obj, "Degraded")["reason"] == "RolledBack"
            failure = obj["status"]["lastFailure"]
            assert failure["reason"] == "EngineStartupFailed" and failure["pod"] == f"{name}-new-1"
            assert KV_SHORT in failure["message"]
        assert len(requests_to(api, "PATCH", dep_path(name))) == patches + 1


def test_a_reconcile_in_back_off_runs_again_on_the_spec_as_it_is_then(tmp_path: Path) -> None:
    """The reconcile of generation 2 fails past the client's retries, and kopf is to run it again in
    10 s; meanwhile the spec changes again.  The next run renders generation 3's engine (kopf hands
    the handler the object as it is then): generation 2's engine is never applied after the fact."""
    name = "moving-target"
    with KMockAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with operator_process(kubeconfig, tmp_path, "--api-retries", "3", "--retry-delay", "10", "--api-timeout", "1"):
            api.create_isvc(make(name, replicas=1))
            wait_for(lambda: isvc(api, name).get("status", {}).get("observedGeneration") == 1, what="generation 1")
            template_generation = api.get(dep_path(name))["metadata"]["generation"]
            rule = api.fail("PATCH", f"/namespaces/{NS}/deployments/{name}$", *[Fault(503)] * ALL_TRIES_OF_ONE_CALL)
            api.patch(api.isvc_path(NS, name), {"spec": {"engine": {"maxNumBatchedTokens": 8192}}})
            wait_for(lambda: events_for(api, name, "ApplyFailed"), what="the ApplyFailed event")
            assert rule.exhausted
            api.patch(api.isvc_path(NS, name), {"spec": {"engine": {"maxNumBatchedTokens": 4096}}})
            obj = wait_for(lambda: (o := isvc(api, name))["status"]["observedGeneration"] == 3 and o, timeout=30,
                           what="generation 3 reconciled")
            assert condition(obj, "Degraded")["reason"] == "AsExpected"
            dep = api.get(dep_path(name))
            assert engine_arg(dep, "--max-num-batched-tokens") == "4096"
            assert dep["metadata"]["generation"] == template_generation + 1  # one template change: 8192 never


def test_a_stale_deployment_event_after_a_rollback_counts_and_says_nothing_again(tmp_path: Path) -> None:
    """A Deployment event from before the rollback (kopf's listing at a start can carry one) reaches
    track_rollout after lastGoodEngine is back: the rollback is neither counted nor said a second time,
    and nothing is patched.  track_rollout runs in this process against KMock, fed that old Deployment."""
    import asyncio
    import logging

    import kopf

    from kvpilot.operator.kube import KubeClient
    from kvpilot.operator.reconcile import Runtime, track_rollout
    from kvpilot.operator.settings import OperatorSettings

    name = "stale-event"
    with KMockAPI() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with operator_process(kubeconfig, tmp_path, *FLAGS) as op:
            _good_then_bad(api, name)
            stale = api.get(dep_path(name))  # the 8192 template, as it was when its deadline passed
            stale["status"] = {"observedGeneration": stale["metadata"]["generation"], "replicas": 2,
                               "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1,
                               "conditions": [{"type": "Progressing", "status": "False",
                                               "reason": "ProgressDeadlineExceeded", "message": "timed out"}]}
            _deadline_exceeded(api, name)
            wait_for(lambda: condition(isvc(api, name), "Degraded").get("reason") == "RolledBack" and
                     engine_arg(api.get(dep_path(name)), "--max-num-batched-tokens") == "2048", what="2048 back")
            wait_for(lambda: rollbacks_total(op) == 1, what="the rollback counted")
        patches, said = len(requests_to(api, "PATCH", dep_path(name))), len(events_for(api, name, "RolledBack"))

        rt = Runtime(settings=OperatorSettings(), client=KubeClient())
        rt.client.set_credentials(kopf.ConnectionInfo(server=api.url))
        events: list[tuple[str, ...]] = []

        async def handle_the_stale_event() -> None:
            try:
                await track_rollout(rt, stale, lambda obj, *event: events.append(event), logging.getLogger("test"))
            finally:
                await rt.close()
                await rt.client.close()

        asyncio.run(handle_the_stale_event())
        assert rt.metrics.registry.get_sample_value("kvpilot_rollbacks_total") == 0
        assert events == []
        assert len(requests_to(api, "PATCH", dep_path(name))) == patches
        assert len(events_for(api, name, "RolledBack")) == said == 1
        assert condition(isvc(api, name), "Degraded")["reason"] == "RolledBack"
