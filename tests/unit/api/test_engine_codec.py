"""The engine codec: one rendering of the typed engine fields, read back by one parser, and vLLM's
defaults per GPU class, shared by the operator, the tuner and the twin."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.api import engine as codec
from kvpilot.api import vocabulary
from kvpilot.api.models import InferenceService, ObservabilitySpec
from kvpilot.api.validation import parse_inference_service
from kvpilot.operator.builders.engine import engine_args, engine_command
from kvpilot.tuner.core.space import EngineParams
from kvpilot.twin.engine import EngineConfig
from kvpilot.twin.hardware import GPU_PRESETS, resolve_gpu, serve_defaults
from kvpilot.twin.models import resolve_model

ROOT = Path(__file__).resolve().parents[3]

# What `kvpilot render` puts on each example's engine container, pinned: a change here is a change
# to every pod of every user on upgrade (a new configHash rolls the whole fleet).
PINNED = {
    "llama-8b-chat": [
        "vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct", "--port", "8000", "--served-model-name",
        "llama-3-8b", "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.9", "--max-num-seqs",
        "256", "--max-model-len", "8192", "--tensor-parallel-size", "1", "--block-size", "16", "--kv-cache-dtype",
        "auto", "--long-prefill-token-threshold", "0", "--shutdown-timeout", "30", "--otlp-traces-endpoint",
        "http://otel-collector.observability:4318/v1/traces", "--enable-prefix-caching", "--disable-log-requests",
    ],
    "llama-8b": [
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--port", "8000", "--max-num-batched-tokens", "2048",
        "--gpu-memory-utilization", "0.92", "--max-num-seqs", "256", "--tensor-parallel-size", "1", "--block-size",
        "16", "--kv-cache-dtype", "auto", "--long-prefill-token-threshold", "0", "--shutdown-timeout", "30",
    ],
    "llama-8b-twin": [
        "kvpilot", "twin", "serve", "meta-llama/Llama-3.1-8B-Instruct", "--port", "8000", "--host", "0.0.0.0",
        "--max-num-batched-tokens", "2048", "--gpu-memory-utilization", "0.9", "--max-num-seqs", "256",
        "--tensor-parallel-size", "1", "--block-size", "16", "--kv-cache-dtype", "auto",
        "--long-prefill-token-threshold", "0", "--shutdown-timeout", "10", "--gpu", "H100-80GB", "--startup-delay",
        "5.0",
    ],
}


def examples() -> dict[str, InferenceService]:
    out = {}
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == vocabulary.KIND:
                svc = parse_inference_service(doc)
                out[svc.metadata.name] = svc
    return out


def test_every_example_renders_its_pinned_command() -> None:
    rendered = {name: engine_command(svc.spec.engine) + engine_args(svc) for name, svc in examples().items()}
    assert rendered == PINNED


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_rendered_command_reads_back_as_the_spec(name: str) -> None:
    svc = examples()[name]
    parsed = codec.parse_engine_args(engine_args(svc))
    e = svc.spec.engine
    assert parsed.port == 8000
    assert parsed.values["maxNumBatchedTokens"] == e.max_num_batched_tokens
    assert parsed.values["gpuMemoryUtilization"] == e.effective_gpu_memory_utilization
    assert parsed.values["maxNumSeqs"] == e.max_num_seqs
    assert parsed.values["shutdownTimeoutSeconds"] == svc.spec.rollout.shutdown_timeout_seconds
    assert parsed.rest[0] == svc.spec.model


@given(st.floats(min_value=0.01, max_value=0.99, allow_nan=False))
def test_a_fraction_renders_as_the_shortest_text_that_reads_back_exactly(value: float) -> None:
    text = codec.format_value(value)
    assert float(text) == value
    assert len(text) <= len(repr(value))


def test_number_format() -> None:
    assert codec.format_value(0.9) == "0.9"
    assert codec.format_value(0.92) == "0.92"
    assert codec.format_value(2048) == "2048"
    assert codec.format_value("fp8") == "fp8"
    with pytest.raises(TypeError):
        codec.format_value(True)


def test_render_keeps_table_order_and_leaves_out_unset_fields() -> None:
    args = codec.render_flags({"maxNumSeqs": 64, "maxNumBatchedTokens": 512, "kvCacheMemoryBytes": None})
    assert args == ["--max-num-batched-tokens", "512", "--max-num-seqs", "64"]
    with pytest.raises(KeyError, match="notAField"):
        codec.render_flags({"notAField": 1})


def test_parse_reads_both_forms_aliases_and_keeps_the_rest_in_order() -> None:
    parsed = codec.parse_engine_args(
        ["serve", "m", "--max-num-seqs=64", "-tp", "2", "--port", "9000", "--seed", "3", "--gpu-memory-utilization",
         "0.5"])
    assert parsed.values == {"maxNumSeqs": 64, "tensorParallelSize": 2, "gpuMemoryUtilization": 0.5}
    assert parsed.port == 9000
    assert parsed.rest == ["serve", "m", "--seed", "3"]


def test_parse_only_some_fields_leaves_the_others_in_the_command() -> None:
    parsed = codec.parse_engine_args(["m", "--max-model-len", "4096", "--max-num-seqs", "8"],
                                     only=vocabulary.TUNED_ENGINE_FIELDS)
    assert parsed.values == {"maxNumSeqs": 8}
    assert parsed.rest == ["m", "--max-model-len", "4096"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-num-seqs"], "--max-num-seqs: needs a value"),
    (["--max-num-seqs", "many"], "--max-num-seqs: expected a whole number, got 'many'"),
    (["--gpu-memory-utilization=high"], "--gpu-memory-utilization: expected a number"),
    (["--port", "http"], "--port: expected a whole number"),
])
def test_parse_errors_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(codec.EngineArgsError, match=message):
        codec.parse_engine_args(argv)


@pytest.mark.parametrize(("gpu", "tokens", "seqs"), [
    ("H100-80GB", 8192, 1024), ("H200", 8192, 1024), ("A100-80GB", 2048, 256), ("L40S", 2048, 256),
    ("L4", 2048, 256), ("A10G", 2048, 256),
])
def test_vllm_defaults_per_gpu_class(gpu: str, tokens: int, seqs: int) -> None:
    d = serve_defaults(resolve_gpu(gpu))
    assert (d.maxNumBatchedTokens, d.maxNumSeqs, d.gpuMemoryUtilization) == (tokens, seqs, 0.92)


def test_the_twin_the_tuner_and_the_codec_agree_on_the_defaults() -> None:
    model = resolve_model("Llama-3.1-8B")
    for gpu in GPU_PRESETS.values():
        d = serve_defaults(gpu)
        cfg = EngineConfig.resolve(model, gpu)
        assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.gpu_memory_utilization) == (
            d.maxNumBatchedTokens, d.maxNumSeqs, d.gpuMemoryUtilization)
        p = EngineParams.vllm_defaults(d)
        assert p.as_spec() == {k: d.as_spec()[k] for k in vocabulary.TUNED_ENGINE_FIELDS}


def test_resolve_fills_unset_values_and_a_fixed_kv_cache_replaces_the_fraction() -> None:
    d = codec.serve_defaults("NVIDIA-L4", 22 * codec.GiB)
    assert codec.resolve({"maxNumSeqs": 8, "maxNumBatchedTokens": None}, d)["maxNumBatchedTokens"] == 2048
    out = codec.resolve({"kvCacheMemoryBytes": 1 << 30}, d)
    assert "gpuMemoryUtilization" not in out and out["kvCacheMemoryBytes"] == 1 << 30


def test_the_models_literals_are_the_vocabulary() -> None:
    fields = InferenceService.model_fields
    assert fields["api_version"].default == vocabulary.API_VERSION
    assert fields["kind"].default == vocabulary.KIND
    monitor = ObservabilitySpec.model_fields["monitor"]
    assert typing.get_args(monitor.annotation) == tuple(vocabulary.MonitorKind)
    assert monitor.default == vocabulary.MonitorKind.SERVICE_MONITOR


def test_series_label_is_what_prometheus_makes_of_the_pod_label() -> None:
    assert vocabulary.SERIES_LABEL_INFERENCESERVICE == "kvpilot_dev_inferenceservice"
    assert vocabulary.prometheus_label("app.kubernetes.io/name") == "app_kubernetes_io_name"
