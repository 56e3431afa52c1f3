"""A real `kvpilot operator` process (kopf, standalone) against KMock on 127.0.0.1.

KMock has no controllers: a Deployment's status changes only when a test writes it, which is how
these tests play the Deployment controller (rollout complete, progress deadline exceeded).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kmock_api import ApiError, KMockAPI, OperatorProcess, kopf_operator, wait_for
from kvpilot.operator import rbac

pytestmark = pytest.mark.integration

NS = "serving"


@pytest.fixture(scope="module")
def operator(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    yield operator
    operator.assert_alive()
    operator.assert_stops_cleanly()


def make(name: str, namespace: str = NS, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", **spec}}


def dep_path(name: str, namespace: str = NS) -> str:
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return {}


def engine_arg(dep: dict[str, Any], flag: str) -> str:
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return str(args[args.index(flag) + 1])


def template_hash(dep: dict[str, Any]) -> str:
    return str(dep["spec"]["template"]["metadata"]["annotations"]["kvpilot.dev/config-hash"])


def write_deployment_status(api: KMockAPI, name: str, **status: Any) -> None:
    """Play the Deployment controller: status for the Deployment's current generation."""
    generation = api.get(dep_path(name))["metadata"]["generation"]
    api.patch(dep_path(name) + "/status", {"status": {"observedGeneration": generation, **status}})


def events_for(api: KMockAPI, name: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in api.events(NS)
            if e.get("involvedObject", {}).get("name") == name
            and e.get("involvedObject", {}).get("kind") == "InferenceService"
            and (reason is None or e.get("reason") == reason)]


def isvc(api: KMockAPI, name: str) -> dict[str, Any]:
    return dict(api.get_isvc(NS, name))


