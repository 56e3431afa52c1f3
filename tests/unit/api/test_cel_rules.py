"""The CRD's CEL rules and the pydantic rules they mirror agree, case by case.

The API server enforces the CEL rules (`kubectl apply` is refused); `kvpilot validate`, the operator
and (later) the admission webhook enforce the pydantic ones. A user must get the same answer from
both. Every rule is compiled and evaluated by a real CEL implementation (tests/support/cel.py) on the
document the API server would see (its structural defaults applied), over the malformed corpus,
the examples, and a seeded set of generated documents whose fields are each valid on their own, so
that any refusal comes from a cross-field or value rule.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import cel
import pytest
import yaml

from kvpilot.api import crd as crd_module
from kvpilot.api import vllm
from kvpilot.api.validation import validate_object
from tests.support import cel as kcel
from tests.unit.api.corpus import BASE, CASES

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = crd_module.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
RULES = kcel.rules(SCHEMA)
CEL_PATHS = {rule.error_path for rule in RULES}
SPEC_LEVEL_PATHS = {rule.error_path for rule in RULES if rule.node == ("spec",)}


def test_every_rule_compiles_in_two_cel_implementations() -> None:
    assert len(RULES) == sum(len(v) for v in crd_module._CEL_RULES.values()) >= 20
    for rule in RULES:
        cel.compile(rule.rule)
        kcel._CELPY.compile(rule.rule)


def test_the_quantity_library_reads_quantities_as_kubernetes_does() -> None:
    """The control case for the library registered over the official client's parser."""
    true = kcel.Rule(("x",), "quantity('1500m').compareTo(quantity('1')) > 0 && !quantity('1500m').isInteger() "
                     "&& quantity('1Gi').isGreaterThan(quantity('1G')) && quantity('1e3').isInteger()", "", "")
    assert kcel.evaluate(true, {}) is True
    with pytest.raises(kcel.EvaluationError):
        kcel.evaluate(kcel.Rule(("x",), "quantity('lots').isInteger()", "", ""), {})


def refused_paths(doc: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for issue in validate_object(doc):
        out.setdefault(issue.path, []).append(issue.message)
    return out


def verdicts(doc: dict[str, Any]) -> list[tuple[kcel.Rule, bool | None]]:
    return list(kcel.failures(SCHEMA, doc))


# ---- the malformed corpus and the examples -------------------------------------------------------

@pytest.mark.parametrize(("case_id", "doc", "path", "needle"), [c for c in CASES if isinstance(c[1], dict)],
                         ids=[c[0] for c in CASES if isinstance(c[1], dict)])
def test_every_cel_refusal_of_a_corpus_case_is_a_kvpilot_refusal_at_the_same_field(
        case_id: str, doc: dict[str, Any], path: str, needle: str) -> None:
    refused = refused_paths(doc)
    for rule, verdict in verdicts(doc):
        if verdict is False:
            assert rule.error_path in refused, (rule.rule, refused)


def test_the_corpus_case_of_each_cel_rule_is_refused_by_that_rule() -> None:
    """Each rule's own malformed case (its field, a word of its message) fails in CEL, not only in
    the API server of the cluster tests: a rule that can never fire would pass everything else."""
    unfired = []
    for rule in RULES:
        mine = [doc for _, doc, path, needle in CASES
                if isinstance(doc, dict) and path == rule.error_path and needle in rule.message]
        assert mine, f"no corpus case for {rule.rule}"
        if not any(r == rule and v is False for doc in mine for r, v in verdicts(doc)):
            unfired.append(rule.rule)
    assert unfired == []


def examples() -> list[dict[str, Any]]:
    docs = [copy.deepcopy(BASE)]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "InferenceService"]
    return docs


def test_the_base_and_every_example_pass_every_rule() -> None:
    for doc in examples():
        assert validate_object(doc) == [], doc["metadata"]
        assert [r.rule for r, v in verdicts(doc) if v is not True] == [], doc["metadata"]


