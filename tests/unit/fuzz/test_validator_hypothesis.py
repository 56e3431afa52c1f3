"""Hypothesis against the validator: whatever the bytes, `validate_text` returns results (never
raises), every issue is one short line, and a document it calls valid is one the API accepts.

Fixed number of examples and a fixed seed (derandomize), so CI runs the same cases every time.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.api.validation import strict_validate, validate_text

BASE: dict[str, Any] = {
    "apiVersion": "kvpilot.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "svc", "namespace": "ml"},
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct", "replicas": 2,
        "engine": {"maxNumBatchedTokens": 2048, "maxNumSeqs": 256, "image": "vllm/vllm-openai:v0.33.0"},
        "resources": {"gpus": 1, "memory": "32Gi", "gpuResource": "nvidia.com/gpu"},
        "slo": {"objective": 0.99, "ttftSeconds": 0.5},
        "hfTokenSecret": {"name": "hf", "key": "HF_TOKEN"},
    },
}
PATHS = [
    ("spec", "replicas"), ("spec", "model"), ("spec", "engine", "maxNumBatchedTokens"),
    ("spec", "engine", "image"), ("spec", "engine", "kvCacheMemoryBytes"), ("spec", "engine", "extraArgs"),
    ("spec", "resources", "memory"), ("spec", "resources", "cpu"), ("spec", "resources", "gpuResource"),
    ("spec", "slo", "objective"), ("spec", "slo", "period"), ("spec", "hfTokenSecret", "name"),
    ("metadata", "name"), ("spec", "rollout", "maxSurge"), ("spec", "tuning", "space"), ("spec",), ("kind",),
]
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40)
           | st.sampled_from(["32Gi", "1m", ".", "-1", "1e400", "nvidia.com/gpu", "a b", "$(x)", "0.999999",
                              "3", "true", "null", "~", "0x10", "1_000", "2001-12-14"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=20)


def _check(data: bytes | str) -> None:
    results = validate_text(data)
    assert results
    for result in results:
        for issue in result.issues:
            line = str(issue)
            assert "\n" not in line and len(line) <= 600, line[:200]


@SETTINGS
@given(mutations=st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=4))
def test_mutated_manifests(mutations: list[tuple[tuple[str, ...], Any]]) -> None:
    doc = copy.deepcopy(BASE)
    for path, value in mutations:
        node: Any = doc
        for part in path[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[path[-1]] = value
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:
        return
    results = validate_text(text)
    _check(text)
    if all(r.valid for r in results):
        (loaded,) = list(yaml.safe_load_all(text))
        strict_validate(loaded)  # valid means the typed object builds


@SETTINGS
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes(data: bytes) -> None:
    _check(data)


@SETTINGS
@given(text=st.text(alphabet=st.sampled_from(list("[]{}:,-&*!|>'\"#%@`?\n\t ab1.")), max_size=200))
def test_yaml_punctuation(text: str) -> None:
    _check(text)