def engine_series(operator: OperatorProcess, name: str) -> list[dict[str, str]]:
    """The operator's kvpilot_engine_info series for one InferenceService (labels of each)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(operator.http_get("/metrics")[1])
    return [dict(s.labels) for f in families if f.name == "kvpilot_engine_info" for s in f.samples
            if s.labels.get("name") == name and s.labels.get("namespace") == NS and s.value == 1]


def test_create_makes_children_with_owner_references_and_conditions(api: KMockAPI, operator: OperatorProcess) -> None:
    api.create_isvc(make("alpha", replicas=2))
    obj = wait_for(lambda: (o := isvc(api, "alpha")).get("status", {}).get("observedGeneration") == 1 and o,
                   what="alpha's first status")
    uid = obj["metadata"]["uid"]
    for path in (dep_path("alpha"), f"/api/v1/namespaces/{NS}/services/alpha",
                 f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/alpha"):
        child = wait_for(lambda p=path: api.get_or_none(p), what=path)
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "name": "alpha",
                       "uid": uid, "controller": True, "blockOwnerDeletion": True}
    assert condition(obj, "Ready")["status"] == "False"
    assert condition(obj, "Progressing") | {"lastTransitionTime": None} == {
        "type": "Progressing", "status": "True", "reason": "RollingOut", "observedGeneration": 1,
        "message": f"rolling out configHash {obj['status']['configHash']}: 0/2 updated, 0/2 ready",
        "lastTransitionTime": None}
    assert condition(obj, "Degraded")["reason"] == "AsExpected"
    assert obj["status"]["engineArgs"][:3] == ["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
    (created,) = wait_for(lambda: events_for(api, "alpha", "Created"), what="the Created event")
    assert created["message"] == "Created Deployment alpha, Service alpha, PodDisruptionBudget alpha"
    skipped = wait_for(lambda: events_for(api, "alpha", "MonitoringSkipped"), what="MonitoringSkipped event")
    assert len(skipped) == 1
    assert "ServiceMonitor" in skipped[0]["message"] and "PrometheusRule" in skipped[0]["message"]


def test_changing_the_chunk_size_rolls_the_pod_template(api: KMockAPI, operator: OperatorProcess) -> None:
    before = api.get(dep_path("alpha"))
    api.patch(api.isvc_path(NS, "alpha"), {"spec": {"engine": {"maxNumBatchedTokens": 4096}}})
    dep = wait_for(lambda: (d := api.get(dep_path("alpha"))) and
                   engine_arg(d, "--max-num-batched-tokens") == "4096" and d, what="new template")
    assert template_hash(dep) != template_hash(before)
    obj = wait_for(lambda: (o := isvc(api, "alpha"))["status"].get("observedGeneration") == 2 and o,
                   what="observedGeneration 2")
    assert condition(obj, "Progressing")["status"] == "True"
    assert obj["status"]["configHash"] == template_hash(dep)
    wait_for(lambda: any("spec.template" in e["message"] for e in events_for(api, "alpha", "Updated")),
             what="an Updated event naming the template")


def test_engine_info_follows_the_engine_in_force(api: KMockAPI, operator: OperatorProcess) -> None:
    dep = api.get(dep_path("alpha"))
    (series,) = wait_for(lambda: [s for s in engine_series(operator, "alpha")
                                  if s["config_hash"] == template_hash(dep)], what="alpha's engine_info")
    assert series == {"namespace": NS, "name": "alpha", "max_num_batched_tokens": "4096",
                      "gpu_memory_utilization": "0.92", "max_num_seqs": "256", "config_hash": template_hash(dep)}
    assert len(engine_series(operator, "alpha")) == 1  # the 2048 engine's series is gone


def test_complete_rollout_sets_ready_and_last_good_engine(api: KMockAPI, operator: OperatorProcess) -> None:
    write_deployment_status(api, "alpha", replicas=2, updatedReplicas=2, readyReplicas=2, availableReplicas=2,
                            conditions=[{"type": "Progressing", "status": "True",
                                         "reason": "NewReplicaSetAvailable", "message": "done"}])
    obj = wait_for(lambda: condition(o := isvc(api, "alpha"), "Ready").get("status") == "True" and o,
                   what="Ready=True")
    st = obj["status"]
    assert (st["replicas"], st["readyReplicas"], st["updatedReplicas"]) == (2, 2, 2)
    assert st["lastGoodEngine"]["maxNumBatchedTokens"] == 4096
    assert condition(obj, "Progressing")["reason"] == "RolloutComplete"
    assert st["observedGeneration"] == obj["metadata"]["generation"]


def test_a_rollout_finished_while_the_deployment_is_being_created_is_not_lost(api: KMockAPI,
                                                                             operator: OperatorProcess) -> None:
    """The Deployment's status is written the moment KMock has created it, before the reconcile
    that created it has written the InferenceService's first status: Ready must still follow."""
    def finish_rollout() -> None:
        write_deployment_status(api, "quick", replicas=1, updatedReplicas=1, readyReplicas=1, availableReplicas=1)

    hook = api.after("POST", rf"/namespaces/{NS}/deployments$", finish_rollout)
    api.create_isvc(make("quick", replicas=1))
    wait_for(hook.done.is_set, what="the Deployment status written inside the reconcile")
    assert hook.error is None
    obj = wait_for(lambda: condition(o := isvc(api, "quick"), "Ready").get("status") == "True" and o,
                   what="Ready=True")
    assert obj["status"]["observedGeneration"] == 1
    assert (obj["status"]["readyReplicas"], obj["status"]["updatedReplicas"]) == (1, 1)
    assert obj["status"]["lastGoodEngine"]["maxNumBatchedTokens"] == 2048


