"""The twin's RequestTracer on its own: vLLM's span from given timings (an in-memory exporter beside the
OTLP one), the falsy-parameter rule, trace-context extraction, and the start-up errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpilot.api import tracing as vt
from kvpilot.twin.server.tracing import RequestTracer, TracingUnavailable, trace_headers

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from tests.support.otlp_receiver import OtlpReceiver  # noqa: E402

A = vt.SpanAttributes
NOWHERE = "http://127.0.0.1:9/v1/traces"  # for tracers that are never built
HTTP = {vt.ENV_PROTOCOL: "http/protobuf"}


@pytest.fixture
def traced() -> Iterator[tuple[RequestTracer, InMemorySpanExporter]]:
    """A tracer exporting to a real receiver, with an in-memory exporter beside it to read spans at once."""
    with OtlpReceiver() as receiver:
        tracer = RequestTracer(receiver.url, environ=HTTP)
        memory = InMemorySpanExporter()
        tracer._provider.add_span_processor(SimpleSpanProcessor(memory))
        yield tracer, memory
        tracer.shutdown()
        assert len(receiver.received()) == len(memory.get_finished_spans())


def finish(tracer: RequestTracer, **overrides: Any) -> None:
    kwargs: dict[str, Any] = dict(request_id="cmpl-1", trace_headers=None, arrival=100.0, scheduled=100.25,
                                  first_token=100.5, last_token=101.5, now=101.75, prompt_tokens=12,
                                  completion_tokens=8, max_tokens=8, temperature=0.5, top_p=0.95)
    kwargs.update(overrides)
    tracer.request_finished(**kwargs)


def test_the_span_is_vllms_with_the_twins_timings(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, memory = traced
    finish(tracer)
    [span] = memory.get_finished_spans()
    assert (span.name, span.kind, span.instrumentation_scope.name) == (
        vt.REQUEST_SPAN_NAME, SpanKind.SERVER, vt.INSTRUMENTATION_SCOPE)
    assert dict(span.attributes or {}) == pytest.approx({
        A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.5, A.GEN_AI_LATENCY_E2E: 1.75, A.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.25,
        A.GEN_AI_USAGE_PROMPT_TOKENS: 12, A.GEN_AI_USAGE_COMPLETION_TOKENS: 8,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.25, A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 1.0,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: 1.25, A.GEN_AI_REQUEST_ID: "cmpl-1", A.GEN_AI_REQUEST_TOP_P: 0.95,
        A.GEN_AI_REQUEST_MAX_TOKENS: 8, A.GEN_AI_REQUEST_TEMPERATURE: 0.5, A.GEN_AI_REQUEST_N: 1})
    assert span.start_time is not None and span.end_time is not None
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(1.75, abs=1e-6)
    assert span.resource.attributes[vt.RESOURCE_INSTRUMENTING_MODULE] == vt.INSTRUMENTING_MODULE_NAME
    assert span.parent is None


def test_falsy_parameters_are_left_out_as_vllm_leaves_them(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, memory = traced
    finish(tracer, temperature=0.0, top_p=None, max_tokens=None)
    [span] = memory.get_finished_spans()
    keys = set(span.attributes or {})
    assert not keys & {A.GEN_AI_REQUEST_TEMPERATURE, A.GEN_AI_REQUEST_TOP_P, A.GEN_AI_REQUEST_MAX_TOKENS}
    assert A.GEN_AI_REQUEST_N in keys


def test_the_callers_trace_context_is_continued(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, memory = traced
    headers = trace_headers({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                             "tracestate": "vendor=1", "x-other": "y"})
    assert headers == {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                       "tracestate": "vendor=1"}
    assert trace_headers({"x-other": "y"}) is None
    finish(tracer, trace_headers=headers)
    [span] = memory.get_finished_spans()
    assert span.parent is not None and span.parent.span_id == 0x00f067aa0ba902b7
    assert span.context.trace_id == 0x4bf92f3577b34da6a3ce929d0e0e4736
    assert span.context.trace_state.to_header() == "vendor=1"


def test_an_unknown_protocol_is_refused_in_vllms_words() -> None:
    with pytest.raises(TracingUnavailable, match="Unsupported OTLP protocol 'http/json' is configured"):
        RequestTracer(NOWHERE, environ={vt.ENV_PROTOCOL: "http/json"})


def test_grpc_is_the_default_protocol_as_in_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        with pytest.raises(TracingUnavailable, match="is grpc .vLLM's default"):
            RequestTracer("http://127.0.0.1:9", environ={})
    else:
        RequestTracer("http://127.0.0.1:9", environ={})._provider.shutdown()
