"""kvpilot.operator.reviews without HTTP: the prediction cache (the HTTPS behaviour is in
tests/integration/operator/test_webhook.py)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpilot.api.validation import strict_validate
from kvpilot.operator.reviews import BAD_REVIEW, MAX_REVIEW_VALUES, CachedPredictor, Reviewer

FULL = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "full.yaml").read_text())


@dataclass
class Counted:
    calls: list[Any] = field(default_factory=list)

    def __call__(self, service: Any) -> Any:
        self.calls.append(service)
        return f"prediction {len(self.calls)}"


def service(**engine: Any) -> Any:
    obj = copy.deepcopy(FULL)
    obj["spec"]["engine"].update(engine)
    return strict_validate(obj)


def test_each_distinct_spec_is_predicted_once_and_the_oldest_is_forgotten_first() -> None:
    inner = Counted()
    cached = CachedPredictor(inner, size=2)
    a, b, c = service(maxNumSeqs=64), service(maxNumSeqs=128), service(maxNumSeqs=256)
    assert cached(a) == cached(service(maxNumSeqs=64)) == "prediction 1"  # same spec, another object
    assert cached(b) == "prediction 2"
    assert cached(a) == "prediction 1"  # a is now the most recently used
    assert cached(c) == "prediction 3"  # b goes
    assert cached(a) == "prediction 1"
    assert cached(b) == "prediction 4"
    assert len(inner.calls) == 4


def test_specs_that_differ_anywhere_are_predicted_apart_and_metadata_does_not_matter() -> None:
    inner = Counted()
    cached = CachedPredictor(inner)
    renamed = copy.deepcopy(FULL)
    renamed["metadata"]["name"] = "another"
    gpu = copy.deepcopy(FULL)
    gpu["spec"]["resources"]["gpuType"] = "NVIDIA-L4"
    first = cached(strict_validate(FULL))
    assert cached(strict_validate(renamed)) == first
    assert cached(strict_validate(gpu)) != first


def test_the_twins_prediction_reads_the_spec_only() -> None:
    """What makes the spec a complete cache key."""
    from kvpilot.twin.admission import predict

    obj = copy.deepcopy(FULL)
    obj["spec"]["resources"]["gpuType"] = "NVIDIA-H100-80GB-HBM3"
    typed = strict_validate(obj)
    assert predict(typed) == predict(typed.spec)


def test_the_answers_docs_webhook_md_shows_are_the_webhooks() -> None:
    """docs/webhook.md quotes the webhook's answer for each service of docs/examples/predict.yaml."""
    import json
    import re

    from kvpilot.cli import twin_predictor as predictor
    from kvpilot.operator.reviews import Reviewer

    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "webhook.md").read_text()
    (block,) = re.findall(r"^```json\n(.*?)^```", text, flags=re.S | re.M)
    shown = [json.loads(line) for line in block.splitlines()]
    reviewer = Reviewer(predictor=predictor())
    answered = []
    for obj in yaml.safe_load_all((root / "docs" / "examples" / "predict.yaml").read_text()):
        if obj["kind"] != "InferenceService":
            continue
        review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "1", "operation": "CREATE", "name": obj["metadata"]["name"], "namespace": "inference",
            "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"}, "object": obj}}
        answer = reviewer.answer(json.dumps(review).encode())
        answered.append({"name": obj["metadata"]["name"], "response": json.loads(answer.body)["response"]})
    assert shown == answered
    for warning in (w for a in answered for w in a["response"].get("warnings", [])):
        if "KV cache" in warning:
            assert f"Warning: {warning}" in text  # the kubectl sample shows a real warning


def test_the_cli_gives_the_operator_the_twins_predictor() -> None:
    """The operator does not import the twin: `kvpilot operator` gets the twin's start-up prediction from
    the CLI layer, remembered per spec."""
    from kvpilot.cli import build_parser, twin_predictor
    from kvpilot.operator.reviews import CachedPredictor
    from kvpilot.twin.admission import predict

    args = build_parser().parse_args(["operator"])
    assert args.predictor is twin_predictor
    made = args.predictor()
    assert isinstance(made, CachedPredictor) and made.predictor is predict


def test_a_misspelt_gpu_type_is_admitted_with_a_warning_kubectl_shows() -> None:
    import json

    from kvpilot.operator.reviews import Reviewer

    obj = copy.deepcopy(FULL)
    obj["spec"]["resources"]["gpuType"] = "H1OO"
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u1", "operation": "CREATE", "object": obj, "oldObject": None,
                          "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"},
                          "resource": {"group": "kvpilot.dev", "version": "v1alpha1", "resource": "inferenceservices"},
                          "name": "llama-8b-chat", "namespace": "inference"}}
    response = json.loads(Reviewer().answer(json.dumps(review).encode()).body)["response"]
    assert response["allowed"] is True
    assert [w for w in response["warnings"] if w.startswith("spec.resources.gpuType: 'H1OO'")]
    obj["spec"]["resources"]["gpuType"] = "H100-80GB"
    response = json.loads(Reviewer().answer(json.dumps(review).encode()).body)["response"]
    assert response == {"uid": "u1", "allowed": True}