# ---- generated documents ---------------------------------------------------------------------------

def _pair(rng: random.Random, values: list[Any]) -> list[Any]:
    a, b = rng.choice(values), rng.choice(values)
    return [a, b]


def generated(seed: int, count: int) -> list[dict[str, Any]]:
    """Documents whose every field is valid on its own (type, bounds, pattern), drawn so that each
    cross-field and value rule is sometimes broken and sometimes not."""
    rng = random.Random(seed)
    maybe = lambda p: rng.random() < p  # noqa: E731
    docs = []
    for i in range(count):
        engine: dict[str, Any] = {
            "kind": rng.choice(["vllm", "vllm", "twin"]),
            "tensorParallelSize": rng.choice([1, 2, 4, 8]),
            "maxNumBatchedTokens": rng.choice([64, 256, 512, 2048, 8192]),
            "maxNumSeqs": rng.choice([32, 64, 256, 1024]),
        }
        if maybe(0.5):
            engine["gpuMemoryUtilization"] = rng.choice([0.5, 0.7, 0.9, 0.95])
        if maybe(0.2):
            engine["kvCacheMemoryBytes"] = 1 << 34
        resources: dict[str, Any] = {
            "gpus": rng.choice([1, 2, 4, 8]),
            "memory": rng.choice(["32Gi", "64G", "1500m", "2Pi", "1Pi", "1e3", "0.5Gi", "100m"]),
            "shmSize": rng.choice(["8Gi", "1500m", "2Pi", "1k"]),
            "gpuResource": rng.choice(["nvidia.com/gpu", "amd.com/gpu", "kubernetes.io/gpu",
                                       "foo.kubernetes.io/gpu", "kubernetes.io.example.com/gpu"]),
        }
        if maybe(0.5):
            resources["cpu"] = rng.choice(["500m", "1m", "0.5m", "4096", "4097", "16", "5000"])
        rollout: dict[str, Any] = {
            "maxSurge": rng.choice([0, 1, 2]),
            "startupTimeoutSeconds": rng.choice([60, 600, 1800, 3600]),
            "progressDeadlineSeconds": rng.choice([600, 1800, 3600, 7200]),
        }
        if maybe(0.3):
            rollout["allowDowntime"] = rng.choice([True, False])
        slo = {
            "ttftSeconds": rng.choice([*vllm.TTFT_BUCKETS[:12], 0.3, 0.7, 3]),
            "itlSeconds": rng.choice([*vllm.ITL_BUCKETS[:10], 0.03, 0.06]),
        }
        tuning: dict[str, Any] = {
            "enabled": maybe(0.5),
            "trialSeconds": rng.choice([60, 600]),
            "warmupSeconds": rng.choice([0, 60, 120]),
        }
        if maybe(0.05):
            tuning["storage"] = "sqlite:////var/lib/other-tenant.db"  # removed: the tuner's own setting
        if maybe(0.2):
            times = ["00:00", "02:00", "22:00", "24:00"]
            tuning["budgetGate"] = {"minRemaining": rng.choice([0.0, 0.5]),
                                    "windows": [{"start": rng.choice(times), "end": rng.choice(times)}
                                                for _ in range(rng.choice([0, 1, 2]))]}
        if maybe(0.6):
            tuning["space"] = {
                "maxNumBatchedTokens": _pair(rng, [0, 64, 256, 2048, 16384, 65536, 1 << 21]),
                "gpuMemoryUtilization": _pair(rng, [0.0, 0.5, 0.7, 0.92, 0.95, 1.0]),
                "maxNumSeqs": _pair(rng, [0, 16, 64, 256, 1024, 1 << 17]),
            }
        if maybe(0.3):
            tuning["trialStrategy"] = rng.choice(["canary", "rolling"])
        spec: dict[str, Any] = {"model": "m", "replicas": rng.choice([1, 1, 2, 3])}
        if maybe(0.2):
            tracing: dict[str, Any] = {"otlpTracesEndpoint": rng.choice([
                "http://otel-collector:4318/v1/traces", "http://otel-collector:4318", "https://c.example/",
                "http://otel-collector:4317", "https://otel.example:443/otlp/v1/traces"])}
            if maybe(0.6):
                tracing["otlpTracesProtocol"] = rng.choice(["grpc", "http/protobuf"])
            if maybe(0.5):
                tracing["samplingRatio"] = rng.choice([0, 0.1, 1])
            spec["observability"] = {"tracing": tracing}
        if maybe(0.3):
            low = rng.choice([0, 1, 2, 4])
            spec["autoscaling"] = {"minReplicas": low, "maxReplicas": max(1, low + rng.choice([-2, -1, 0, 3]))}
        for name, part in (("engine", engine), ("resources", resources), ("rollout", rollout),
                           ("slo", slo), ("tuning", tuning)):
            if maybe(0.85):
                spec[name] = part
        docs.append({"apiVersion": BASE["apiVersion"], "kind": BASE["kind"],
                     "metadata": {"name": f"g{i}", "namespace": "ml"}, "spec": spec})
    return docs


