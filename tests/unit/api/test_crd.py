from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpilot.api import crd
from kvpilot.api.models import InferenceServiceSpec
from kvpilot.cli import main

ROOT = Path(__file__).resolve().parents[3]
CRD_FILE = ROOT / "crds" / crd.CRD_FILENAME


def _schema() -> dict:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_in_git_matches_the_models(capsys):
    """crds/ is generated, never hand-edited: regenerate it and fail on any difference."""
    assert main(["crd"]) == 0
    generated = capsys.readouterr().out
    assert CRD_FILE.read_text() == generated, "run `kvpilot crd --write` and commit crds/"


def test_crd_write(tmp_path):
    assert main(["crd", "--write", "--dir", str(tmp_path)]) == 0
    assert (tmp_path / crd.CRD_FILENAME).read_text() == crd.crd_yaml()


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_crd_validates_as_a_crd(version):
    kubernetes_validate.validate(crd.crd(), version, strict=True)


def _walk(node, path="$"):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "prefixItems", "const", "title"):
            assert banned not in node, f"{path} carries {banned}"
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert node[bound] is True, f"{path}: {bound} must be a boolean in OpenAPI v3"


def test_every_spec_field_is_described():
    for path, node in _walk(_schema()["properties"]["spec"]):
        if path.endswith("[]") or path == "$":
            continue
        assert node.get("description"), f"{path} has no description (kubectl explain shows nothing)"


def test_nullable_replaces_optional():
    engine = _schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert engine["gpuMemoryUtilization"]["nullable"] is True
    assert engine["gpuMemoryUtilization"]["type"] == "number"
    assert engine["gpuMemoryUtilization"]["exclusiveMaximum"] is True


def test_names_columns_and_status_subresource():
    spec = crd.crd()["spec"]
    assert spec["names"]["shortNames"] == ["kvis"]
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"]]
    assert columns == ["DESIRED", "READY", "UP-TO-DATE", "AVAILABLE", "CHUNK", "KV%", "P99-TTFT", "BURN",
                       "TUNING", "AGE"]
    # kubectl's default view stays short; -o wide adds what `kubectl get deployments` shows besides.
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority")]
    assert wide == ["Up-To-Date", "Available"]


def test_the_scale_paths_are_integer_replicas_and_a_string_selector():
    """The API server refuses a scale subresource whose paths do not lead to these types in the schema."""
    schema = _schema()["properties"]
    scale = crd.crd()["spec"]["versions"][0]["subresources"]["scale"]
    node = lambda root, path: schema[root]["properties"][path.rsplit(".", 1)[-1]]  # noqa: E731
    assert node("spec", scale["specReplicasPath"])["type"] == "integer"
    assert node("status", scale["statusReplicasPath"])["type"] == "integer"
    assert node("status", scale["labelSelectorPath"])["type"] == "string"


def test_autoscaling_is_optional_and_its_behavior_has_hpas_defaults():
    spec = _schema()["properties"]["spec"]
    autoscaling = spec["properties"]["autoscaling"]
    assert "autoscaling" not in spec.get("required", []) and autoscaling["nullable"] is True
    assert "default" not in autoscaling  # absent means today's fixed replicas, not an autoscaler
    assert autoscaling["required"] == ["maxReplicas"]
    behavior = autoscaling["properties"]["behavior"]["default"]
    assert behavior == {
        "scaleUp": {"stabilizationWindowSeconds": 0, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 15}, {"type": "Pods", "value": 4, "periodSeconds": 15}]},
        "scaleDown": {"stabilizationWindowSeconds": 300, "selectPolicy": "Max", "policies": [
            {"type": "Percent", "value": 100, "periodSeconds": 15}]},
    }


def _resolve(obj, json_path):
    for part in json_path.strip(".").split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def test_printer_columns_point_at_real_fields():
    """Every column's path exists in the schema (a typo would show an empty column forever)."""
    schema = _schema()
    for column in crd.PRINTER_COLUMNS:
        if column["jsonPath"].startswith(".metadata"):
            continue
        node = schema
        for part in column["jsonPath"].strip(".").split("."):
            node = node["properties"][part]
        assert node["type"] in ("integer", "number", "string"), column


def test_cel_rules_sit_on_existing_fields():
    schema = _schema()["properties"]["spec"]
    for path, node in _walk(schema):
        for rule in node.get("x-kubernetes-validations", []):
            field = rule["fieldPath"].strip(".").split(".")[0]
            assert field in node["properties"] or field in (
                node["properties"].get("rollout", {}).get("properties", {})
            ), (path, rule)
            assert rule["message"]


def test_defaults_in_schema_are_themselves_valid():
    """The API server fills schema defaults; an object of nothing but defaults must pass our own rules."""
    InferenceServiceSpec.model_validate({"model": "m"})
    space = _schema()["properties"]["spec"]["properties"]["tuning"]["properties"]["space"]["properties"]
    assert space["maxNumBatchedTokens"]["default"] == [256, 16384]


def test_generated_file_is_yaml_with_header():
    text = CRD_FILE.read_text()
    assert text.startswith("# Generated by `kvpilot crd --write`")
    assert yaml.safe_load(text)["metadata"]["name"] == "inferenceservices.kvpilot.dev"
