from pathlib import Path

import pytest
import yaml

from kvpilot.api import InferenceService, parse_inference_service, validate_object
from kvpilot.api.validation import InvalidInferenceService, validate_text

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


def test_there_are_three_examples():
    assert {p.stem for p in EXAMPLES} >= {"minimal", "full", "twin"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        assert validate_object(doc) == []


def test_defaults_and_snake_case_access():
    isvc = InferenceService.model_validate(
        {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "a"},
         "spec": {"model": "m"}}
    )
    engine = isvc.spec.engine
    assert (engine.kind, engine.max_num_batched_tokens, engine.max_num_seqs, engine.block_size) == ("vllm", 2048, 256, 16)
    assert engine.gpu_memory_utilization is None
    assert engine.effective_gpu_memory_utilization == 0.92
    assert isvc.metadata.namespace == "default"
    assert isvc.spec.slo.ttft_seconds == 0.5 and isvc.spec.rollout.max_surge == 1


def test_kv_bytes_means_no_utilization():
    isvc = parse_inference_service(
        {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "a"},
         "spec": {"model": "m", "engine": {"kvCacheMemoryBytes": 1 << 34}}}
    )
    assert isvc.spec.engine.effective_gpu_memory_utilization is None


def test_wire_round_trip_is_camel_case_and_stable():
    doc = yaml.safe_load((EXAMPLES[0].parent / "full.yaml").read_text())
    wire = InferenceService.model_validate(doc).to_wire()
    assert wire["spec"]["engine"]["maxNumBatchedTokens"] == 2048
    assert "max_num_batched_tokens" not in wire["spec"]["engine"]
    assert InferenceService.model_validate(wire).to_wire() == wire


def test_snake_case_names_are_accepted_in_python():
    from kvpilot.api import EngineSpec

    assert EngineSpec(max_num_batched_tokens=4096).max_num_batched_tokens == 4096


def test_parse_raises_with_every_issue():
    with pytest.raises(InvalidInferenceService) as info:
        parse_inference_service({"apiVersion": "x", "kind": "y"})
    assert {i.path for i in info.value.issues} == {"apiVersion", "kind"}


def test_status_from_a_newer_writer_is_tolerated():
    isvc = InferenceService.model_validate(
        {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "a"},
         "spec": {"model": "m"},
         "status": {"readyReplicas": 1, "futureField": True, "slo": {"burnRate": {"1h": 2.5}}}}
    )
    assert isvc.status.ready_replicas == 1
    assert isvc.status.slo.burn_rate.one_hour == 2.5


def test_stream_with_empty_documents_and_yaml_error():
    results = validate_text("---\n---\n" + (EXAMPLES[0].parent / "minimal.yaml").read_text() + "---\n")
    assert [r.valid for r in results] == [True]
    broken = validate_text("spec: {model: [\n")
    assert not broken[0].valid and "line" in broken[0].issues[0].message
    assert not validate_text("")[0].valid


def _leaf_paths(schema: dict, prefix: tuple[str, ...] = ()):
    if schema.get("type") == "array" and "items" in schema:
        yield from _leaf_paths(schema["items"], prefix)
        return
    if "properties" not in schema:
        yield prefix, schema
        return
    for key, sub in schema["properties"].items():
        yield from _leaf_paths(sub, (*prefix, key))


def _shown(doc, path: tuple[str, ...]) -> bool:
    if not path:
        return True
    if isinstance(doc, list):
        return any(_shown(item, path) for item in doc)
    return isinstance(doc, dict) and path[0] in doc and _shown(doc[path[0]], path[1:])


def test_the_full_example_shows_every_field_the_crd_serves():
    # "Every field" in examples/full.yaml is a claim the CRD can check: a field is shown set, or (where it
    # excludes one that is set) commented in place; only removed fields are left out.
    from kvpilot.api.crd import crd

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    text = (EXAMPLES[0].parent / "full.yaml").read_text()
    doc = yaml.safe_load(text)["spec"]
    commented = {line.split("#", 1)[1].strip().split(":", 1)[0] for line in text.splitlines()
                 if line.lstrip().startswith("#") and ":" in line}
    missing = [".".join(path) for path, leaf in _leaf_paths(spec)
               if not leaf.get("description", "").startswith("Removed")
               and not all(_shown(doc, path[:i + 1]) or p in commented for i, p in enumerate(path))]
    assert missing == []
