"""`kvpilot tuner` killed mid-trial and started again, against the real control plane.

The tuner is the real process, on the chart's tuner ServiceAccount, with its Optuna study in
SQLite; the operator runs as in the other `cluster` tests, so every trial is a real rollout. The
one stand-in is the engine's traffic: pods under kwok serve nothing, so a synthetic vLLM exporter
(steady requests, every latency in the lowest bucket, well inside the SLO) is scraped by a real
Prometheus that labels the series as a cluster's Prometheus labels an InferenceService's pods.

The engine image is kwok's "held" one (tests/cluster/kwok-stages.yaml): its pods stay Pending until
the test releases them, so the tuner is killed, deterministically, while its trial's rollout is
in progress (between the trial's apply and its tell): the study keeps that trial RUNNING. The new
process must fail it, measure its config again under a new number without changing the
InferenceService (server-side apply of the same values does not move metadata.generation, so the
operator writes no Deployment), tell each trial once, and count only told trials to the budget.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import chart
from harness.cluster import ControlPlane, Operator, Watch, wait_for
from harness.prometheus import PrometheusServer, require_prometheus
from harness.synthetic_vllm import SyntheticVllm
from harness.tuner_process import TunerProcess
from kvpilot.api import vllm
from kvpilot.api.vocabulary import ANNOTATION_TUNING_TRIAL, SERIES_LABEL_INFERENCESERVICE, TuningPhase
from tests.cluster.common import HELD_IMAGE, RELEASE_ANNOTATION

pytestmark = pytest.mark.cluster

NS = "tuning"
NAME = "tuned"
ISVC = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices/{NAME}"
DEPLOYMENT = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}"
TUNED = ("maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs")
START = {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256}
RATE = 10.0  # synthetic requests per second


@pytest.fixture
def tuner_kubeconfig(control_plane: ControlPlane, chart_identities: dict[str, str], tmp_path: Path) -> Path:
    return control_plane.service_account_kubeconfig(tmp_path / "tuner.kubeconfig", chart.NAMESPACE,
                                                    chart_identities["tuner"])


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    wait_for(lambda: control_plane.get_or_none(f"/api/v1/namespaces/{NS}/serviceaccounts/default"),
             timeout=30, what=f"the default ServiceAccount in {NS}")
    yield NS
    control_plane.delete(f"/api/v1/namespaces/{NS}")


def tuning(cp: ControlPlane) -> dict[str, Any]:
    return dict((cp.get(ISVC).get("status") or {}).get("tuning") or {})


def trial_events(cp: ControlPlane) -> list[tuple[str, str]]:
    """(reason, message) of the tuner's Events on the InferenceService, oldest first."""
    items = cp.get(f"/api/v1/namespaces/{NS}/events")["items"]
    mine = [e for e in items if e["involvedObject"].get("name") == NAME and e.get("reason", "").startswith("Trial")]
    return [(e["reason"], e["message"]) for e in sorted(mine, key=lambda e: e["metadata"]["creationTimestamp"])]


def held_pods(cp: ControlPlane) -> list[dict[str, Any]]:
    """Pods of the InferenceService that kwok holds Pending (not yet released)."""
    pods = cp.get(f"/api/v1/namespaces/{NS}/pods")["items"]
    return [p for p in pods if p["spec"]["containers"][0]["image"] == HELD_IMAGE
            and RELEASE_ANNOTATION not in (p["metadata"].get("annotations") or {})
            and not p["metadata"].get("deletionTimestamp")]


def release_held(cp: ControlPlane) -> bool:
    """Let every held pod turn Ready; True (for polling predicates)."""
    for pod in held_pods(cp):
        cp.merge_patch(f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}",
                       {"metadata": {"annotations": {RELEASE_ANNOTATION: "true"}}})
    return True


def tuned(engine: dict[str, Any]) -> tuple[float, ...]:
    return tuple(float(engine[k]) for k in TUNED)


def engine_args(template: dict[str, Any]) -> tuple[float, ...]:
    args = template["spec"]["containers"][0]["args"]
    flags = ("--max-num-batched-tokens", "--gpu-memory-utilization", "--max-num-seqs")
    return tuple(float(args[args.index(f) + 1]) for f in flags)


