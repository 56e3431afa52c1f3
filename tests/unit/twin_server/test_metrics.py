"""The twin's /metrics exposition: vLLM's names, labels and bucket edges."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.api import vllm
from kvpilot.twin.metrics import ITERATION_TOKENS_BUCKETS, VllmMetrics, build_1_2_5_buckets

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def families(metrics: VllmMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def bucket_edges(family, **labels) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples
            if s.name.endswith("_bucket") and all(s.labels.get(k) == v for k, v in labels.items())]


def sample(family, suffix: str = "", **labels) -> float:
    for s in family.samples:
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {family.name}{suffix} {labels}")


@pytest.fixture
def metrics() -> VllmMetrics:
    return VllmMetrics(MODEL, max_model_len=8192,
                       cache_config={"block_size": 16, "gpu_memory_utilization": 0.9, "num_gpu_blocks": 1234,
                                     "enable_prefix_caching": False, "cache_dtype": "auto"})


def test_build_1_2_5_buckets():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(8192)[-1] == 5000


def test_names_labels_and_edges(metrics):
    fams = families(metrics)
    # The parser reports counters without their _total suffix.
    expected = {
        vllm.METRIC_TTFT: "histogram", vllm.METRIC_ITL: "histogram", vllm.METRIC_E2E: "histogram",
        vllm.METRIC_QUEUE: "histogram", vllm.METRIC_PREFILL: "histogram", vllm.METRIC_DECODE: "histogram",
        vllm.METRIC_ITERATION_TOKENS: "histogram", vllm.METRIC_RUNNING: "gauge",
        vllm.METRIC_WAITING: "gauge", vllm.METRIC_KV_USAGE: "gauge", vllm.METRIC_CACHE_CONFIG: "gauge",
        vllm.METRIC_PREEMPTIONS.removesuffix("_total"): "counter",
        vllm.METRIC_PROMPT_TOKENS.removesuffix("_total"): "counter",
        vllm.METRIC_GENERATION_TOKENS.removesuffix("_total"): "counter",
        vllm.METRIC_REQUEST_SUCCESS.removesuffix("_total"): "counter",
    }
    for name, kind in expected.items():
        assert name in fams, name
        assert fams[name].type == kind, name
    labels = {"model_name": MODEL, "engine": "0"}
    assert bucket_edges(fams[vllm.METRIC_TTFT], **labels) == [*vllm.TTFT_BUCKETS, float("inf")]
    assert bucket_edges(fams[vllm.METRIC_ITL], **labels) == [*vllm.ITL_BUCKETS, float("inf")]
    for name in (vllm.METRIC_E2E, vllm.METRIC_QUEUE, vllm.METRIC_PREFILL, vllm.METRIC_DECODE):
        assert bucket_edges(fams[name], **labels) == [*vllm.REQUEST_LATENCY_BUCKETS, float("inf")]
    assert bucket_edges(fams[vllm.METRIC_ITERATION_TOKENS]) == [*map(float, ITERATION_TOKENS_BUCKETS),
                                                                 float("inf")]
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples
               if s.name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}  # every vLLM FinishReason
    info = fams[vllm.METRIC_CACHE_CONFIG].samples[0]
    assert info.value == 1
    assert info.labels == {"block_size": "16", "gpu_memory_utilization": "0.9", "num_gpu_blocks": "1234",
                           "enable_prefix_caching": "False", "cache_dtype": "auto", "engine": "0"}


def test_exposition_uses_the_total_suffix_on_the_wire(metrics):
    text = metrics.render().decode()
    for name in (vllm.METRIC_PREEMPTIONS, vllm.METRIC_PROMPT_TOKENS, vllm.METRIC_GENERATION_TOKENS,
                 vllm.METRIC_REQUEST_SUCCESS):
        assert f"\n{name}{{" in text, name
    assert f'{vllm.METRIC_TTFT}_bucket{{engine="0",le="0.5",model_name="{MODEL}"}}' in text


def test_recording(metrics):
    metrics.record_step(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_preemptions=1,
                        num_prompt_tokens=100, num_generation_tokens=3)
    metrics.record_first_token(0.3)
    metrics.record_inter_token(0.02)
    metrics.record_inter_token(0.06)
    metrics.record_finished(finish_reason="length", e2e_s=1.2, queued_s=0.1, prefill_s=0.2, decode_s=0.9,
                            inference_s=1.1, num_prompt_tokens=100, num_generation_tokens=10,
                            max_tokens_param=10)
    metrics.record_aborted()
    fams = families(metrics)
    assert sample(fams[vllm.METRIC_RUNNING]) == 3
    assert sample(fams[vllm.METRIC_WAITING]) == 2
    assert sample(fams[vllm.METRIC_KV_USAGE]) == 0.25
    assert sample(fams["vllm:num_preemptions"], "_total") == 1
    assert sample(fams["vllm:prompt_tokens"], "_total") == 100
    assert sample(fams["vllm:generation_tokens"], "_total") == 3
    assert sample(fams[vllm.METRIC_ITERATION_TOKENS], "_bucket", le="128.0") == 1
    assert sample(fams[vllm.METRIC_ITERATION_TOKENS], "_bucket", le="64.0") == 0
    assert sample(fams[vllm.METRIC_TTFT], "_bucket", le="0.25") == 0
    assert sample(fams[vllm.METRIC_TTFT], "_bucket", le="0.5") == 1
    assert sample(fams[vllm.METRIC_ITL], "_bucket", le="0.025") == 1
    assert sample(fams[vllm.METRIC_ITL], "_count") == 2
    assert sample(fams["vllm:request_success"], "_total", finished_reason="length") == 1
    assert sample(fams["vllm:request_success"], "_total", finished_reason="abort") == 0  # as vLLM
    assert sample(fams["kvpilot_twin_aborted_requests"], "_total") == 1
    assert sample(fams["vllm:request_success"], "_total", finished_reason="stop") == 0
    assert sample(fams[vllm.METRIC_E2E], "_sum") == pytest.approx(1.2)
    assert sample(fams[vllm.METRIC_QUEUE], "_bucket", le="0.3") == 1
    assert sample(fams["vllm:request_time_per_output_token_seconds"], "_sum") == pytest.approx(0.1)


def test_two_instances_do_not_collide():
    a = VllmMetrics("a", max_model_len=128, cache_config={})
    b = VllmMetrics("b", max_model_len=128, cache_config={})
    a.record_first_token(0.1)
    assert sample(families(a)[vllm.METRIC_TTFT], "_count") == 1
    assert sample(families(b)[vllm.METRIC_TTFT], "_count") == 0


# --- content negotiation, as vLLM's prometheus_client mount under /metrics/ does it (choose_encoder) --

def sample_names(body: bytes) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines() if line and line[0] != "#"}


def test_no_accept_header_gets_the_text_format_with_vllms_names(metrics):
    body, content_type = metrics.exposition(None)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert body == metrics.render() and metrics.exposition("")[0] == body
    assert vllm.METRIC_RUNNING in sample_names(body)
    only, _ = metrics.exposition(None, [vllm.METRIC_RUNNING])
    assert sample_names(only) == {vllm.METRIC_RUNNING}


def test_prometheus_2_gets_openmetrics_with_underscores_for_colons(metrics):
    from harness.prometheus import PROMETHEUS_2_ACCEPT

    body, content_type = metrics.exposition(PROMETHEUS_2_ACCEPT)
    assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
    names = sample_names(body)
    # The samples lose the colon (prometheus/client_python#1177); HELP and TYPE keep it.
    assert "vllm_num_requests_running" in names and "vllm_time_to_first_token_seconds_count" in names
    assert not {n for n in names if n.startswith("vllm:")}
    assert f"# TYPE {vllm.METRIC_RUNNING} gauge" in body.decode()
    assert body.decode().endswith("# EOF\n")


def test_prometheus_3_gets_openmetrics_with_vllms_names(metrics):
    from harness.prometheus import PROMETHEUS_3_ACCEPT

    body, content_type = metrics.exposition(PROMETHEUS_3_ACCEPT)
    assert content_type == "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=allow-utf-8"
    names = sample_names(body)
    assert vllm.METRIC_RUNNING in names and not {n for n in names if n.startswith("vllm_")}
