"""AdmissionReview (admission.k8s.io/v1) for InferenceServices: bytes in, an HTTP status and bytes out.

`Reviewer` answers a review; no HTTP server here (kvpilot.operator.webhook serves it), so every
answer is a plain function call.
The two kinds of "no": docs/architecture.md, "The admission webhook".
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError
from pydantic_core import from_json

from kvpilot.api.documents import brief
from kvpilot.api.models import InferenceService, InferenceServiceSpec
from kvpilot.api.validation import ValidationIssue, advise, check_object
from kvpilot.api.vocabulary import API_VERSION, GROUP, KIND, PLURAL

logger = logging.getLogger("kvpilot.operator.webhook")

ADMISSION_API_VERSION = "admission.k8s.io/v1"
ADMISSION_KIND = "AdmissionReview"
OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
# Kubernetes may truncate warnings beyond 256 characters each, and a screenful helps nobody.
MAX_WARNINGS = 10
MAX_WARNING_CHARS = 256
# JSON values in one review, bounded before it is parsed (see _load): an honest review of an
# InferenceService, an UPDATE with both objects and their last-applied copies, has a few thousand;
# at this many the worst review (every value a validation error) takes ~0.3 s to parse and answer.
MAX_REVIEW_VALUES = 100_000

# Results, as the operator's kvpilot_admission_reviews_total counts them.
ALLOWED = "allowed"
WARNED = "warned"  # allowed, with warnings
INVALID = "invalid"  # denied: a field is invalid
PREDICTED_FAILURE = "predicted_failure"  # denied: vLLM would refuse to start
BAD_REVIEW = "bad_review"  # HTTP 4xx: the review itself is malformed (or too large, or too slow)
RESULTS = (ALLOWED, WARNED, INVALID, PREDICTED_FAILURE, BAD_REVIEW)


class PredictionLike(Protocol):
    """What the webhook reads from a start-up prediction (kvpilot.twin.admission.Prediction)."""

    @property
    def failure(self) -> str | None: ...  # vLLM's start-up error, in vLLM's words; None if it starts

    @property
    def warnings(self) -> Sequence[str]: ...  # risky but legal settings


# The prediction seam: the typed, valid InferenceService in, its predicted start-up out.
Predictor = Callable[[InferenceService], PredictionLike]


class CachedPredictor:
    """`predictor` remembered per spec: the prediction is a pure function of the spec (the model,
    the GPU and the engine's flags; kvpilot.twin.admission.predict reads nothing else), and it costs
    several times a whole review, so the webhook predicts each distinct spec once.  The key is the
    typed spec's canonical JSON (defaults filled in, fields in model order): two specs that mean
    the same share it, and no two that differ do.  The least recently used entries go first.

    The key costs a third of a cached review, so the same typed spec object (the Reviewer hands
    out one per spec it has seen valid) is also found by identity first; each such entry holds its
    spec, so the id cannot be another object's while the entry lives."""

    def __init__(self, predictor: Predictor, size: int = 4096) -> None:
        self.predictor = predictor
        self.size = size
        self._cache: OrderedDict[str, PredictionLike] = OrderedDict()
        self._by_spec: OrderedDict[int, tuple[object, PredictionLike]] = OrderedDict()

    def __call__(self, service: InferenceService) -> PredictionLike:
        spec = service.spec
        same = self._by_spec.get(id(spec))
        if same is not None and same[0] is spec:
            self._by_spec.move_to_end(id(spec))
            return same[1]
        key = spec.model_dump_json()
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
        else:
            found = self._cache[key] = self.predictor(service)
            if len(self._cache) > self.size:
                self._cache.popitem(last=False)
        self._by_spec[id(spec)] = (spec, found)
        if len(self._by_spec) > self.size:
            self._by_spec.popitem(last=False)
        return found


class BadReview(ValueError):
    """The AdmissionReview itself is malformed: an HTTP 400 (or `status`) answer, never a crash."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Answer:
    status: int  # the HTTP status of the webhook's reply
    body: bytes  # JSON: an AdmissionReview (200) or a metav1.Status (4xx)
    result: str  # one of RESULTS


def _load(body: bytes) -> Any:
    # The parser builds every object and array before anything can look at them: 8 MiB of "[],"
    # is 2.8 million lists, half a second to a second and a half of the event loop, and four such
    # reviews delayed an honest one past the API server's timeout.  So the values are bounded before
    # parsing: every value in an object or array but the first follows a comma, so commas and
    # opening brackets bound the count (those inside strings too: an over-count, three C scans of
    # the body; none for a body too short to hold more).  Strings and numbers, however long, parse
    # at memory speed.
    if len(body) > MAX_REVIEW_VALUES and (
            values := body.count(b",") + body.count(b"[") + body.count(b"{")) > MAX_REVIEW_VALUES:
        raise BadReview(f"the body has {values} commas and opening brackets, more than the {MAX_REVIEW_VALUES} "
                        "allowed (each JSON object, array and member takes one; an InferenceService's review "
                        "has a few thousand)", 413)
    # pydantic-core's JSON parser (jiter): a third of json.loads's time on a review, and strict JSON
    # (no NaN or Infinity, nesting past 200 levels refused: no Kubernetes object comes near that).
    try:
        return from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise BadReview(f"the body is not JSON: {exc}") from None


def _mapping(parent: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if not isinstance(value, dict):
        got = "missing" if key not in parent else _json_type(value)
        raise BadReview(f"{where}{key} must be an object (got {got})")
    return value


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object", type(None): "null"}.get(
        type(value), type(value).__name__)


def parse_review(body: bytes) -> Mapping[str, Any]:
    """The review's `request`, checked as far as this webhook relies on it; BadReview otherwise."""
    review = _load(body)
    if not isinstance(review, dict):
        raise BadReview(f"an AdmissionReview must be a JSON object (got {_json_type(review)})")
    if review.get("apiVersion") != ADMISSION_API_VERSION:
        raise BadReview(f"apiVersion must be {ADMISSION_API_VERSION} (got {brief(review.get('apiVersion'))}); "
                        "this webhook takes admissionReviewVersions [v1] only")
    if review.get("kind") != ADMISSION_KIND:
        raise BadReview(f"kind must be {ADMISSION_KIND} (got {brief(review.get('kind'))})")
    request = _mapping(review, "request", "")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview(f"request.uid must be a non-empty string (got {brief(uid)})")
    operation = request.get("operation")
    if operation not in OPERATIONS:
        raise BadReview(f"request.operation must be one of {', '.join(OPERATIONS)} (got {brief(operation)})")
    gvk = _mapping(request, "kind", "request.")
    if gvk.get("group") != GROUP or gvk.get("kind") != KIND:
        raise BadReview(f"this webhook reviews {GROUP} {KIND} objects only (request.kind is "
                        f"{brief(gvk.get('group'))} {brief(gvk.get('kind'))}); check the "
                        "ValidatingWebhookConfiguration's rules")
    resource = request.get("resource")
    if isinstance(resource, dict) and resource.get("resource") not in (None, PLURAL):
        raise BadReview(f"this webhook reviews {PLURAL} only (request.resource.resource is "
                        f"{brief(resource.get('resource'))})")
    if operation in ("CREATE", "UPDATE"):
        _mapping(request, "object", "request.")
    if operation == "UPDATE":
        _mapping(request, "oldObject", "request.")
    return request


def _status(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"metadata": {}, "status": "Failure", "message": message,
                              "reason": reason, "code": code}
    if details:
        status["details"] = details
    return status


def _bad(exc: BadReview) -> Answer:
    reason = {400: "BadRequest", 404: "NotFound", 405: "MethodNotAllowed", 408: "Timeout",
              413: "RequestEntityTooLarge", 415: "UnsupportedMediaType"}
    prefix = "" if exc.status in (404, 405) else "malformed AdmissionReview: "
    status = {"kind": "Status", "apiVersion": "v1",
              **_status(exc.status, reason.get(exc.status, "BadRequest"), f"{prefix}{exc}")}
    return Answer(exc.status, json.dumps(status, separators=(",", ":")).encode(), BAD_REVIEW)


def bad_review_answer(message: str, status: int = 400) -> Answer:
    """The answer to a review the server refused before reading it (too large, too slow)."""
    return _bad(BadReview(message, status))


def _object_name(request: Mapping[str, Any], obj: Mapping[str, Any]) -> str:
    name = request.get("name")
    if not isinstance(name, str) or not name:
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        name = meta.get("name") or meta.get("generateName") or ""
    return str(name)[:253]


def _cause(issue: ValidationIssue) -> dict[str, str]:
    reason = "FieldValueRequired" if issue.message == "required field is missing" else "FieldValueInvalid"
    return {"reason": reason, "message": issue.message, "field": issue.path}


def _warnings(found: Sequence[str]) -> list[str]:
    out = []
    for text in list(found)[:MAX_WARNINGS]:
        line = " ".join(str(text).split())  # one line: the API server sends warnings in a header
        out.append(line if len(line) <= MAX_WARNING_CHARS else line[: MAX_WARNING_CHARS - 3] + "...")
    return out


# A spec longer than this is checked in full every time rather than kept (an honest spec is ~1 KB).
_MAX_SPEC_KEY_CHARS = 16384
_ALLOWED_HEAD = f'{{"apiVersion":"{ADMISSION_API_VERSION}","kind":"{ADMISSION_KIND}","response":{{"uid":'.encode()
_ALLOWED_TAIL = b',"allowed":true}}'


@dataclass(slots=True)
class Reviewer:
    """Answers AdmissionReviews for InferenceServices.

    `predictor`, when given, predicts vLLM's start-up for every valid engine (the seam for
    kvpilot.twin.admission.predict); without one the webhook runs the validation only."""

    predictor: Predictor | None = None
    # Valid specs already checked, by their JSON: see check.
    specs: OrderedDict[str, InferenceServiceSpec] = field(default_factory=OrderedDict, repr=False)
    spec_cache_size: int = 1024

    def answer(self, body: bytes) -> Answer:
        try:
            request = parse_review(body)
        except BadReview as exc:
            return _bad(exc)
        response, result = self.decide(request)
        if len(response) == 2 and response["allowed"] is True:  # the usual answer, without the encoder
            return Answer(200, _ALLOWED_HEAD + json.dumps(response["uid"], ensure_ascii=False).encode()
                          + _ALLOWED_TAIL, result)
        review = {"apiVersion": ADMISSION_API_VERSION, "kind": ADMISSION_KIND, "response": response}
        return Answer(200, json.dumps(review, ensure_ascii=False, separators=(",", ":")).encode(), result)

    def check(self, obj: Any) -> tuple[InferenceService | None, list[ValidationIssue]]:
        """`check_object`, with each valid spec validated once.  The spec is most of the work (nested
        models, their cross-field rules) and its result depends on the spec alone, so a spec seen
        valid before is not validated again: the object is validated with that typed spec in its
        place, which checks the rest (metadata, status) as ever.  The key is the parsed spec's repr:
        for JSON's values it is exact (1, 1.0 and true apart, key order and all, a third faster than
        json.dumps), so only a spec that would validate the same finds an entry.  Any failure takes
        the full check, so every denial reads as it always did."""
        spec = obj.get("spec") if isinstance(obj, dict) else None
        key = None
        if isinstance(spec, dict) and obj.get("apiVersion") == API_VERSION and obj.get("kind") == KIND:
            try:
                key = repr(spec)
            except ValueError:  # an integer past Python's 4,300 digits: checked in full, and refused
                key = None
            if key is not None and len(key) > _MAX_SPEC_KEY_CHARS:
                key = None
            elif key is not None and (known := self.specs.get(key)) is not None:
                self.specs.move_to_end(key)
                try:
                    return InferenceService.model_validate({**obj, "spec": known}, strict=True), []
                except ValidationError:
                    pass
        service, issues = check_object(obj)
        if service is not None and key is not None:
            self.specs[key] = service.spec
            if len(self.specs) > self.spec_cache_size:
                self.specs.popitem(last=False)
        return service, issues

    def decide(self, request: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
        """The AdmissionResponse for a well-formed request, and its result."""
        uid = request["uid"]
        operation = request["operation"]
        if operation not in ("CREATE", "UPDATE") or request.get("subResource"):
            return {"uid": uid, "allowed": True}, ALLOWED  # deletes, and status writes if ever routed here
        obj = request["object"]
        if operation == "UPDATE" and _unchanged(obj, request["oldObject"]):
            # Metadata only (labels, finalizers, kopf's annotations), or a deletion in progress:
            # never block the operator's own bookkeeping, nor the removal of an object that was
            # admitted before this webhook (or these rules) existed.
            return {"uid": uid, "allowed": True}, ALLOWED
        service, issues = self.check(obj)
        if service is None:
            name = _object_name(request, obj)
            message = f'{KIND}.{GROUP} "{name}" is invalid: ' + (
                str(issues[0]) if len(issues) == 1 else "[" + "; ".join(str(i) for i in issues) + "]")
            details = {"name": name, "group": GROUP, "kind": KIND,
                       "causes": [_cause(i) for i in issues]}
            return {"uid": uid, "allowed": False, "status": _status(422, "Invalid", message, details)}, INVALID
        advice = [str(w) for w in advise(service)]
        if self.predictor is None:
            return ({"uid": uid, "allowed": True, "warnings": _warnings(advice)}, WARNED) if advice \
                else ({"uid": uid, "allowed": True}, ALLOWED)
        try:
            prediction = self.predictor(service)
        except Exception as exc:  # a bug of ours must not block applies: validation above still held
            logger.exception("start-up prediction failed for %s", _object_name(request, obj))
            warning = f"start-up not predicted: the prediction failed ({type(exc).__name__}: {exc})"
            return {"uid": uid, "allowed": True, "warnings": _warnings([*advice, warning])}, WARNED
        if prediction.failure:
            name = _object_name(request, obj)
            why = f"vLLM would refuse to start this engine: {' '.join(str(prediction.failure).split())}"
            message = f'{KIND}.{GROUP} "{name}" is invalid: spec.engine: {why}'
            # The cause is what kubectl prints for an Invalid answer (it shows causes, not the message).
            details = {"name": name, "group": GROUP, "kind": KIND,
                       "causes": [{"reason": "FieldValueInvalid", "message": why, "field": "spec.engine"}]}
            response = {"uid": uid, "allowed": False, "status": _status(422, "Invalid", message, details)}
            return response, PREDICTED_FAILURE
        warnings = _warnings([*advice, *prediction.warnings])
        if warnings:
            return {"uid": uid, "allowed": True, "warnings": warnings}, WARNED
        return {"uid": uid, "allowed": True}, ALLOWED


def _unchanged(new: Mapping[str, Any], old: Any) -> bool:
    meta = new.get("metadata")
    if isinstance(meta, dict) and meta.get("deletionTimestamp"):
        return True
    return (isinstance(old, dict) and new.get("spec") == old.get("spec")
            and new.get("apiVersion") == old.get("apiVersion") and new.get("kind") == old.get("kind"))
