"""The twin's request spans through a real OpenTelemetry Collector (harness/otelcol.py, built by
scripts/build-otelcol.sh), over OTLP/HTTP and OTLP/gRPC.

The twin runs the `kvpilot twin serve` command an InferenceService with `engine.kind: twin` and
spec.observability.tracing renders, with the rendered environment; only the endpoint is the test's
collector.  The collector's file exporter writes what it received, re-encoded as OTLP/JSON: span
name, kind, scope, trace, parent/child links and the `gen_ai.*` attributes must arrive as sent,
with their types (ints as ints, doubles as doubles).  tests/integration/twin/test_tracing.py checks
the same spans at a receiver in the test itself (samplers, the missing-exporter error), where no Go
build is needed.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.otelcol import CollectedSpan, OtelCollector, built_collector, require_grpc_exporter
from harness.twin_process import twin_server
from kvpilot.api import tracing as vt
from kvpilot.api.models import InferenceService
from kvpilot.operator.builders.render import render_manifests

pytestmark = pytest.mark.integration

A = vt.SpanAttributes
# Every attribute vLLM sets on its request span; a request with every sampling parameter gets all.
ALL_SET = {v for k, v in vars(A).items() if k.startswith("GEN_AI_")}
INT_KEYS = {A.GEN_AI_USAGE_PROMPT_TOKENS, A.GEN_AI_USAGE_COMPLETION_TOKENS, A.GEN_AI_REQUEST_MAX_TOKENS,
            A.GEN_AI_REQUEST_N}
PARENT_ID = "00f067aa0ba902b7"
# Export at once rather than every 5 s (the BatchSpanProcessor's default schedule).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def rendered_twin(endpoint: str, protocol: str) -> tuple[list[str], dict[str, str]]:
    """The rendered twin container's args after `kvpilot twin serve` (less --port and --host: the
    harness serves on a free 127.0.0.1 port) and its environment."""
    isvc = InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "serving"},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": "tiny",
                 "engine": {"kind": "twin"},
                 "observability": {"tracing": {"otlpTracesEndpoint": endpoint, "otlpTracesProtocol": protocol}}},
    })
    deployment = next(m for m in render_manifests(isvc) if m["kind"] == "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["kvpilot", "twin", "serve"]
    args = list(container["args"])
    for flag in ("--port", "--host"):
        i = args.index(flag)
        del args[i:i + 2]
    assert args[args.index("--otlp-traces-endpoint") + 1] == endpoint
    return args, {e["name"]: e["value"] for e in container["env"]}


@pytest.fixture(scope="module")
def collector() -> Iterator[OtelCollector]:
    with OtelCollector(built_collector()) as c:
        yield c


def post(url: str, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=60) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
        return reply


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"], ids=["otlp-http", "otlp-grpc"])
def test_the_collector_receives_the_twins_spans_as_sent(collector: OtelCollector, protocol: str) -> None:
    if protocol == "grpc":
        require_grpc_exporter()
    endpoint = collector.http_traces_url if protocol == "http/protobuf" else collector.grpc_endpoint
    args, env = rendered_twin(endpoint, protocol)
    assert env[vt.ENV_PROTOCOL] == protocol
    # A trace id of its own per protocol, so the module's two tests read only their spans.
    base = 0x7000 if protocol == "grpc" else 0x6000
    sampled = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "ignore_eos": True}
    requests = [
        ("/v1/completions", {"model": "tiny", "prompt": "hello there", **sampled}),
        # vLLM's defaults: temperature 0 is falsy, so vLLM (and the twin) leave the attribute out.
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3, "temperature": 0}),
    ]
    trace_ids = [f"{base + i:032x}" for i in range(len(requests))]
    with twin_server(*args, env={**env, **FAST_EXPORT}) as twin:
        replies = [post(twin.base_url + path, body, {"traceparent": f"00-{tid}-{PARENT_ID}-01"})
                   for (path, body), tid in zip(requests, trace_ids, strict=True)]
        spans = collector.wait_for(lambda got: {s.trace_id for s in got} >= set(trace_ids), timeout=60)
        pid = twin.pid
    mine: dict[str, CollectedSpan] = {s.trace_id: s for s in spans if s.trace_id in trace_ids}
    assert sorted(mine) == trace_ids, [(s.name, s.trace_id) for s in spans]
    for tid, reply in zip(trace_ids, replies, strict=True):
        span = mine[tid]
        assert (span.name, span.kind, span.scope) == (vt.REQUEST_SPAN_NAME, "SPAN_KIND_SERVER",
                                                      vt.INSTRUMENTATION_SCOPE)
        # A child of the caller's span, in the caller's trace.
        assert span.parent_span_id == PARENT_ID and len(span.span_id) == 16 and span.span_id != PARENT_ID
        assert span.attributes[A.GEN_AI_REQUEST_ID] == reply["id"]
        assert span.resource["service.name"] == "chat"  # OTEL_SERVICE_NAME, rendered from the name
        assert span.resource["service.namespace"] == span.resource["k8s.namespace.name"] == "serving"
        assert span.resource[vt.RESOURCE_INSTRUMENTING_MODULE] == vt.INSTRUMENTING_MODULE_NAME
        assert span.resource[vt.RESOURCE_PROCESS_ID] == str(pid)
        at = span.attributes
        assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(at[A.GEN_AI_LATENCY_E2E], abs=1e-6)
        assert 0 <= at[A.GEN_AI_LATENCY_TIME_IN_QUEUE] <= at[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] \
            <= at[A.GEN_AI_LATENCY_E2E]
        assert at[A.GEN_AI_USAGE_PROMPT_TOKENS] == reply["usage"]["prompt_tokens"]
        assert at[A.GEN_AI_USAGE_COMPLETION_TOKENS] == reply["usage"]["completion_tokens"]
        # The value types the SDK sent: ints as OTLP intValue, latencies as doubleValue.
        for key, value in at.items():
            want = str if key == A.GEN_AI_REQUEST_ID else int if key in INT_KEYS else float
            assert type(value) is want, (key, value)
    completion, chat = (mine[tid].attributes for tid in trace_ids)
    assert set(completion) == ALL_SET
    assert (completion[A.GEN_AI_REQUEST_TEMPERATURE], completion[A.GEN_AI_REQUEST_TOP_P]) == pytest.approx((0.7, 0.9))
    assert (completion[A.GEN_AI_USAGE_COMPLETION_TOKENS], completion[A.GEN_AI_REQUEST_MAX_TOKENS],
            completion[A.GEN_AI_REQUEST_N]) == (5, 5, 1)
    assert set(chat) == ALL_SET - {A.GEN_AI_REQUEST_TEMPERATURE}
    assert chat[A.GEN_AI_REQUEST_TOP_P] == 1.0 and chat[A.GEN_AI_REQUEST_MAX_TOKENS] == 3

