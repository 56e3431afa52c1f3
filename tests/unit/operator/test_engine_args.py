from __future__ import annotations

import argparse

import pytest

from kvpilot.api.engine import FLAG_OF
from kvpilot.operator.builders.engine import engine_args, engine_command, typed_flags
from tests.unit.operator.fixtures import isvc


def test_default_engine_renders_exactly_the_typed_flags_in_order() -> None:
    assert engine_command(isvc().spec.engine) == ["vllm", "serve"]
    assert engine_args(isvc()) == [
        "meta-llama/Meta-Llama-3-8B-Instruct", "--port", "8000",
        "--max-num-batched-tokens", "2048",
        "--gpu-memory-utilization", "0.92",
        "--max-num-seqs", "256",
        "--tensor-parallel-size", "1",
        "--block-size", "16",
        "--kv-cache-dtype", "auto",
        "--long-prefill-token-threshold", "0",
        "--shutdown-timeout", "30",
    ]


def test_every_typed_field_renders_its_flag_once() -> None:
    svc = isvc(engine={"maxNumBatchedTokens": 8192, "kvCacheMemoryBytes": 20 * 2**30, "maxNumSeqs": 128,
                       "maxModelLen": 16384, "tensorParallelSize": 2, "blockSize": 32, "kvCacheDtype": "fp8",
                       "longPrefillTokenThreshold": 512},
               resources={"gpus": 2}, rollout={"shutdownTimeoutSeconds": 45},
               observability={"tracing": {"otlpTracesEndpoint": "http://otel:4318/v1/traces",
                                          "collectDetailedTraces": ["model", "worker"]}})
    args = typed_flags(svc)
    # The one list flag renders its values after it, as vLLM's nargs="+" reads them.
    cut = args.index("--collect-detailed-traces")
    assert args[cut:] == ["--collect-detailed-traces", "model", "worker"]
    args = args[:cut]
    flags = args[0::2]
    # --kv-cache-memory-bytes replaces --gpu-memory-utilization; every other typed flag appears once.
    assert sorted(flags) == sorted(set(FLAG_OF.values()) - {"--gpu-memory-utilization", "--collect-detailed-traces"})
    pairs = dict(zip(args[0::2], args[1::2], strict=True))
    assert pairs == {
        "--max-num-batched-tokens": "8192", "--kv-cache-memory-bytes": str(20 * 2**30),
        "--max-num-seqs": "128", "--max-model-len": "16384", "--tensor-parallel-size": "2",
        "--block-size": "32", "--kv-cache-dtype": "fp8", "--long-prefill-token-threshold": "512",
        "--shutdown-timeout": "45", "--otlp-traces-endpoint": "http://otel:4318/v1/traces",
    }


def test_no_tracing_renders_no_tracing_flag_and_no_otel_env() -> None:
    from kvpilot.operator.builders.deployment import tracing_env

    svc = isvc()
    assert "--otlp-traces-endpoint" not in engine_args(svc) and "--collect-detailed-traces" not in engine_args(svc)
    assert tracing_env(svc) == []
    # An endpoint alone: no --collect-detailed-traces (an empty list is left out, vLLM's default).
    svc = isvc(observability={"tracing": {"otlpTracesEndpoint": "http://otel:4317", "otlpTracesProtocol": "grpc"}})
    args = engine_args(svc)
    assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel:4317"
    assert "--collect-detailed-traces" not in args


@pytest.mark.parametrize(("tracing", "env"), [
    ({"otlpTracesEndpoint": "http://otel:4318/v1/traces"},
     {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}),
    ({"otlpTracesEndpoint": "http://otel:4317", "otlpTracesProtocol": "grpc", "samplingRatio": 0.25},
     {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "0.25"}),
    ({"otlpTracesEndpoint": "http://otel:4318/v1/traces", "samplingRatio": 0, "parentBased": False},
     {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_TRACES_SAMPLER": "traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "0.0"}),
])
def test_tracing_renders_the_otel_environment_on_the_engine_container(tracing: dict, env: dict) -> None:
    from kvpilot.operator.builders import build_deployment

    for kind in ("vllm", "twin"):
        svc = isvc(engine={"kind": kind},
                   resources={"gpus": 0 if kind == "twin" else 1}, observability={"tracing": tracing},
                   hfTokenSecret={"name": "hf"})
        container = build_deployment(svc)["spec"]["template"]["spec"]["containers"][0]
        rendered = {e["name"]: e.get("value") for e in container["env"]}
        assert rendered == {"HF_TOKEN": None, **env, "OTEL_SERVICE_NAME": "llama",
                            "OTEL_RESOURCE_ATTRIBUTES": "service.namespace=serving,k8s.namespace.name=serving"}


def test_gpu_memory_utilization_keeps_its_decimal_form() -> None:
    args = typed_flags(isvc(engine={"gpuMemoryUtilization": 0.9}))
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"


def test_served_model_name_and_extra_args_come_after_the_owned_flags() -> None:
    svc = isvc(servedModelName="llama-3", engine={"extraArgs": ["--enable-prefix-caching", "--seed", "7"]})
    args = engine_args(svc)
    assert args[:5] == ["meta-llama/Meta-Llama-3-8B-Instruct", "--port", "8000", "--served-model-name", "llama-3"]
    assert args[-3:] == ["--enable-prefix-caching", "--seed", "7"]


def test_twin_runs_kvpilot_with_the_same_flags_plus_gpu() -> None:
    vllm_args = engine_args(isvc())
    svc = isvc(engine={"kind": "twin", "twin": {"gpu": "A100-80GB", "startupDelaySeconds": 2.5}},
               resources={"gpus": 0})
    assert engine_command(svc.spec.engine) == ["kvpilot", "twin", "serve"]
    args = engine_args(svc)
    assert args[args.index("--gpu") + 1] == "A100-80GB"
    assert args[args.index("--startup-delay") + 1] == "2.5"
    assert args[args.index("--host") + 1] == "0.0.0.0"
    for flag in FLAG_OF.values():
        if flag in vllm_args:
            assert args[args.index(flag) + 1] == vllm_args[vllm_args.index(flag) + 1]


def test_twin_serve_parser_accepts_the_rendered_command() -> None:
    from kvpilot.twin.server.cli import register

    parser = argparse.ArgumentParser(prog="kvpilot twin", exit_on_error=False)
    register(parser.add_subparsers(dest="cmd"))
    svc = isvc(engine={"kind": "twin", "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85,
                       "twin": {"startupDelaySeconds": 1}}, resources={"gpus": 0})
    ns = parser.parse_args(["serve", *engine_args(svc)])
    assert ns.max_num_batched_tokens == 4096
    assert ns.gpu_memory_utilization == pytest.approx(0.85)
    traced = isvc(engine={"kind": "twin"}, resources={"gpus": 0}, observability={"tracing": {
        "otlpTracesEndpoint": "http://otel:4318/v1/traces", "collectDetailedTraces": ["model", "all"]}})
    ns = parser.parse_args(["serve", *engine_args(traced)])
    assert ns.otlp_traces_endpoint == "http://otel:4318/v1/traces"
    assert ns.collect_detailed_traces == ["model", "all"]
    assert ns.shutdown_timeout == 30
    assert ns.gpu == "H100-80GB"
