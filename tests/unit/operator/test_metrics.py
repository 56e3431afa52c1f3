"""The operator's own metrics: kvpilot_engine_info, one series per InferenceService."""

from __future__ import annotations

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api.vocabulary import ENGINE_INFO_LABELS
from kvpilot.operator.builders import ANNOTATION_CONFIG_HASH, ANNOTATION_ENGINE
from kvpilot.operator.builders.status import engine_info, rollout_of
from kvpilot.operator.metrics import OperatorMetrics


def series(metrics: OperatorMetrics) -> list[dict[str, str]]:
    text = generate_latest(metrics.registry).decode()
    return [dict(s.labels) for family in text_string_to_metric_families(text)
            if family.name == "kvpilot_engine_info" for s in family.samples if s.value == 1]


def deployment(engine: dict[str, object], digest: str = "0123abcd") -> dict[str, object]:
    return {"metadata": {"annotations": {ANNOTATION_CONFIG_HASH: digest, ANNOTATION_ENGINE: json.dumps(engine)}},
            "spec": {"replicas": 1}}


def test_engine_info_labels_are_the_flags_the_engine_runs_with() -> None:
    labels = engine_info(rollout_of(deployment({"kind": "vllm", "maxNumBatchedTokens": 8192})))
    assert labels == {"max_num_batched_tokens": "8192", "gpu_memory_utilization": "0.92",
                      "max_num_seqs": "256", "config_hash": "0123abcd"}
    kv_bytes = engine_info(rollout_of(deployment({"kind": "vllm", "kvCacheMemoryBytes": 10**10})))
    assert kv_bytes is not None and kv_bytes["gpu_memory_utilization"] == ""
    assert engine_info(rollout_of({"metadata": {}, "spec": {}})) is None
    assert engine_info(rollout_of(deployment({"maxNumSeqs": "many"}))) is None  # an edited annotation


def test_one_series_per_service_replaced_on_change_and_removed_on_delete() -> None:
    metrics = OperatorMetrics()
    first = engine_info(rollout_of(deployment({"maxNumBatchedTokens": 2048}, "aaaa")))
    second = engine_info(rollout_of(deployment({"maxNumBatchedTokens": 4096}, "bbbb")))
    metrics.set_engine("ns", "alpha", first)
    metrics.set_engine("ns", "beta", first)
    metrics.set_engine("ns", "alpha", second)
    metrics.set_engine("ns", "alpha", second)
    got = sorted(series(metrics), key=lambda s: s["name"])
    assert [set(s) for s in got] == [set(ENGINE_INFO_LABELS)] * 2
    assert [(s["name"], s["max_num_batched_tokens"], s["config_hash"]) for s in got] == [
        ("alpha", "4096", "bbbb"), ("beta", "2048", "aaaa")]
    metrics.forget_engine("ns", "alpha")
    metrics.forget_engine("ns", "gone")  # never exported: nothing to do
    assert [s["name"] for s in series(metrics)] == ["beta"]
    metrics.set_engine("ns", "beta", None)
    assert series(metrics) == []


def test_admission_results_are_the_webhooks_and_counted_from_zero() -> None:
    from kvpilot.operator import reviews
    from kvpilot.operator.metrics import ADMISSION_RESULTS

    assert ADMISSION_RESULTS == reviews.RESULTS
    metrics = OperatorMetrics()
    metrics.count_admission("invalid")
    text = generate_latest(metrics.registry).decode()
    counts = {s.labels["result"]: s.value for family in text_string_to_metric_families(text)
              if family.name == "kvpilot_admission_reviews" for s in family.samples if s.name.endswith("_total")}
    assert counts == {r: (1.0 if r == "invalid" else 0.0) for r in ADMISSION_RESULTS}
