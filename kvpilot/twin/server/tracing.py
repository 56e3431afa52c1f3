"""The twin's request spans: vLLM's `llm_request` span, from the twin's own timings.

`kvpilot twin serve --otlp-traces-endpoint URL` traces as `vllm serve` does (vLLM 0.32,
vllm/tracing and OutputProcessor.do_tracing): when a request finishes, one span named
`llm_request`, kind SERVER, starting at the request's arrival and ending when it is processed,
with vLLM's `gen_ai.*` attributes, continuing the trace of the request's W3C `traceparent` /
`tracestate` headers.  The exporter and the provider are built as vLLM builds them: protocol from
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (`grpc` when unset, as in vLLM), the endpoint passed as given,
a BatchSpanProcessor, the SDK's sampler and resource from the OTEL_* environment, plus vLLM's
resource attributes `vllm.instrumenting_module_name` and `vllm.process_id`.

The latencies are the twin's: the same arrival, scheduled, first- and last-token times its
/metrics histograms are observed from (so a span and the histograms agree).

OpenTelemetry is an optional dependency (`kvpilot[tracing]`: the SDK and the OTLP/HTTP exporter;
`kvpilot[tracing-grpc]` adds the gRPC exporter).  This module imports it only when a tracer is
built, so a twin without tracing neither imports it nor does any per-request work for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from kvpilot.api import tracing as vt

_EXTRA_HINT = "pip install 'kvpilot[tracing]'"


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but cannot run here (a package missing, an unknown protocol)."""


def _exporter(protocol: str, endpoint: str) -> Any:
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise TracingUnavailable(
                f"--otlp-traces-endpoint: {vt.ENV_PROTOCOL} is grpc (vLLM's default when it is unset), and this "
                "installation has no OTLP/gRPC exporter (the kvpilot image carries only OTLP/HTTP): set "
                f"{vt.ENV_PROTOCOL}=http/protobuf with an endpoint ending in /v1/traces, or "
                "pip install 'kvpilot[tracing-grpc]'") from None
        return GrpcExporter(endpoint=endpoint, insecure=True)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter(endpoint=endpoint)
    # vLLM's words (vllm/tracing/otel.py get_span_exporter).
    raise TracingUnavailable(f"Unsupported OTLP protocol '{protocol}' is configured ({vt.ENV_PROTOCOL}; "
                             f"allowed: {', '.join(vt.PROTOCOLS)})")


class RequestTracer:
    """Emits vLLM's request span for each finished request; `shutdown()` flushes what is queued."""

    def __init__(self, endpoint: str, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise TracingUnavailable(f"--otlp-traces-endpoint needs the OpenTelemetry SDK, which is not installed "
                                     f"({exc.name or exc}): {_EXTRA_HINT}") from None
        try:
            from opentelemetry.exporter.otlp.proto.http import trace_exporter  # noqa: F401
        except ImportError:
            if env.get(vt.ENV_PROTOCOL, vt.VLLM_DEFAULT_PROTOCOL) != "grpc":
                raise TracingUnavailable(f"--otlp-traces-endpoint needs the OTLP/HTTP exporter: {_EXTRA_HINT}") from None
        exporter = _exporter(env.get(vt.ENV_PROTOCOL, vt.VLLM_DEFAULT_PROTOCOL), endpoint)
        resource = Resource.create({vt.RESOURCE_INSTRUMENTING_MODULE: vt.INSTRUMENTING_MODULE_NAME,
                                    vt.RESOURCE_PROCESS_ID: str(os.getpid())})
        # The sampler comes from OTEL_TRACES_SAMPLER / _ARG, as in vLLM (neither passes one).
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer(vt.INSTRUMENTATION_SCOPE)
        self._propagator = TraceContextTextMapPropagator()
        self._server = SpanKind.SERVER
        # The twin keeps request times on the monotonic clock; spans carry wall-clock nanoseconds.
        self._epoch_offset_s = time.time() - time.monotonic()
        self.endpoint = endpoint

    def _ns(self, monotonic_s: float) -> int:
        return int((monotonic_s + self._epoch_offset_s) * 1e9)

    def request_finished(self, *, request_id: str, trace_headers: Mapping[str, str] | None, arrival: float,
                         scheduled: float, first_token: float, last_token: float, now: float,
                         prompt_tokens: int, completion_tokens: int, max_tokens: int | None,
                         temperature: float | None, top_p: float | None, n: int = 1) -> None:
        """One `llm_request` span, as vLLM's OutputProcessor.do_tracing makes it (times: time.monotonic())."""
        a = vt.SpanAttributes
        attributes: dict[str, Any] = {
            a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: first_token - arrival,
            a.GEN_AI_LATENCY_E2E: now - arrival,
            a.GEN_AI_LATENCY_TIME_IN_QUEUE: scheduled - arrival,
            a.GEN_AI_USAGE_PROMPT_TOKENS: prompt_tokens,
            a.GEN_AI_USAGE_COMPLETION_TOKENS: completion_tokens,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: first_token - scheduled,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: last_token - first_token,
            a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: last_token - scheduled,
            a.GEN_AI_REQUEST_ID: request_id,
        }
        # vLLM adds these only when truthy (a temperature of 0 is left out).
        if top_p:
            attributes[a.GEN_AI_REQUEST_TOP_P] = top_p
        if max_tokens:
            attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
        if temperature:
            attributes[a.GEN_AI_REQUEST_TEMPERATURE] = temperature
        if n:
            attributes[a.GEN_AI_REQUEST_N] = n
        context = self._propagator.extract(trace_headers) if trace_headers else None
        span = self._tracer.start_span(vt.REQUEST_SPAN_NAME, context=context, kind=self._server,
                                       start_time=self._ns(arrival))
        span.set_attributes(attributes)
        span.end(end_time=self._ns(now))

    def shutdown(self) -> None:
        """Export what is queued and stop (blocks up to the exporter's timeout)."""
        self._provider.shutdown()


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of a request (vLLM's extract_trace_headers), None without any."""
    found = {h: headers[h] for h in vt.TRACE_HEADERS if h in headers}
    return found or None
