import pytest

from kvpilot.api import validate_object
from tests.unit.api.corpus import BASE, CASES


def test_base_is_valid():
    assert validate_object(BASE) == []


def test_corpus_is_large_and_distinct():
    ids = [case[0] for case in CASES]
    assert len(ids) >= 25
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(("doc", "path", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_is_rejected_with_its_path(doc, path, needle):
    issues = validate_object(doc)
    assert issues, "expected the manifest to be rejected"
    paths = [i.path for i in issues]
    assert path in paths, f"no issue at {path!r}: {[str(i) for i in issues]}"
    message = next(i.message for i in issues if i.path == path)
    assert needle in message, f"{needle!r} not in {message!r}"


def test_every_issue_is_reported_at_once():
    doc = {
        **BASE,
        "spec": {
            "model": "m",
            "replicas": 1,
            "engine": {"maxNumBatchedTokens": 16, "maxNumSeqs": 32, "extraArgs": ["--max-model-len=4096"]},
            "rollout": {"maxSurge": 0},
            "slo": {"ttftSeconds": 0.33, "itlSeconds": 0.033},
        },
    }
    paths = {i.path for i in validate_object(doc)}
    # Nested rules fire independently; the spec-level rules run once the nested models are valid.
    assert {"spec.engine.maxNumBatchedTokens", "spec.engine.extraArgs[0]", "spec.slo.ttftSeconds",
            "spec.slo.itlSeconds"} <= paths
