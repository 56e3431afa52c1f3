"""The CRD's `x-kubernetes-validations` rules run by a real CEL implementation, as the API server runs them.

Two independent CEL implementations from PyPI: `common-expression-language` (bindings to the Rust
`cel` interpreter) evaluates every rule; `cel-python` (celpy, pure Python) evaluates the rules that
use only standard CEL, as a second opinion. Kubernetes adds a quantity library to CEL
(`quantity(s).isGreaterThan(q)`, `isInteger()`, `compareTo(q)`, ...); it is registered here over the
official Kubernetes client's `parse_quantity`, not over kvpilot's own parser, so a rule and the
pydantic check it mirrors are compared against a reading of quantities neither of them wrote.

What this cannot show: the API server's type checking against the schema and its cost budget;
the `cluster` tests (tests/cluster/test_crd.py) install the CRD in a real kube-apiserver for that.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import cel
import celpy
from kubernetes.utils import parse_quantity

# The member functions of Kubernetes' CEL quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go)
# that kvpilot's rules use. A quantity is carried as its text; each function parses it again.
QUANTITY_FUNCTIONS = ("quantity", "isGreaterThan", "isLessThan", "compareTo", "isInteger", "sign")


def _q(text: str) -> Decimal:
    return Decimal(parse_quantity(text))


def _quantity(text: str) -> str:
    _q(text)  # an unparsable quantity is an evaluation error, as in the API server
    return text


def _compare(a: str, b: str) -> int:
    x, y = _q(a), _q(b)
    return (x > y) - (x < y)


def _context(obj: dict[str, Any]) -> cel.Context:
    ctx = cel.Context({"self": obj})
    ctx.add_function("quantity", _quantity)
    ctx.add_function("isGreaterThan", lambda a, b: _compare(a, b) > 0)
    ctx.add_function("isLessThan", lambda a, b: _compare(a, b) < 0)
    ctx.add_function("compareTo", _compare)
    ctx.add_function("isInteger", lambda a: _q(a) == _q(a).to_integral_value())
    ctx.add_function("sign", lambda a: _compare(a, "0"))
    return ctx


@dataclass(frozen=True)
class Rule:
    """One `x-kubernetes-validations` entry and where it sits in the schema."""

    node: tuple[str, ...]  # the object the rule's `self` is, e.g. ("spec", "engine")
    rule: str
    message: str
    field_path: str  # relative, e.g. ".maxNumSeqs"

    @property
    def error_path(self) -> str:
        """Where the API server reports a refusal: the node's path plus the rule's fieldPath."""
        return ".".join(self.node) + self.field_path

    @property
    def standard(self) -> bool:
        """True when the rule needs no Kubernetes CEL library (so any CEL implementation runs it)."""
        return "quantity(" not in self.rule


def rules(schema: dict[str, Any]) -> list[Rule]:
    found: list[Rule] = []

    def walk(node: dict[str, Any], path: tuple[str, ...]) -> None:
        for entry in node.get("x-kubernetes-validations", []):
            found.append(Rule(path, entry["rule"], entry["message"], entry.get("fieldPath", "")))
        for key, child in node.get("properties", {}).items():
            walk(child, (*path, key))

    walk(schema, ())
    return found


def default(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it before validation: a missing property with a
    `default` gets it, then defaulting goes on inside every property present."""
    if not isinstance(obj, dict) or schema.get("type") != "object":
        return obj
    out = dict(obj)
    for key, sub in schema.get("properties", {}).items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = default(sub, out[key])
    return out


def node_at(obj: Any, path: tuple[str, ...]) -> Any | None:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


class EvaluationError(Exception):
    pass


@functools.cache
def _program(text: str) -> Any:
    return cel.compile(text)


def evaluate(rule: Rule, self_value: Any) -> bool:
    """The rule's verdict on `self_value` (its node), by the Rust interpreter; EvaluationError when
    the rule errors at run time (the API server reports that as a refusal of its own)."""
    try:
        result = _program(rule.rule).execute(_context(self_value))
    except Exception as exc:  # the bindings raise ValueError/TypeError/RuntimeError by kind
        raise EvaluationError(f"{rule.rule}: {exc}") from exc
    if not isinstance(result, bool):
        raise EvaluationError(f"{rule.rule} returned {result!r}, not a bool")
    return result


_CELPY = celpy.Environment()


def evaluate_celpy(rule: Rule, self_value: Any) -> bool:
    """The same verdict by cel-python, for standard rules only (it has no quantity library)."""
    program = _CELPY.program(_CELPY.compile(rule.rule))
    result = program.evaluate({"self": celpy.json_to_cel(self_value)})
    if isinstance(result, celpy.CELEvalError):
        raise EvaluationError(f"{rule.rule}: {result}")
    return bool(result)


def failures(schema_root: dict[str, Any], doc: dict[str, Any]) -> Iterator[tuple[Rule, bool | None]]:
    """Each rule whose node is present in the defaulted document, with its verdict (None: it errored)."""
    defaulted = default(schema_root, doc)
    for rule in rules(schema_root):
        value = node_at(defaulted, rule.node)
        if value is None:
            continue
        try:
            yield rule, evaluate(rule, value)
        except EvaluationError:
            yield rule, None