GENERATED = generated(seed=20261201, count=1500)


def test_generated_documents_exercise_every_rule_both_ways() -> None:
    seen: dict[str, set[bool | None]] = {rule.rule: set() for rule in RULES}
    for doc in GENERATED:
        for rule, verdict in verdicts(doc):
            seen[rule.rule].add(verdict)
    assert {r: s for r, s in seen.items() if s != {True, False}} == {}


def test_the_api_server_and_kvpilot_give_the_same_verdict_on_every_generated_document() -> None:
    """Same refusal, same fields: where CEL rules report, the API server refuses a field exactly
    when kvpilot does. (kvpilot's model validators stop at the first model that fails, so when
    two objects each break a rule kvpilot may name only one; the document is refused by both.)"""
    disagreements = []
    for doc in GENERATED:
        refused = refused_paths(doc)
        cel_refused = {r.error_path for r, v in verdicts(doc) if v is False}
        errors = [r.rule for r, v in verdicts(doc) if v is None]
        if errors:
            disagreements.append((doc["metadata"]["name"], "CEL runtime error", errors))
            continue
        if bool(refused) != bool(cel_refused):
            disagreements.append((doc["metadata"]["name"], sorted(cel_refused), refused))
            continue
        # kvpilot names only fields a CEL rule can name (no pydantic-only rule fired) ...
        extra = {p: m for p, m in refused.items() if p not in CEL_PATHS}
        # ... every field it names at a CEL rule's path, CEL refuses too ...
        missed = {p: m for p, m in refused.items() if p in CEL_PATHS and p not in cel_refused}
        # ... and it names every field CEL refuses, except a spec-level rule's, which kvpilot checks
        # only once engine, resources, rollout, slo and tuning have each validated.
        unnamed = {p for p in cel_refused - set(refused) if p not in SPEC_LEVEL_PATHS}
        if extra or missed or unnamed:
            disagreements.append((doc["metadata"]["name"], sorted(cel_refused), {**extra, **missed}, unnamed))
    assert disagreements[:5] == [], f"{len(disagreements)} of {len(GENERATED)} documents disagree"


def test_cel_python_agrees_with_the_rust_interpreter_on_every_standard_rule() -> None:
    """Two CEL implementations, one verdict: the rules do not lean on one interpreter's quirks."""
    for doc in GENERATED[:400]:
        defaulted = kcel.default(SCHEMA, doc)
        for rule in RULES:
            value = kcel.node_at(defaulted, rule.node)
            if value is None or not rule.standard:
                continue
            assert kcel.evaluate_celpy(rule, value) == kcel.evaluate(rule, value), (rule.rule, value)