def test_progress_deadline_rolls_back_to_last_good_engine(api: KMockAPI, operator: OperatorProcess) -> None:
    api.patch(api.isvc_path(NS, "alpha"), {"spec": {"engine": {"maxNumBatchedTokens": 8192}}})
    wait_for(lambda: engine_arg(api.get(dep_path("alpha")), "--max-num-batched-tokens") == "8192",
             what="the 8192 template")
    wait_for(lambda: isvc(api, "alpha")["status"]["observedGeneration"] == 3, what="observedGeneration 3")
    write_deployment_status(api, "alpha", replicas=3, updatedReplicas=1, readyReplicas=2, availableReplicas=2,
                            conditions=[{"type": "Progressing", "status": "False",
                                         "reason": "ProgressDeadlineExceeded",
                                         "message": 'ReplicaSet "alpha-7d9f" has timed out progressing.'}])
    dep = wait_for(lambda: (d := api.get(dep_path("alpha"))) and
                   engine_arg(d, "--max-num-batched-tokens") == "4096" and d, what="lastGoodEngine back")
    assert json.loads(dep["metadata"]["annotations"]["kvpilot.dev/engine"])["maxNumBatchedTokens"] == 4096
    obj = wait_for(lambda: condition(o := isvc(api, "alpha"), "Degraded").get("reason") == "RolledBack" and o,
                   what="Degraded/RolledBack")
    degraded = condition(obj, "Degraded")
    assert degraded["status"] == "True"
    assert "maxNumBatchedTokens=8192 (was 4096)" in degraded["message"]
    assert "ProgressDeadlineExceeded" in degraded["message"] or "timed out" in degraded["message"]
    assert obj["spec"]["engine"]["maxNumBatchedTokens"] == 8192  # the user's spec stays as written
    event = wait_for(lambda: events_for(api, "alpha", "RolledBack"), what="RolledBack event")
    assert event[0]["type"] == "Warning"
    wait_for(lambda: re.search(r"^kvpilot_rollbacks_total 1\.0$", operator.http_get("/metrics")[1], re.M),
             what="kvpilot_rollbacks_total 1")
    # The engine in force is the one put back, not the spec's.
    assert [(s["max_num_batched_tokens"], s["config_hash"]) for s in engine_series(operator, "alpha")] == [
        ("4096", template_hash(dep))]
    # Still rolled back, not flapping: the stale deadline condition names the old template's generation.
    assert engine_arg(api.get(dep_path("alpha")), "--max-num-batched-tokens") == "4096"


def test_a_new_generation_tries_again_after_a_rollback(api: KMockAPI, operator: OperatorProcess) -> None:
    api.patch(api.isvc_path(NS, "alpha"), {"spec": {"engine": {"maxNumBatchedTokens": 6144}}})
    wait_for(lambda: engine_arg(api.get(dep_path("alpha")), "--max-num-batched-tokens") == "6144",
             what="the 6144 template")
    obj = wait_for(lambda: condition(o := isvc(api, "alpha"), "Degraded").get("status") == "False" and o,
                   what="Degraded cleared by the new generation")
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]


