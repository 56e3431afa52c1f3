"""The twin's request spans, received by a real OTLP/HTTP receiver (tests/support/otlp_receiver.py).

A real `kvpilot twin serve --otlp-traces-endpoint` process exports over OTLP/HTTP (protobuf) with
the OpenTelemetry SDK; the receiver decodes the ExportTraceServiceRequest bodies.  The span is
vLLM's (kvpilot.api.tracing): name, kind, attributes, resource, the trace of the caller's
`traceparent`, and the OTEL_TRACES_SAMPLER the operator renders.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.twin_process import FAST_TWIN_ARGS, REPO_ROOT, twin_server
from kvpilot.api import tracing as vt
from tests.support.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.integration

A = vt.SpanAttributes
ALL_KEYS = {
    A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, A.GEN_AI_LATENCY_E2E, A.GEN_AI_LATENCY_TIME_IN_QUEUE,
    A.GEN_AI_USAGE_PROMPT_TOKENS, A.GEN_AI_USAGE_COMPLETION_TOKENS, A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
    A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE, A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE, A.GEN_AI_REQUEST_ID,
    A.GEN_AI_REQUEST_TOP_P, A.GEN_AI_REQUEST_MAX_TOKENS, A.GEN_AI_REQUEST_TEMPERATURE, A.GEN_AI_REQUEST_N,
}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT_ID}-01"
# Export at once rather than every 5 s (the BatchSpanProcessor's default schedule).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return bytes(resp.read())


def traced_twin(receiver: OtlpReceiver, **env: str) -> Any:
    return twin_server(*FAST_TWIN_ARGS, "--served-model-name", "tiny", "--otlp-traces-endpoint", receiver.url,
                       env={vt.ENV_PROTOCOL: "http/protobuf", vt.ENV_SERVICE_NAME: "chat", **FAST_EXPORT, **env})


def test_the_twin_sends_vllms_request_span_continuing_the_callers_trace(receiver: OtlpReceiver) -> None:
    with traced_twin(receiver) as twin:
        reply = json.loads(post(twin.base_url + "/v1/completions",
                                {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "ignore_eos": True,
                                 "temperature": 0.7, "top_p": 0.9}, {"traceparent": SAMPLED}))
        stream = post(twin.base_url + "/v1/chat/completions",
                      {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "temperature": 0, "stream_options": {"include_usage": True}})
        spans = receiver.wait_for(lambda s: len(s) >= 2)
        e2e_sum = twin.metric_value("vllm:e2e_request_latency_seconds_sum")
        ttft_sum = twin.metric_value("vllm:time_to_first_token_seconds_sum")
        pid = twin.pid
    assert b"[DONE]" in stream
    assert receiver.errors == [] and len(spans) == 2
    for span in spans:
        assert (span.name, span.kind, span.scope) == (vt.REQUEST_SPAN_NAME, "SPAN_KIND_SERVER", vt.INSTRUMENTATION_SCOPE)
        assert span.content_type == "application/x-protobuf"
        assert span.resource["service.name"] == "chat"
        assert span.resource[vt.RESOURCE_INSTRUMENTING_MODULE] == vt.INSTRUMENTING_MODULE_NAME
        assert span.resource[vt.RESOURCE_PROCESS_ID] == str(pid)
        at = span.attributes
        assert 0 <= at[A.GEN_AI_LATENCY_TIME_IN_QUEUE] <= at[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] <= at[A.GEN_AI_LATENCY_E2E]
        assert at[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] == pytest.approx(
            at[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] + at[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE])
        # The span lasts from arrival to the end of the request, as its e2e latency says.
        assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(at[A.GEN_AI_LATENCY_E2E], abs=1e-6)
    by_id = {s.attributes[A.GEN_AI_REQUEST_ID]: s for s in spans}
    completion = by_id[reply["id"]]
    # It continues the caller's trace, as a child of the caller's span.
    assert (completion.trace_id, completion.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert set(completion.attributes) == ALL_KEYS
    assert {k: completion.attributes[k] for k in (A.GEN_AI_USAGE_PROMPT_TOKENS, A.GEN_AI_USAGE_COMPLETION_TOKENS,
                                                  A.GEN_AI_REQUEST_MAX_TOKENS, A.GEN_AI_REQUEST_N)} == {
        A.GEN_AI_USAGE_PROMPT_TOKENS: reply["usage"]["prompt_tokens"],
        A.GEN_AI_USAGE_COMPLETION_TOKENS: 5, A.GEN_AI_REQUEST_MAX_TOKENS: 5, A.GEN_AI_REQUEST_N: 1}
    assert completion.attributes[A.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.7)
    assert completion.attributes[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    # No traceparent: a trace of its own; temperature 0 is left out, as vLLM leaves out a falsy one.
    [chat] = [s for s in spans if s is not completion]
    assert chat.trace_id != TRACE_ID and chat.parent_span_id == ""
    assert set(chat.attributes) == ALL_KEYS - {A.GEN_AI_REQUEST_TEMPERATURE}
    assert chat.attributes[A.GEN_AI_REQUEST_TOP_P] == 1.0  # vLLM's default
    # The spans carry the very latencies /metrics observed.
    assert sum(s.attributes[A.GEN_AI_LATENCY_E2E] for s in spans) == pytest.approx(e2e_sum, abs=1e-6)
    assert sum(s.attributes[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] for s in spans) == pytest.approx(ttft_sum, abs=1e-6)


def test_sampling_ratio_zero_sends_no_root_span_but_follows_a_sampled_caller(receiver: OtlpReceiver) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
    with traced_twin(receiver, OTEL_TRACES_SAMPLER=vt.SAMPLER_PARENT_BASED_RATIO, OTEL_TRACES_SAMPLER_ARG="0") as twin:
        for _ in range(5):
            post(twin.base_url + "/v1/completions", body)
        post(twin.base_url + "/v1/completions", body, {"traceparent": unsampled})
        followed = json.loads(post(twin.base_url + "/v1/completions", body, {"traceparent": SAMPLED}))
        receiver.wait_for(lambda s: len(s) >= 1)
    # Stopped: the twin flushed whatever it had queued, so what came is all there is.
    spans = receiver.received()
    assert [(s.attributes[A.GEN_AI_REQUEST_ID], s.trace_id) for s in spans] == [(followed["id"], TRACE_ID)]


def test_plain_traceidratio_zero_sends_nothing_even_for_a_sampled_caller(receiver: OtlpReceiver) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with traced_twin(receiver, OTEL_TRACES_SAMPLER=vt.SAMPLER_RATIO, OTEL_TRACES_SAMPLER_ARG="0") as twin:
        for headers in ({}, {"traceparent": SAMPLED}):
            post(twin.base_url + "/v1/completions", body, headers)
        assert twin.stop() == 0  # flushes the span queue before it exits
    assert receiver.received() == [] and receiver.requests == 0


# `python -m kvpilot.cli` in a process where the OTLP/gRPC exporter cannot be imported, as in the
# kvpilot image: the dev venv has it (kvpilot[tracing-grpc], for the twin's gRPC test through the
# collector), and a None in sys.modules is how Python itself marks a module as not importable.
WITHOUT_GRPC_EXPORTER = ("import runpy, sys; sys.modules['opentelemetry.exporter.otlp.proto.grpc'] = None; "
                         "sys.argv[0] = 'kvpilot'; runpy.run_module('kvpilot.cli', run_name='__main__')")


def test_grpc_without_its_exporter_fails_at_start_saying_what_to_do() -> None:
    argv = [*FAST_TWIN_ARGS, "--port", "0", "--otlp-traces-endpoint", "http://127.0.0.1:9"]
    proc = subprocess.run([sys.executable, "-c", WITHOUT_GRPC_EXPORTER, "twin", "serve", *argv],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 2, proc.stderr
    # grpc is vLLM's default protocol when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is unset, so the twin's too.
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is grpc" in proc.stderr
    assert "http/protobuf" in proc.stderr and "kvpilot[tracing-grpc]" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_twin_without_tracing_never_imports_opentelemetry() -> None:
    code = ("import sys, argparse\n"
            "import kvpilot.twin.server.app, kvpilot.twin.server.cli, kvpilot.twin.flags\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=REPO_ROOT)


def test_trace_context_without_tracing_is_ignored_with_vllms_warning_once() -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with twin_server(*FAST_TWIN_ARGS, "--served-model-name", "tiny") as twin:
        for _ in range(3):
            post(twin.base_url + "/v1/completions", body, {"traceparent": SAMPLED})
        warnings = [r for r in twin.log_records()
                    if r.get("msg") == "Received a request with trace context but tracing is disabled"]
    assert len(warnings) == 1
