"""crds/ against a real kube-apiserver: the schema, its CEL rules, printer columns and `kubectl explain`.

KMock and kubernetes-validate check the CRD's shape; only the API server compiles the CEL rules,
estimates their cost, applies defaults before validating, and builds the Table and OpenAPI views.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.cluster import ROOT, ApiError, ControlPlane
from tests.cluster.common import CRD_FILE
from tests.unit.api.corpus import BASE, CASES

pytestmark = pytest.mark.cluster

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NS = str(BASE["metadata"]["namespace"])
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def isvcs(namespace: str) -> str:
    return f"/apis/kvpilot.dev/v1alpha1/namespaces/{namespace}/inferenceservices"


def cel_rules() -> list[tuple[str, dict[str, str]]]:
    """(the field path a rule's error names, the rule) for every x-kubernetes-validations rule."""
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found: list[tuple[str, dict[str, str]]] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            found.append((path + rule.get("fieldPath", ""), rule))
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}" if path else key)
    walk(schema, "")
    return found


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane) -> str:
    if control_plane.get_or_none(f"/api/v1/namespaces/{NS}") is None:
        control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    return NS


def dry_run_create(cp: ControlPlane, doc: dict[str, Any]) -> Any:
    return cp.create(isvcs(doc["metadata"]["namespace"]), doc, params={"dryRun": "All"})


def test_the_crd_is_established_with_a_structural_schema(crd: dict[str, Any]) -> None:
    conds = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conds["NamesAccepted"]["status"] == "True"
    assert conds["Established"]["status"] == "True"
    # The server sets NonStructuralSchema when it cannot use (or prune by) the schema.
    assert "NonStructuralSchema" not in conds, conds.get("NonStructuralSchema")
    assert crd["status"]["acceptedNames"]["shortNames"] == ["kvis"]


def test_every_cel_rule_was_compiled_and_kept(crd: dict[str, Any]) -> None:
    """The server refuses a CRD whose rules do not compile or exceed the cost budget (see the
    control case below), so being Established means every rule compiled; it kept all of them."""
    live = json.dumps(crd["spec"]["versions"][0]["schema"])
    rules = cel_rules()
    assert len(rules) >= 10
    for _, rule in rules:
        assert json.dumps(rule["rule"]) in live


def test_a_rule_that_does_not_compile_is_refused(control_plane: ControlPlane) -> None:
    """The control case: the same CRD under another group with one rule broken."""
    broken = yaml.safe_load(CRD_FILE.read_text())
    broken["metadata"]["name"] = "inferenceservices.broken.kvpilot.dev"
    broken["spec"]["group"] = "broken.kvpilot.dev"
    spec = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"][0]["rule"] = "self.replicas != 'one'"
    with pytest.raises(ApiError) as refused:
        control_plane.create(CRDS, broken)
    assert refused.value.status == 422
    assert "compilation failed" in refused.value.message


def test_the_base_and_every_example_are_accepted(control_plane: ControlPlane, crd: dict[str, Any],
                                                 namespace: str) -> None:
    created = dry_run_create(control_plane, copy.deepcopy(BASE))
    assert created["spec"]["model"] == BASE["spec"]["model"]
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                doc.setdefault("metadata", {})["namespace"] = namespace
                try:
                    dry_run_create(control_plane, doc)
                except ApiError as exc:
                    pytest.fail(f"examples/{example.name} refused by the API server: {exc}")


# The corpus cases a CEL rule covers: the rule's field and the rule's words. The rest are for
# kvpilot's own validation (`kvpilot validate`, the operator's InvalidSpec), which the API server
# does not repeat.
CEL_CASES = [(case_id, doc, path, rule) for path, rule in cel_rules()
             for case_id, doc, case_path, needle in CASES
             if case_path == path and needle in rule["message"] and isinstance(doc, dict)]


def test_every_cel_rule_has_a_malformed_case() -> None:
    covered = {rule["rule"] for _, _, _, rule in CEL_CASES}
    assert [r["rule"] for _, r in cel_rules() if r["rule"] not in covered] == []


@pytest.mark.parametrize(("case_id", "doc", "path", "rule"), CEL_CASES, ids=[c[0] for c in CEL_CASES])
def test_a_cel_rule_refuses_its_malformed_case_with_its_message(
        control_plane: ControlPlane, crd: dict[str, Any], namespace: str,
        case_id: str, doc: dict[str, Any], path: str, rule: dict[str, str]) -> None:
    with pytest.raises(ApiError) as refused:
        dry_run_create(control_plane, copy.deepcopy(doc))
    err = refused.value
    assert (err.status, err.reason) == (422, "Invalid"), err
    causes = json.loads(err.body)["details"]["causes"]
    # A cause reads "Invalid value: <the rule's message>" at the rule's fieldPath.
    assert [c for c in causes if c.get("field") == path and c.get("message", "").endswith(rule["message"])], causes
    assert rule["message"] in err.message


def test_a_range_that_is_not_a_pair_gets_the_schema_error_alone(control_plane: ControlPlane, crd: dict[str, Any],
                                                                namespace: str) -> None:
    (doc,) = [doc for case_id, doc, _, _ in CASES if case_id == "space-wrong-arity"]
    with pytest.raises(ApiError) as refused:
        dry_run_create(control_plane, copy.deepcopy(doc))
    assert refused.value.status == 422
    assert "spec.tuning.space.maxNumSeqs in body should have at least 2 items" in refused.value.message
    assert "evaluating rule" not in refused.value.message  # no CEL runtime error on top


def test_printer_columns_in_the_table_api_and_kubectl(control_plane: ControlPlane, crd: dict[str, Any],
                                                      namespace: str, tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = "columns"
    doc["spec"]["engine"] = {"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.9}
    control_plane.create(isvcs(namespace), doc)
    control_plane.merge_patch(f"{isvcs(namespace)}/columns/status", {"status": {
        "readyReplicas": 1, "updatedReplicas": 2, "availableReplicas": 1,
        "slo": {"ttftP99Seconds": 0.31, "burnRate": {"1h": 1.5}}, "tuning": {"phase": "Idle"}}})
    table = control_plane.get(f"{isvcs(namespace)}/columns", accept=TABLE)
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names == ["Name", "Desired", "Ready", "Up-To-Date", "Available", "Chunk", "KV%", "P99-TTFT", "Burn",
                     "Tuning", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:10] == ["columns", 2, 1, 2, 1, 4096, 0.9, 0.31, 1.5, "Idle"]

    out = control_plane.kubectl("get", "kvis", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "DESIRED", "READY", "CHUNK", "KV%", "P99-TTFT", "BURN", "TUNING", "AGE"]
    assert out[1].split()[:8] == ["columns", "2", "1", "4096", "0.9", "0.31", "1.5", "Idle"]
    control_plane.delete(f"{isvcs(namespace)}/columns")


def test_kubectl_explain_documents_the_fields(control_plane: ControlPlane, crd: dict[str, Any]) -> None:
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    engine = schema["properties"]["spec"]["properties"]["engine"]["properties"]
    out = control_plane.kubectl("explain", "inferenceservices.spec.engine").stdout
    assert "KIND:       InferenceService" in out
    for field, prop in engine.items():
        assert f"  {field}\t" in out, f"{field} missing from kubectl explain:\n{out}"
        first_words = " ".join(prop["description"].split()[:4])
        assert first_words in " ".join(out.split()), f"{field}'s description missing"