def test_a_first_rollout_past_its_deadline_has_nothing_to_roll_back_to(api: KMockAPI,
                                                                       operator: OperatorProcess) -> None:
    api.create_isvc(make("fresh", replicas=1))
    wait_for(lambda: isvc(api, "fresh").get("status", {}).get("observedGeneration") == 1, what="fresh's status")
    before = api.get(dep_path("fresh"))
    write_deployment_status(api, "fresh", replicas=1, updatedReplicas=1, readyReplicas=0,
                            conditions=[{"type": "Progressing", "status": "False",
                                         "reason": "ProgressDeadlineExceeded", "message": "no GPU left"}])
    obj = wait_for(lambda: condition(o := isvc(api, "fresh"), "Degraded").get("status") == "True" and o,
                   what="Degraded/ProgressDeadlineExceeded")
    degraded = condition(obj, "Degraded")
    assert degraded["reason"] == "ProgressDeadlineExceeded"
    assert "no GPU left" in degraded["message"] and "no lastGoodEngine" in degraded["message"]
    assert condition(obj, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert api.get(dep_path("fresh"))["spec"] == before["spec"]


def test_invalid_object_is_degraded_and_a_neighbour_still_reconciles(api: KMockAPI,
                                                                    operator: OperatorProcess) -> None:
    bad = make("broken", replicas=1, engine={"maxNumSeqs": 0, "chunkSize": 5})
    api.create_isvc(bad)
    api.create_isvc(make("neighbour", replicas=1))
    obj = wait_for(lambda: condition(o := isvc(api, "broken"), "Degraded").get("reason") == "InvalidSpec" and o,
                   what="broken: Degraded/InvalidSpec")
    message = condition(obj, "Degraded")["message"]
    assert "spec.engine.maxNumSeqs" in message
    assert "spec.engine.chunkSize: unknown field" in message
    wait_for(lambda: api.get_or_none(dep_path("neighbour")), what="neighbour's Deployment")
    wait_for(lambda: isvc(api, "neighbour")["status"]["observedGeneration"] == 1, what="neighbour's status")
    assert api.get_or_none(dep_path("broken")) is None
    assert api.get_or_none(f"/api/v1/namespaces/{NS}/services/broken") is None
    wait_for(lambda: events_for(api, "broken", "InvalidSpec"), what="InvalidSpec event")


def test_a_reconcile_of_an_unchanged_object_writes_no_children(api: KMockAPI, operator: OperatorProcess) -> None:
    mark = len(api.calls)
    # A label change makes kopf run the update handler; nothing the children hold changes.
    api.patch(api.isvc_path(NS, "neighbour"), {"metadata": {"labels": {"team": "search"}}})
    wait_for(lambda: "team" in isvc(api, "neighbour")["metadata"]["annotations"].get(
        "kvpilot.dev/last-handled-configuration", ""), what="kopf handled the label change")
    writes = [(m, p) for m, p in api.calls[mark:] if m in ("POST", "PATCH", "PUT", "DELETE")
              and "/inferenceservices/" not in p and not p.endswith("/events")]
    assert writes == []


def test_conditions_the_operator_does_not_own_survive_its_status_writes(api: KMockAPI,
                                                                      operator: OperatorProcess) -> None:
    """Another writer (the tuner) adds a Tuning condition while a reconcile is under way, after the
    operator read the object: the operator's status write must keep it, as must later ones."""
    tuning = {"type": "Tuning", "status": "True", "reason": "TrialRunning", "message": "trial 3 of 30",
              "lastTransitionTime": "2026-01-01T00:00:00Z"}

    def tuner_adds_a_condition() -> None:
        conditions = isvc(api, "neighbour")["status"]["conditions"]
        api.patch(api.isvc_path(NS, "neighbour") + "/status", {"status": {"conditions": [*conditions, tuning]}})

    hook = api.after("PATCH", rf"/namespaces/{NS}/deployments/neighbour$", tuner_adds_a_condition)
    generation = api.patch(api.isvc_path(NS, "neighbour"), {"spec": {"engine": {"maxNumSeqs": 128}}})[
        "metadata"]["generation"]
    wait_for(hook.done.is_set, what="the Tuning condition written inside the reconcile")
    assert hook.error is None
    obj = wait_for(lambda: (o := isvc(api, "neighbour"))["status"]["observedGeneration"] == generation and o,
                   what="the new generation's status")
    assert condition(obj, "Tuning") == tuning
    assert condition(obj, "Progressing")["observedGeneration"] == generation
    write_deployment_status(api, "neighbour", replicas=1, updatedReplicas=1, readyReplicas=1, availableReplicas=1)
    obj = wait_for(lambda: condition(o := isvc(api, "neighbour"), "Ready").get("status") == "True" and o,
                   what="neighbour Ready")
    assert condition(obj, "Tuning") == tuning
    assert [c["type"] for c in obj["status"]["conditions"]] == ["Ready", "Progressing", "Degraded", "Tuning"]


def test_a_permanent_error_sets_a_condition_and_does_not_loop(api: KMockAPI, operator: OperatorProcess) -> None:
    # Someone else's Service already has the name: never taken over, reported once, not retried hot.
    api.create(f"/api/v1/namespaces/{NS}/services", {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "squatter", "namespace": NS, "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other", "uid": "not-kvpilot",
             "controller": True}]},
        "spec": {"ports": [{"port": 80}]}})

    def errors() -> float:
        text = operator.http_get("/metrics")[1]
        return float(re.search(r'^kvpilot_reconciles_total\{result="error"\} (\S+)$', text, re.M).group(1))

    before = errors()
    api.create_isvc(make("squatter", replicas=1))
    obj = wait_for(lambda: condition(o := isvc(api, "squatter"), "Degraded").get("reason") == "ApplyFailed" and o,
                   what="Degraded/ApplyFailed")
    assert "controlled by another owner" in condition(obj, "Degraded")["message"]
    service = api.get(f"/api/v1/namespaces/{NS}/services/squatter")
    assert service["metadata"]["ownerReferences"][0]["uid"] == "not-kvpilot"
    assert service["spec"]["ports"] == [{"port": 80}]
    # Another object reconciles afterwards; by then a hot loop would have counted more errors.
    api.create_isvc(make("after-squatter", replicas=1))
    wait_for(lambda: isvc(api, "after-squatter").get("status", {}).get("observedGeneration") == 1,
             what="after-squatter's status")
    assert errors() == before + 1