@pytest.mark.timeout(240)
def test_a_tuner_killed_mid_trial_resumes_its_study_telling_and_applying_nothing_twice(
        control_plane: ControlPlane, operator: Operator, namespace: str, tuner_kubeconfig: Path,
        tmp_path: Path) -> None:
    import optuna
    from optuna.trial import TrialState

    require_prometheus()
    labels = {"namespace": NS, SERIES_LABEL_INFERENCESERVICE: NAME}
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    with SyntheticVllm(RATE) as exporter, PrometheusServer(scrape_configs=[
            {"job_name": "vllm", "static_configs": [{"targets": [exporter.target], "labels": labels}]}]) as prom:
        prom.wait_for(f"{vllm.METRIC_TTFT}_count > {RATE * 2}", timeout=30)
        control_plane.create(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices", {
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1,
                     "engine": {**START, "image": HELD_IMAGE},
                     "tuning": {"enabled": True, "maxTrials": 2, "trialSeconds": 10, "warmupSeconds": 0}}})
        wait_for(lambda: release_held(control_plane)
                 and (control_plane.get(ISVC).get("status") or {}).get("readyReplicas") == 1, timeout=90,
                 what=f"{NAME} Ready")
        rv = control_plane.get(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices")["metadata"]["resourceVersion"]
        isvc_history = Watch(control_plane, f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices",
                             resource_version=rv)
        rv = control_plane.get(f"/apis/apps/v1/namespaces/{NS}/deployments")["metadata"]["resourceVersion"]
        deployment_history = Watch(control_plane, f"/apis/apps/v1/namespaces/{NS}/deployments", resource_version=rv)
        tuner = TunerProcess(tuner_kubeconfig, prom.url, storage, tmp_path, NS)
        try:
            def trial_applied(number: int) -> dict[str, Any] | None:
                tuner.check_alive()
                obj = control_plane.get(ISVC)
                return obj if obj["metadata"].get("annotations", {}).get(ANNOTATION_TUNING_TRIAL) == str(number) else None

            # Trial 0 is the engine in force (no change); trial 1 is the sampler's first draw. Its
            # rollout is held: the new ReplicaSet's pod stays Pending while the tuner waits on it.
            applied = wait_for(lambda: trial_applied(1), timeout=90, what="trial 1 applied")
            generation_at_kill = applied["metadata"]["generation"]
            wait_for(lambda: held_pods(control_plane), timeout=60, what="trial 1's surge pod (held)")
            tuner.kill()
            cut = tuned(applied["spec"]["engine"])
            study_name = tuning(control_plane)["study"]
            study = optuna.load_study(study_name=study_name, storage=storage)
            assert [t.state for t in study.trials] == [TrialState.COMPLETE, TrialState.RUNNING]

            tuner.start()
            # The new process measures trial 1's config again as trial 2 while the rollout is still held:
            # its apply is a no-op (same generation), and it waits on the same rollout.
            wait_for(lambda: tuner.check_alive() and any(r == "TrialStarted" and m.startswith("trial 2 ")
                                                         for r, m in trial_events(control_plane)),
                     timeout=90, what="trial 2 started by the new process")
            assert held_pods(control_plane), "the rollout was to be still in progress"
            assert control_plane.get(ISVC)["metadata"]["generation"] == generation_at_kill
            wait_for(lambda: tuner.check_alive() and release_held(control_plane)
                     and tuning(control_plane).get("phase") == TuningPhase.DONE.value,
                     timeout=150, interval=0.5, what="status.tuning.phase Done")
            assert tuner.stop() == 0, tuner.log()[-4000:]
        finally:
            tuner.close()
            isvc_changes = isvc_history.stop()
            deployment_changes = deployment_history.stop()

    study = optuna.load_study(study_name=study_name, storage=storage)
    trials = study.trials
    # The cut-off trial failed (counts for nothing), its config measured again as trial 2; the
    # budget (2) is met by trials 0 and 2: no third trial, nothing counted twice.
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE], trials
    # The same engine: queued again whole from the engine it applied (0.8, where the sampler's float read
    # 0.7999999999999999 for the same flag).
    assert trials[2].user_attrs["source"] == "resume" and trials[2].user_attrs["engine"] == trials[1].user_attrs["engine"]
    assert tuned(trials[1].user_attrs["engine"]) == cut
    # Each trial told once, in the tuner's Events; trial 1 started once and never finished.
    reasons = trial_events(control_plane)
    assert [r for r, m in reasons if r == "TrialStarted"] == ["TrialStarted"] * 3, reasons
    for number, finished in ((0, 1), (1, 0), (2, 1)):
        told = [m for r, m in reasons if r != "TrialStarted" and m.startswith(f"trial {number} ")]
        assert len(told) == finished, (number, reasons)
    # Measuring trial 1's config again wrote nothing: the resumed apply left the generation as it was.
    spec_history = [(o["metadata"]["generation"], tuned(o["spec"]["engine"])) for _, o in isvc_changes]
    assert (generation_at_kill, cut) in spec_history
    assert {g for g, engine in spec_history if engine == cut} == {generation_at_kill}
    for (g1, e1), (g2, e2) in zip(spec_history, spec_history[1:], strict=False):
        assert (g1 == g2) == (e1 == e2), f"a generation without a change, or a change without one: {spec_history}"
    # The operator wrote each engine once: each Deployment generation a different template.
    templates = {o["metadata"]["generation"]: engine_args(o["spec"]["template"]) for _, o in deployment_changes}
    ordered = [templates[g] for g in sorted(templates)]
    assert all(a != b for a, b in zip(ordered, ordered[1:], strict=False)), templates
    assert ordered.count(cut) == 1, (cut, templates)
    control_plane.delete(ISVC)
