"""Validation of InferenceService manifests, as users (and the admission path) see it.

One function, `validate_object`, turns anything (a parsed YAML document) into a list of
issues, each naming the field path and what is allowed.  `kvpilot validate`, the operator's
InvalidSpec condition and the admission webhook (kvpilot.operator.reviews) all print exactly
these messages.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from kvpilot.api import engine, kube, rules
from kvpilot.api.documents import DocumentError, brief
from kvpilot.api.documents import load_documents as load_documents
from kvpilot.api.gpus import gpu_type_warning
from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import API_VERSION, KIND

PATTERN_MESSAGES: dict[str, str] = {**kube.PATTERN_MESSAGES, **engine.PATTERN_MESSAGES}

# Past this many problems in one document, the rest are counted, not listed: a document with
# thousands of wrong values needs its first few fixed, not a screenful.
MAX_ISSUES = 50


@dataclass(frozen=True, slots=True)
class ValidationIssue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass(frozen=True, slots=True)
class DocumentResult:
    index: int  # 0-based position in the YAML stream
    name: str | None  # namespace/name when the document got that far
    issues: list[ValidationIssue]
    warnings: list[ValidationIssue] = dataclasses.field(default_factory=list)  # legal, but likely not what was meant
    item: int | None = None  # 0-based position in the document's List, when it is one

    @property
    def valid(self) -> bool:
        return not self.issues

    @property
    def label(self) -> str:
        item = f" item {self.item + 1}" if self.item is not None else ""
        return f"document {self.index + 1}{item}" + (f" ({self.name})" if self.name else "")


_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_.$-]{0,100}")


def format_path(loc: tuple[str | int, ...]) -> str:
    """`spec.engine.extraArgs[0]`; a key that is not a plain name (a newline, a quote, a very long
    one) is shown quoted, `spec.tuning.space["\\n"]`, so a path is always one short line."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(str(part)):
            out += f".{part}" if out else str(part)
        else:
            key = str(part)
            out += f"[{json.dumps(key if len(key) <= 60 else key[:57] + '...')}]"
    return out