def test_delete_is_clean(api: KMockAPI, operator: OperatorProcess) -> None:
    api.delete(api.isvc_path(NS, "alpha"))
    wait_for(lambda: api.get_or_none(api.isvc_path(NS, "alpha")) is None, what="alpha gone")
    wait_for(lambda: engine_series(operator, "alpha") == [], what="alpha's engine_info gone")
    # KMock has no garbage collector: the orphaned Deployment still sends events, which must not fail.
    write_deployment_status(api, "alpha", replicas=2, updatedReplicas=2, readyReplicas=2)
    with pytest.raises(ApiError):
        api.get_isvc(NS, "alpha")
    wait_for(lambda: operator.http_get("/healthz")[0] == 200, what="healthz")
    assert operator.proc.poll() is None


def test_metrics_count_reconciles_by_result(api: KMockAPI, operator: OperatorProcess) -> None:
    status, text = operator.http_get("/metrics")
    assert status == 200
    values = dict(re.findall(r'^kvpilot_reconciles_total\{result="(\w+)"\} ([0-9.e+]+)$', text, re.M))
    assert float(values["success"]) >= 4
    assert float(values["invalid"]) >= 1
    assert re.search(r"^kvpilot_reconcile_duration_seconds_count ([1-9][0-9]*)\.0$", text, re.M)


def test_logs_are_json_and_free_of_errors(operator: OperatorProcess) -> None:
    lines = [line for line in operator.log().splitlines() if line.strip()]
    assert lines
    records = [json.loads(line) for line in lines]
    assert {"message", "severity", "timestamp"} <= set(records[0])
    bad = [r for r in records if r.get("severity") in ("error", "critical") or "Traceback" in r["message"]]
    assert bad == []


