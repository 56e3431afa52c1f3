"""Request tracing: vLLM's OpenTelemetry vocabulary and the environment that configures it.

vLLM (0.32, V1) traces a request when `--otlp-traces-endpoint URL` is set: when the request
finishes, the output processor makes one span named `llm_request`, kind SERVER, that starts at the
request's arrival, ends when it is processed, carries the `gen_ai.*` attributes below and continues
the trace of the W3C `traceparent` / `tracestate` headers the request came with.  Everything else is
the OpenTelemetry SDK's own environment configuration, which vLLM leaves to the SDK:

- OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: `grpc` (vLLM's default when unset) or `http/protobuf`; with
  http/protobuf the endpoint is the full URL spans are posted to (`.../v1/traces`);
- OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG: which spans are kept (unset: every one);
- OTEL_SERVICE_NAME: the `service.name` resource attribute.

`--collect-detailed-traces model|worker|all` is accepted by vLLM 0.32 and kept in its
ObservabilityConfig, but its V1 engine records nothing more for it.

The engine twin (kvpilot.twin.server.tracing) emits the same span from the same settings.
"""

from __future__ import annotations

from typing import Literal

# vLLM's names (vllm/tracing/utils.py, vllm/v1/engine/output_processor.py).
REQUEST_SPAN_NAME = "llm_request"
# The instrumentation scope vLLM's request span comes from (the module that makes it) and the
# resource attributes vLLM's tracer provider adds to the SDK's own (service.name, telemetry.sdk.*).
INSTRUMENTATION_SCOPE = "vllm.tracing.otel"
INSTRUMENTING_MODULE_NAME = "vllm.llm_engine"
RESOURCE_INSTRUMENTING_MODULE = "vllm.instrumenting_module_name"
RESOURCE_PROCESS_ID = "vllm.process_id"
TRACE_HEADERS = ("traceparent", "tracestate")


class SpanAttributes:
    """The attribute keys of vLLM's request span (vLLM's own class of the same name)."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


# The OpenTelemetry SDK's environment variables (opentelemetry.sdk.environment_variables).
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_SAMPLER = "OTEL_TRACES_SAMPLER"
ENV_SAMPLER_ARG = "OTEL_TRACES_SAMPLER_ARG"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"

Protocol = Literal["grpc", "http/protobuf"]
PROTOCOLS: tuple[str, ...] = ("grpc", "http/protobuf")
# What vLLM (and the twin, like it) exports with when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is unset.
VLLM_DEFAULT_PROTOCOL = "grpc"
# vLLM 0.32's choices for --collect-detailed-traces (ObservabilityConfig.DetailedTraceModules).
DetailedTraceModule = Literal["model", "worker", "all"]
DETAILED_TRACE_MODULES: tuple[str, ...] = ("model", "worker", "all")
# The SDK's samplers for a ratio: parent-based follows the caller's sampling decision where a
# `traceparent` came with the request and samples root spans at the ratio; plain traceidratio
# samples every span at the ratio whatever the caller decided.
SAMPLER_PARENT_BASED_RATIO = "parentbased_traceidratio"
SAMPLER_RATIO = "traceidratio"

# An OTLP endpoint: http(s), a host (no user:password@: spec fields are readable by anyone who
# can read the resource), optionally a port and a path; no spaces, query or fragment.
OTLP_ENDPOINT_PATTERN = r"^https?://[^\s/?#@]+(/[^\s?#]*)?$"
OTLP_ENDPOINT_MESSAGE = ("must be an http:// or https:// URL with a host, an optional port and path, and no "
                         "user:password@, query or fragment, e.g. http://otel-collector.observability:4318/v1/traces")
# With http/protobuf the SDK posts to the URL exactly as given: a URL without a path posts to `/`,
# which an OpenTelemetry Collector answers 404 (every span lost, quietly).
HTTP_PATH_RULE = ("with otlpTracesProtocol http/protobuf the OTLP exporter posts to this URL as given: "
                  "include the path, e.g. http://otel-collector.observability:4318/v1/traces")


def has_http_path(endpoint: str) -> bool:
    """Whether an endpoint URL has a path beyond `/` (what http/protobuf needs)."""
    rest = endpoint.split("://", 1)[-1]
    _, slash, path = rest.partition("/")
    return bool(slash and path)


def sampler_env(ratio: float | None, parent_based: bool) -> list[tuple[str, str]]:
    """OTEL_TRACES_SAMPLER (+ _ARG) for a sampling ratio; none when unset (the SDK keeps every span)."""
    if ratio is None:
        return []
    name = SAMPLER_PARENT_BASED_RATIO if parent_based else SAMPLER_RATIO
    return [(ENV_SAMPLER, name), (ENV_SAMPLER_ARG, repr(float(ratio)))]