def _model_at(loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model class whose field `loc` names (for listing the allowed fields)."""
    model: Any = InferenceService
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        model = _unwrap(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    # `X | None` and `list[X]` lead to X, which is where nested fields live.
    for arg in get_args(annotation) if get_origin(annotation) is not None else ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return annotation


def _message(error: ErrorDetails) -> str:
    kind = error["type"]
    if kind == "kvpilot_rule":
        return str(error["msg"])
    if kind == "extra_forbidden":
        parent = _model_at(tuple(error["loc"][:-1]))
        allowed = sorted((f.alias or n) for n, f in parent.model_fields.items()) if parent else []
        return "unknown field" + (f"; allowed here: {', '.join(allowed)}" if allowed else "")
    if kind == "missing":
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        pattern = (error.get("ctx") or {}).get("pattern")
        if pattern in PATTERN_MESSAGES:
            return f"{PATTERN_MESSAGES[pattern]} (got {brief(error.get('input'))})"
    message = str(error["msg"])
    if kind.endswith("_type") or kind.endswith("_parsing") or kind in ("literal_error", "string_pattern_mismatch"):
        message += f" (got {brief(error.get('input'))})"
    return message


def issues_from_error(error: ValidationError) -> list[ValidationIssue]:
    errors = error.errors(include_url=False)
    issues = [ValidationIssue(format_path(tuple(e["loc"])), _message(e)) for e in errors[:MAX_ISSUES]]
    if len(errors) > MAX_ISSUES:
        issues.append(ValidationIssue("", f"... and {len(errors) - MAX_ISSUES} more problems"))
    return issues


def validate_object(obj: Any) -> list[ValidationIssue]:
    """Every problem with one InferenceService document; an empty list means valid."""
    return check_object(obj)[1]


def check_object(obj: Any) -> tuple[InferenceService | None, list[ValidationIssue]]:
    """`validate_object` that also hands back the typed object when it is valid (one validation,
    for callers that go on with the object: the admission webhook predicts its start-up)."""
    if not isinstance(obj, dict):
        return None, [ValidationIssue("", f"an InferenceService must be a mapping (got {type(obj).__name__})")]
    head: list[ValidationIssue] = []
    if obj.get("apiVersion") != API_VERSION:
        head.append(ValidationIssue("apiVersion", f"must be {API_VERSION} (got {brief(obj.get('apiVersion'))})"))
    if obj.get("kind") != KIND:
        head.append(ValidationIssue("kind", f"must be {KIND} (got {brief(obj.get('kind'))})"))
    if head:
        # Another kind's fields would only bury the real problem under noise.
        return None, head
    try:
        return strict_validate(obj), []
    except ValidationError as exc:
        return None, issues_from_error(exc)


def advise(service: InferenceService) -> list[ValidationIssue]:
    """Warnings for a valid InferenceService: values the API allows that are most likely mistakes."""
    found: list[ValidationIssue] = []
    gpu_type = service.spec.resources.gpu_type
    if gpu_type is not None and (why := gpu_type_warning(gpu_type)) is not None:
        found.append(ValidationIssue("spec.resources.gpuType", why))
    if (outside := rules.replicas_outside_bounds(service.spec)) is not None:
        found.append(ValidationIssue("spec.replicas", outside))
    return found


def strict_validate(obj: Any) -> InferenceService:
    """Validate as the API server would: types as the CRD has them (no "3" for an integer)."""
    return InferenceService.model_validate(obj, strict=True)


def parse_inference_service(obj: Any) -> InferenceService:
    """The typed object, or ValueError whose message lists every issue with its path."""
    issues = validate_object(obj)
    if issues:
        raise InvalidInferenceService(issues)
    return strict_validate(obj)


class InvalidInferenceService(ValueError):
    def __init__(self, issues: list[ValidationIssue]) -> None:
        self.issues = issues
        super().__init__("; ".join(str(i) for i in issues))


def _name_of(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return None
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return None
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if isinstance(namespace, str) else meta["name"]


@dataclass(frozen=True, slots=True)
class ParsedDocument:
    index: int
    obj: Any
    result: DocumentResult


def _is_list(doc: Any) -> bool:
    """A v1 List (`kubectl get ... -o yaml`) or an InferenceServiceList: read item by item, as kubectl does."""
    return isinstance(doc, dict) and doc.get("kind") in ("List", f"{KIND}List") \
        and isinstance(doc.get("items"), list)


def parse_text(data: bytes | str) -> list[ParsedDocument]:
    """Every document of a multi-document YAML stream with its validation result.

    A stream that cannot be read (too large, not UTF-8, not YAML, too deep, an alias bomb) ends
    in one document result whose single issue says where and why; the documents before it keep
    their own results."""
    parsed: list[ParsedDocument] = []
    index = 0
    try:
        for doc in load_documents(data):
            items = doc.get("items") if _is_list(doc) else None
            for item, obj in enumerate(items) if isinstance(items, list) else [(None, doc)]:
                service, issues = check_object(obj)
                warnings = advise(service) if service is not None else []
                result = DocumentResult(index, _name_of(obj), issues, warnings, item)
                parsed.append(ParsedDocument(index, obj, result))
            index += 1
    except DocumentError as exc:
        # The stream is walked whole before any document is built: the error names the document it is in.
        where = max(index, exc.document) if exc.document is not None else index
        parsed.append(ParsedDocument(where, None, DocumentResult(where, None, [ValidationIssue("", str(exc))])))
    if not parsed:
        parsed.append(ParsedDocument(0, None, DocumentResult(0, None, [ValidationIssue("", "no YAML document found")])))
    return parsed


def validate_text(data: bytes | str) -> list[DocumentResult]:
    """Validate a multi-document YAML stream; a YAML error becomes one issue with its line and column."""
    return [p.result for p in parse_text(data)]