def _rbac_need(method: str, path: str) -> tuple[str, str, str] | None:
    """(apiGroup, resource, verb) of a resource request; None for discovery."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {"GET": "get" if named else "list", "POST": "create", "PATCH": "patch",
            "PUT": "update", "DELETE": "delete"}[method]
    return group, resource, verb


def test_every_call_is_covered_by_the_declared_rbac(api: KMockAPI, operator: OperatorProcess) -> None:
    needed = {need for m, p in api.calls if (need := _rbac_need(m, p))}
    # The test itself also calls KMock; keep only what the operator needs (the test's own writes
    # are creates/deletes of InferenceServices and status writes of Deployments).
    test_only = {("kvpilot.dev", "inferenceservices", "create"), ("kvpilot.dev", "inferenceservices", "delete"),
                 ("apps", "deployments/status", "patch"), ("", "events", "list")}
    missing = sorted(n for n in needed - test_only if not rbac.allows(*n))
    assert missing == []
    for group, resource, verb in needed:
        if verb == "list":
            assert rbac.allows(group, resource, "watch") or (group, resource, verb) in test_only


def test_monitoring_objects_when_the_cluster_serves_the_crds(tmp_path: Path) -> None:
    with KMockAPI(monitoring_crds=True) as mon_api, kopf_operator(mon_api, tmp_path):
        mon_api.create_isvc(make("watched", replicas=1))
        base = f"/apis/monitoring.coreos.com/v1/namespaces/{NS}"
        sm = wait_for(lambda: mon_api.get_or_none(f"{base}/servicemonitors/watched"), what="ServiceMonitor")
        rule = wait_for(lambda: mon_api.get_or_none(f"{base}/prometheusrules/watched-slo"), what="PrometheusRule")
        uid = mon_api.get_isvc(NS, "watched")["metadata"]["uid"]
        for child in (sm, rule):
            assert child["metadata"]["ownerReferences"][0]["uid"] == uid
        assert sm["spec"]["endpoints"][0]["port"] == "http"
        assert sm["spec"]["podTargetLabels"] == ["kvpilot.dev/inferenceservice", "kvpilot.dev/track"]
        assert rule["spec"]["groups"]
        wait_for(lambda: mon_api.get_isvc(NS, "watched").get("status", {}).get("observedGeneration") == 1,
                 what="status")
        assert not [e for e in mon_api.events(NS) if e.get("reason") == "MonitoringSkipped"]

        # Switched to a PodMonitor: the ServiceMonitor goes, or both would scrape the pods and every
        # sum over the service's series would count each request twice.
        mon_api.patch(mon_api.isvc_path(NS, "watched"), {"spec": {"observability": {"monitor": "PodMonitor"}}})
        pm = wait_for(lambda: mon_api.get_or_none(f"{base}/podmonitors/watched"), what="PodMonitor")
        assert pm["metadata"]["ownerReferences"][0]["uid"] == uid
        assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
        wait_for(lambda: mon_api.get_or_none(f"{base}/servicemonitors/watched") is None,
                 what="the ServiceMonitor deleted")
        wait_for(lambda: [e for e in mon_api.events(NS) if e.get("reason") == "Deleted"
                          and "ServiceMonitor watched" in e.get("message", "")], what="a Deleted Event")
        # None: no monitor at all (the user scrapes the pods their own way); the rules stay.
        mon_api.patch(mon_api.isvc_path(NS, "watched"), {"spec": {"observability": {"monitor": "None"}}})
        wait_for(lambda: mon_api.get_or_none(f"{base}/podmonitors/watched") is None, what="the PodMonitor deleted")
        assert mon_api.get_or_none(f"{base}/prometheusrules/watched-slo") is not None


def test_a_restarted_operator_keeps_the_rollback_and_its_namespaces(tmp_path: Path) -> None:
    """After a rollback, a restart (kopf resumes every object) must not re-apply the failed engine;
    an operator scoped with --namespace leaves other namespaces alone."""
    with KMockAPI() as api2:
        with kopf_operator(api2, tmp_path, "--namespace", NS):
            api2.create_isvc(make("phoenix", replicas=1))
            wait_for(lambda: api2.get_or_none(dep_path("phoenix")), what="phoenix's Deployment")
            write_deployment_status(api2, "phoenix", replicas=1, updatedReplicas=1, readyReplicas=1,
                                    availableReplicas=1)
            wait_for(lambda: isvc(api2, "phoenix")["status"].get("lastGoodEngine"), what="lastGoodEngine")
            api2.patch(api2.isvc_path(NS, "phoenix"), {"spec": {"engine": {"maxNumSeqs": 512}}})
            wait_for(lambda: engine_arg(api2.get(dep_path("phoenix")), "--max-num-seqs") == "512",
                     what="the 512 template")
            wait_for(lambda: isvc(api2, "phoenix")["status"]["observedGeneration"] == 2, what="generation 2")
            write_deployment_status(api2, "phoenix", replicas=2, updatedReplicas=1, readyReplicas=1,
                                    conditions=[{"type": "Progressing", "status": "False",
                                                 "reason": "ProgressDeadlineExceeded", "message": "timed out"}])
            wait_for(lambda: condition(isvc(api2, "phoenix"), "Degraded").get("reason") == "RolledBack",
                     what="RolledBack")
            api2.create_isvc(make("elsewhere", namespace="other-team", replicas=1))
        with kopf_operator(api2, tmp_path, "--namespace", NS) as again:
            # kopf resumes every object at start; once that is done the Deployment must keep the good engine.
            wait_for(lambda: any(r["message"].startswith("Resuming is processed: 1 succeeded")
                                 and r.get("object", {}).get("name") == "phoenix"
                                 for r in map(json.loads, again.log().splitlines())),
                     what="the resumed reconcile of phoenix")
            assert engine_arg(api2.get(dep_path("phoenix")), "--max-num-seqs") == "256"
            assert condition(isvc(api2, "phoenix"), "Degraded").get("reason") == "RolledBack"
        assert api2.get_or_none(dep_path("elsewhere", "other-team")) is None
        assert "status" not in api2.get_isvc("other-team", "elsewhere")
        # Scoped by exact names, kopf's scanning is off: no cluster-scoped reads (rbac.rules_for).
        scanned = sorted({p for _, p in api2.calls
                          if "/customresourcedefinitions" in p or p.rstrip("/") == "/api/v1/namespaces"})
        assert scanned == []


def test_an_image_outside_the_allowlist_is_refused_with_a_condition_and_an_event(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real operator given an allowlist (one pattern by flag, one from the environment) and an
    engine uid: an allowed image is deployed as that uid; another is refused and nothing is created
    or changed, until the spec names an allowed image again."""
    monkeypatch.setenv("KVPILOT_ALLOWED_IMAGES", "registry.example.com/ml/*")
    allowlist = "registry.example.com/ml/*, docker.io/vllm/vllm-openai:*"  # the environment's first
    with KMockAPI() as api3, kopf_operator(api3, tmp_path, "--allowed-image", "docker.io/vllm/vllm-openai:*",
                                           "--engine-run-as-user", "1001"):
        api3.create_isvc(make("allowed", replicas=1, engine={"image": "vllm/vllm-openai:v0.33.0"}))
        api3.create_isvc(make("refused", replicas=1, engine={"image": "evil.example/miner:v1"}))
        dep = wait_for(lambda: api3.get_or_none(dep_path("allowed")), what="the allowed service's Deployment")
        pod = dep["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["runAsUser"] == 1001 and pod["securityContext"]["runAsNonRoot"] is True
        assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}

        obj = wait_for(lambda: condition(o := api3.get_isvc(NS, "refused"), "Degraded").get("reason")
                       == "ImageNotAllowed" and o, what="refused: Degraded/ImageNotAllowed")
        message = condition(obj, "Degraded")["message"]
        assert message.startswith(f"spec.engine.image evil.example/miner:v1 matches none of the images this "
                                  f"operator may run: {allowlist}; ")
        assert condition(obj, "Ready")["status"] == "False" and obj["status"]["observedGeneration"] == 1
        (event,) = wait_for(lambda: [e for e in events_for(api3, "refused", "ImageNotAllowed")], what="the Event")
        assert event["type"] == "Warning" and event["message"] == message
        assert api3.get_or_none(dep_path("refused")) is None
        assert api3.get_or_none(f"/api/v1/namespaces/{NS}/services/refused") is None

        # An allowed service switched to a refused image keeps running what it ran.
        api3.patch(api3.isvc_path(NS, "allowed"), {"spec": {"engine": {"image": "docker.io/evil/vllm:v1"}}})
        wait_for(lambda: condition(api3.get_isvc(NS, "allowed"), "Degraded").get("reason") == "ImageNotAllowed",
                 what="allowed: ImageNotAllowed after the switch")
        assert api3.get(dep_path("allowed"))["spec"]["template"]["spec"]["containers"][0]["image"] == \
            "vllm/vllm-openai:v0.33.0"
        # Events of the Deployment left running must not write "all is well" over the refusal. Each
        # touch is handled once the operator has read the service for it; the handler holds the
        # service's lock, so after the second read the first event's handling is over.
        read = ("GET", api3.isvc_path(NS, "allowed"))
        for touch in ("1", "2"):
            before = api3.calls.count(read)
            api3.patch(dep_path("allowed"), {"metadata": {"annotations": {"test.kvpilot.dev/touch": touch}}})
            wait_for(lambda before=before: api3.calls.count(read) > before,
                     what="the operator reading the service for the Deployment event")
        assert condition(api3.get_isvc(NS, "allowed"), "Degraded").get("reason") == "ImageNotAllowed"

        # Fixed: deployed, and the condition clears.
        api3.patch(api3.isvc_path(NS, "refused"), {"spec": {"engine": {"image": "registry.example.com/ml/vllm:v2"}}})
        dep = wait_for(lambda: api3.get_or_none(dep_path("refused")), what="the fixed service's Deployment")
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/ml/vllm:v2"
        wait_for(lambda: condition(api3.get_isvc(NS, "refused"), "Degraded").get("reason") == "AsExpected",
                 what="refused: Degraded back to AsExpected")
