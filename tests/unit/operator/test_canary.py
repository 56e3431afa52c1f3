"""The canary track's pure parts: the annotation, the canary Deployment, the two tracks' selectors,
and status.canary (builders.canary)."""

from __future__ import annotations

import json
from typing import Any

import kopf
import pytest

from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import ANNOTATION_CANARY, LABEL_INFERENCESERVICE, LABEL_TRACK
from kvpilot.operator.builders.canary import (
    CanaryRequest,
    InvalidCanary,
    build_canary_deployment,
    canary_condition,
    canary_status,
    is_canary,
    parse_canary,
    unschedulable,
)
from kvpilot.operator.builders.common import ANNOTATION_CONFIG_HASH, ANNOTATION_ENGINE
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.pods import engine_failure
from kvpilot.operator.builders.render import render_manifests
from kvpilot.operator.handlers import ANNOTATION_PREFIX, DiffBaseStorage, ProgressStorage
from tests.unit.operator.fixtures import isvc, isvc_dict

TUNED = {"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85, "maxNumSeqs": 128}
REQUEST = CanaryRequest(7, dict(TUNED))


def annotated(value: str) -> dict[str, str]:
    return {ANNOTATION_CANARY: value, "other": "x"}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and matchExpressions) applied as the API server applies it."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        value = labels.get(expr["key"])
        if expr["operator"] == "In" and value not in expr["values"]:
            return False
        if expr["operator"] == "NotIn" and value in expr["values"]:
            return False
    return True


# --- the annotation -------------------------------------------------------------------------------


def test_the_annotation_is_read_as_the_tuner_writes_it() -> None:
    text = json.dumps({"trial": 7, "engine": TUNED}, separators=(",", ":"))
    assert parse_canary(annotated(text)) == REQUEST
    assert parse_canary({"other": "x"}) is None and parse_canary(None) is None
    # gpuMemoryUtilization is a float even when the JSON number has no fraction.
    one = parse_canary(annotated(json.dumps({"trial": 0, "engine": {**TUNED, "gpuMemoryUtilization": 1}})))
    assert one is not None and isinstance(one.engine["gpuMemoryUtilization"], float)


@pytest.mark.parametrize(("value", "words", "trial"), [
    ("not json", "is not JSON", None),
    ("[1, 2]", "must be a JSON object", None),
    (json.dumps({"trial": "7", "engine": TUNED}), "trial must be a non-negative integer", None),
    (json.dumps({"trial": True, "engine": TUNED}), "trial must be a non-negative integer", None),
    (json.dumps({"trial": -1, "engine": TUNED}), "trial must be a non-negative integer", None),
    (json.dumps({"trial": 7, "engine": TUNED, "weight": 2}), "unknown keys weight", 7),
    (json.dumps({"trial": 7}), "engine must be an object", 7),
    (json.dumps({"trial": 7, "engine": {**TUNED, "image": "evil/vllm"}}), "engine.image is not a tuned field", 7),
    (json.dumps({"trial": 7, "engine": {"maxNumSeqs": 128}}), "engine.maxNumBatchedTokens is missing", 7),
    (json.dumps({"trial": 7, "engine": {**TUNED, "maxNumSeqs": 12.5}}), "engine.maxNumSeqs must be an integer", 7),
    (json.dumps({"trial": 7, "engine": {**TUNED, "maxNumSeqs": True}}), "engine.maxNumSeqs must be an integer", 7),
    (json.dumps({"trial": 7, "engine": {**TUNED, "gpuMemoryUtilization": "0.9"}}),
     "engine.gpuMemoryUtilization must be a number", 7),
])
def test_a_malformed_annotation_is_refused_naming_what_is_wrong(value: str, words: str, trial: int | None) -> None:
    with pytest.raises(InvalidCanary, match=words) as caught:
        parse_canary(annotated(value))
    assert ANNOTATION_CANARY in str(caught.value) and caught.value.trial == trial


def test_an_annotation_that_makes_no_valid_engine_is_refused_by_the_engine_rules() -> None:
    bad = CanaryRequest(2, {**TUNED, "maxNumBatchedTokens": 64, "maxNumSeqs": 128})
    with pytest.raises(InvalidCanary, match="trial 2 makes no valid engine") as caught:
        build_canary_deployment(isvc(), bad)
    assert "maxNumBatchedTokens" in str(caught.value) and caught.value.trial == 2
    with pytest.raises(InvalidCanary, match="gpuMemoryUtilization"):
        build_canary_deployment(isvc(), CanaryRequest(2, {**TUNED, "gpuMemoryUtilization": 1.5}))


# --- the canary Deployment --------------------------------------------------------------------------