def test_replicas_outside_the_autoscaling_bounds_are_admitted_with_a_warning_and_max_below_min_refused() -> None:
    obj = copy.deepcopy(FULL)
    obj["spec"]["replicas"] = 12  # full.yaml's bounds are [2, 8]
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
              "request": {"uid": "u1", "operation": "CREATE", "object": obj, "oldObject": None,
                          "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"},
                          "resource": {"group": "kvpilot.dev", "version": "v1alpha1", "resource": "inferenceservices"},
                          "name": "llama-8b-chat", "namespace": "inference"}}
    response = json.loads(Reviewer().answer(json.dumps(review).encode()).body)["response"]
    assert response["allowed"] is True
    assert response["warnings"] == ["spec.replicas: 12 is outside autoscaling [minReplicas 2, maxReplicas 8]; kvpilot's "
                                    "planner (actor: kvpilot) moves it inside at its next decision"]
    obj["spec"]["autoscaling"]["maxReplicas"] = 1
    response = json.loads(Reviewer().answer(json.dumps(review).encode()).body)["response"]
    assert response["allowed"] is False
    assert response["status"]["details"]["causes"] == [{"reason": "FieldValueInvalid", "field":
                                                         "spec.autoscaling.maxReplicas",
                                                         "message": "must be at least minReplicas (2); got 1"}]


def _update_review() -> bytes:
    """An UPDATE as the API server sends it for `kubectl apply`: both objects, each with its
    last-applied copy in an annotation (every bracket and comma of the object again, in a string)."""
    new, old = copy.deepcopy(FULL), copy.deepcopy(FULL)
    new["spec"]["engine"]["maxNumSeqs"] = 128
    for obj in (new, old):
        obj["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": json.dumps(obj)}
    request = {"uid": "u-1", "operation": "UPDATE", "object": new, "oldObject": old,
               "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"}}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def test_json_values_are_bounded_before_parsing_far_above_an_honest_review() -> None:
    honest = _update_review()
    counted = honest.count(b",") + honest.count(b"[") + honest.count(b"{")
    assert counted * 100 < MAX_REVIEW_VALUES, counted
    assert Reviewer().answer(honest).status == 200
    at_bound = b'{"v":[' + b"0," * (MAX_REVIEW_VALUES - 2) + b"0]}"  # two brackets, bound - 2 commas
    answer = Reviewer().answer(at_bound)
    assert (answer.status, answer.result) == (400, BAD_REVIEW)  # parsed: not an AdmissionReview
    assert b"apiVersion must be" in answer.body
    past = Reviewer().answer(at_bound.replace(b"[", b"[0,", 1))
    assert (past.status, past.result) == (413, BAD_REVIEW)
    message = json.loads(past.body)["message"]
    assert message == ("malformed AdmissionReview: the body has 100001 commas and opening brackets, more than "
                       "the 100000 allowed (each JSON object, array and member takes one; an InferenceService's "
                       "review has a few thousand)")


def _review_of(obj: Any, operation: str = "CREATE", old: Any = None, uid: str = "u-1") -> bytes:
    request = {"uid": uid, "operation": operation, "object": obj, "oldObject": old,
               "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"}}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def _variants() -> list[bytes]:
    """Specs valid and not, each under metadata valid and not: what a spec seen before must not hide."""
    bodies = []
    for i, engine in enumerate(({}, {"maxNumSeqs": 128}, {"blockSize": 7}, {"maxNumSeqs": 128.0},
                                {"maxNumSeqs": True})):
        for meta in ({}, {"name": "Bad_Name"}, {"labels": {"team": 1}}, {"namespace": ""}):
            obj = copy.deepcopy(FULL)
            obj["spec"]["engine"].update(engine)
            obj["metadata"].update(meta)
            bodies.append(_review_of(obj, uid=f"u-{i}"))
        moved = copy.deepcopy(FULL)
        moved["spec"]["engine"].update(engine)
        moved["status"] = {"replicas": "two"}
        bodies.append(_review_of(moved, "UPDATE", old=FULL, uid=f"s-{i}"))
    return bodies


@dataclass
class Allowed:
    failure: str | None = None
    warnings: list[str] = field(default_factory=list)


def test_a_spec_seen_before_gets_the_same_answer_as_a_fresh_reviewer_gives() -> None:
    predicted: list[Any] = []
    seen = Reviewer(predictor=CachedPredictor(lambda svc: predicted.append(svc) or Allowed()))
    bodies = _variants()
    first = [seen.answer(b) for b in bodies]
    again = [seen.answer(b) for b in bodies]
    fresh = [Reviewer(predictor=lambda _svc: Allowed()).answer(b) for b in bodies]
    assert again == first == fresh
    assert {a.result for a in first} == {"allowed", "invalid"}
    assert len(seen.specs) == 2  # the two valid specs ({} and maxNumSeqs 128), each typed once
    assert len(predicted) == 2  # and predicted once
    assert b'"allowed":true' in first[0].body and json.loads(first[0].body) == {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": "u-0", "allowed": True}}