def test_the_canary_runs_the_stable_template_with_the_trials_tuned_fields_on_one_replica() -> None:
    svc = isvc(replicas=3, engine={"maxModelLen": 4096, "maxNumBatchedTokens": 2048})
    stable, canary = build_deployment(svc), build_canary_deployment(svc, REQUEST)
    assert canary["metadata"]["name"] == "llama-canary" and canary["metadata"]["namespace"] == "serving"
    assert canary["spec"]["replicas"] == 1
    # One canary pod at a time: a new trial replaces it, never surges a second one.
    assert canary["spec"]["strategy"] == {"type": "Recreate"}
    engine = json.loads(canary["metadata"]["annotations"][ANNOTATION_ENGINE])
    assert {k: engine[k] for k in TUNED} == TUNED and engine["maxModelLen"] == 4096
    assert canary["metadata"]["annotations"]["kvpilot.dev/tuning-trial"] == "7"
    args = canary["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert args[args.index("--max-num-seqs") + 1] == "128"
    # Everything but the engine flags, the track label and the hash is the stable pod's.
    s_pod, c_pod = stable["spec"]["template"], canary["spec"]["template"]
    s_container, c_container = s_pod["spec"]["containers"][0], c_pod["spec"]["containers"][0]
    assert {k: v for k, v in s_container.items() if k != "args"} == {k: v for k, v in c_container.items() if k != "args"}
    assert {k: v for k, v in s_pod["spec"].items() if k != "containers"} == \
        {k: v for k, v in c_pod["spec"].items() if k != "containers"}
    assert {k: v for k, v in s_pod["metadata"]["labels"].items() if k != LABEL_TRACK} == \
        {k: v for k, v in c_pod["metadata"]["labels"].items() if k != LABEL_TRACK}
    assert c_pod["metadata"]["annotations"][ANNOTATION_CONFIG_HASH] != s_pod["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    assert canary["metadata"]["annotations"][ANNOTATION_CONFIG_HASH] == c_pod["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]


def test_the_canary_is_owned_by_the_inferenceservice_as_its_controller() -> None:
    canary = build_canary_deployment(isvc(), REQUEST)
    [ref] = canary["metadata"]["ownerReferences"]
    assert ref == {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "name": "llama",
                   "uid": "0b7c5a4e-1111-2222-3333-444455556666", "controller": True, "blockOwnerDeletion": True}
    assert is_canary(canary) and not is_canary(build_deployment(isvc()))


def test_the_tracks_are_labelled_and_their_selectors_never_take_each_others_pods() -> None:
    svc = isvc(replicas=2)
    manifests = render_manifests(svc)
    stable = next(m for m in manifests if m["kind"] == "Deployment")
    service = next(m for m in manifests if m["kind"] == "Service")
    canary = build_canary_deployment(svc, REQUEST)
    stable_pod = stable["spec"]["template"]["metadata"]["labels"]
    canary_pod = canary["spec"]["template"]["metadata"]["labels"]
    assert stable_pod[LABEL_TRACK] == "stable" and canary_pod[LABEL_TRACK] == "canary"
    # The stable selector is what it always was (a Deployment's selector is immutable): the track
    # label is on the template only.
    assert stable["spec"]["selector"] == {"matchLabels": {LABEL_INFERENCESERVICE: "llama"}}
    # Each Deployment selects its own template's pods; the canary's selector selects no stable pod,
    # nor a pod made before the track label existed.
    assert selects(stable["spec"]["selector"], stable_pod) and selects(canary["spec"]["selector"], canary_pod)
    assert not selects(canary["spec"]["selector"], stable_pod)
    legacy = {k: v for k, v in stable_pod.items() if k != LABEL_TRACK}
    assert not selects(canary["spec"]["selector"], legacy)
    # The stable selector matches the canary pods (it cannot change), but a ReplicaSet's selector adds
    # pod-template-hash, which differs between the two templates, and both claim only orphans: the
    # canary's pods are its ReplicaSet's.  What the Service sends traffic to is both tracks.
    assert service["spec"]["selector"].items() <= stable_pod.items()
    assert service["spec"]["selector"].items() <= canary_pod.items()


def test_the_stable_template_gains_only_the_track_label() -> None:
    stable = build_deployment(isvc())
    labels = stable["spec"]["template"]["metadata"]["labels"]
    assert labels[LABEL_TRACK] == "stable"
    assert stable["metadata"]["labels"][LABEL_TRACK] == "stable"


# --- status.canary ------------------------------------------------------------------------------------


def canary_deployment(*, ready: int = 0, replicas: int = 1) -> dict[str, Any]:
    dep = build_canary_deployment(isvc(), REQUEST)
    dep["metadata"]["generation"] = 1
    dep["status"] = {"observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas,
                     "readyReplicas": ready, "availableReplicas": ready}
    return dep


def test_the_canary_status_follows_its_deployment() -> None:
    dep = canary_deployment()
    digest = dep["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    progressing = canary_status(trial=7, deployment=dep, previous=None)
    assert progressing == {"trial": 7, "phase": "Progressing", "reason": "CanaryProgressing", "readyReplicas": 0,
                           "configHash": digest, "message": "waiting for the canary pod of trial 7: 0/1 ready"}
    ready = canary_status(trial=7, deployment=canary_deployment(ready=1), previous=progressing)
    assert ready["phase"] == "Ready" and ready["readyReplicas"] == 1 and ready["reason"] == "CanaryReady"
    assert canary_status(trial=7, deployment=None, previous=None)["phase"] == "Progressing"
    invalid = canary_status(trial=None, deployment=None, previous=None, invalid="annotation ... is not JSON")
    assert invalid["phase"] == "Failed" and invalid["reason"] == "InvalidCanary"


def test_an_engine_failure_stays_failed_for_its_template_until_the_pod_is_ready() -> None:
    dep = canary_deployment()
    failed = canary_status(trial=7, deployment=dep, previous=None,
                           problem=("EngineStartupFailed", "canary of trial 7 failed: ... KV cache"))
    assert failed["phase"] == "Failed" and "KV cache" in failed["message"]
    # A later Deployment event (no pod in hand) keeps it.
    assert canary_status(trial=7, deployment=dep, previous=failed) == failed
    # A new trial (another template) starts afresh.
    other = canary_status(trial=8, deployment=dep, previous=failed)
    assert other["phase"] == "Progressing"
    unsched = canary_status(trial=7, deployment=dep, previous=None,
                            problem=("Unschedulable", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."))
    assert unsched["phase"] == "Progressing" and unsched["reason"] == "Unschedulable"
    assert canary_status(trial=7, deployment=canary_deployment(ready=1), previous=unsched)["phase"] == "Ready"
    # Never ready within the Deployment's progress deadline (still unschedulable): Failed, saying why.
    late = canary_deployment()
    late["status"]["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                     "message": 'ReplicaSet "llama-canary-5d8f" has timed out progressing.'}]
    failed_late = canary_status(trial=7, deployment=late, previous=unsched)
    assert failed_late["phase"] == "Failed" and failed_late["reason"] == "ProgressDeadlineExceeded"
    assert "Insufficient nvidia.com/gpu" in failed_late["message"]


def test_the_canary_condition_is_there_only_while_a_canary_is_asked_for() -> None:
    others = [{"type": "Tuning", "status": "True", "reason": "Measuring"}]
    ready = canary_status(trial=7, deployment=canary_deployment(ready=1), previous=None)
    with_it = canary_condition(others, ready, 3, "2026-12-02T00:00:00Z")
    cond = next(c for c in with_it if c["type"] == "Canary")
    assert cond["status"] == "True" and cond["reason"] == "CanaryReady" and cond["observedGeneration"] == 3
    assert canary_condition(with_it, None, 3, "2026-12-02T00:00:00Z") == others


def test_pod_problems_are_read_as_the_scheduler_and_the_kubelet_write_them() -> None:
    pending = {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}}
    assert unschedulable(pending) == "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
    assert unschedulable({"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}) is None
    # The stable track's failure reading applies to canary pods unchanged.
    pod = {"metadata": {"name": "llama-canary-1", "labels": {LABEL_TRACK: "canary"}},
           "status": {"containerStatuses": [{"name": "engine", "restartCount": 3,
                                             "lastState": {"terminated": {"exitCode": 1, "message": "boom"}}}]}}
    failure = engine_failure(pod, crash_loop_restarts=3)
    assert failure is not None and failure.reason == "CrashLoopBackOff" and is_canary(pod)


def test_the_effective_trial_strategy_defaults_by_replicas() -> None:
    def strategy(replicas: int, chosen: str | None = None) -> str:
        tuning = {} if chosen is None else {"trialStrategy": chosen}
        return InferenceService.model_validate(isvc_dict(replicas=replicas, tuning=tuning)).spec.effective_trial_strategy
    assert strategy(1) == "rolling" and strategy(2) == "canary" and strategy(5) == "canary"
    assert strategy(3, "rolling") == "rolling" and strategy(1, "rolling") == "rolling"
    with pytest.raises(ValueError, match=r"tuning\.trialStrategy"):
        strategy(1, "canary")


def test_kopf_diffs_the_canary_annotation_but_still_none_of_its_own() -> None:
    """kopf leaves every annotation under its storage prefix (our group) out of the essence it diffs;
    the operator's storages keep kvpilot.dev/canary in, so a change of it alone runs the reconcile."""
    diffbase = DiffBaseStorage(prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    progress = ProgressStorage(prefix=ANNOTATION_PREFIX)

    def essence(annotations: dict[str, str]) -> Any:
        body = kopf.Body({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                          "metadata": {"name": "llama", "annotations": annotations}, "spec": {"replicas": 2}})
        return progress.clear(essence=diffbase.build(body=body))

    kopfs = {"kvpilot.dev/last-handled-configuration": '{"spec": {}}', "kvpilot.dev/reconcile": '{"retries": 0}'}
    plain = essence(kopfs)
    assert "metadata" not in plain and plain["spec"] == {"replicas": 2}
    assert essence({**kopfs, "kvpilot.dev/tuning-trial": "3"}) == plain  # as before: not diffed
    value = json.dumps({"trial": 1, "engine": TUNED})
    assert essence({**kopfs, ANNOTATION_CANARY: value})["metadata"]["annotations"] == {ANNOTATION_CANARY: value}
    # The diff base kopf stores (and reads back) carries it too: removing it is a change.
    stored = diffbase.build(body=kopf.Body({"metadata": {"annotations": {ANNOTATION_CANARY: value}}, "spec": {}}))
    assert progress.clear(essence=stored)["metadata"]["annotations"] == {ANNOTATION_CANARY: value}
