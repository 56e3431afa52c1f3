"""A real OpenTelemetry Collector for tests: the binary `scripts/build-otelcol.sh` builds (core
distribution components plus contrib's file exporter, one collector release pinned in
tools/otelcol/go.mod), started on 127.0.0.1 with its OTLP receiver on free ports, gRPC and HTTP,
and a traces pipeline into the file exporter.  The test reads what the collector wrote: one
OTLP/JSON ExportTraceServiceRequest per line, as the collector re-encodes what it received.

    with OtelCollector(built_collector()) as collector:
        collector.grpc_endpoint           # http://127.0.0.1:PORT (OTLP/gRPC)
        collector.http_traces_url         # http://127.0.0.1:PORT/v1/traces (OTLP/HTTP)
        spans = collector.wait_for(lambda spans: len(spans) >= 2, timeout=30)

Without the binary a test skips, saying how to build it; in CI (`CI=true`) that is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import pytest
import yaml

from harness.cluster import in_ci, not_built, print_dir
from harness.prometheus import free_port
from harness.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build-otelcol.sh"
BINARY = "otelcol"
# What the collector logs once every pipeline and receiver is up (service.go).
READY_LINE = "Everything is ready. Begin running and processing data."
# OTLP's Span.SpanKind, by number, as opentelemetry-proto names them.
SPAN_KINDS = ("SPAN_KIND_UNSPECIFIED", "SPAN_KIND_INTERNAL", "SPAN_KIND_SERVER", "SPAN_KIND_CLIENT",
              "SPAN_KIND_PRODUCER", "SPAN_KIND_CONSUMER")


class CollectorStartError(RuntimeError):
    pass


def built_collector() -> Path:
    """The collector binary; without it a test skips, saying how to build it, and in CI fails."""
    binary = print_dir(BUILD_SCRIPT) / BINARY
    if not os.access(binary, os.X_OK):
        not_built(f"OpenTelemetry Collector not built: {binary} missing; run scripts/build-otelcol.sh "
                  "(needs Go >= 1.26 and the Go module proxy)")
    return binary


def require_grpc_exporter() -> None:
    """For a twin exporting over OTLP/gRPC: skip without the exporter, saying what to install; in CI,
    where `make setup` installs it, fail."""
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        reason = ("the twin's OTLP/gRPC exporter is not installed here: pip install 'kvpilot[tracing-grpc]' "
                  "(make setup installs it; a venv it made before it did lacks it)")
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)


@dataclass(frozen=True)
class CollectedSpan:
    """One span as the collector's file exporter wrote it (the same fields as
    tests/support/otlp_receiver.ReceivedSpan, so the two compare)."""

    name: str
    kind: str  # SPAN_KIND_SERVER, ...
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str


def _value(v: dict[str, Any]) -> Any:
    """An OTLP/JSON AnyValue: 64-bit ints are strings in JSON, and a double with no fraction is
    written as an integer, so both are turned back into the type the field declares."""
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return _attributes(v["kvlistValue"].get("values", []))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def _attributes(kvs: list[dict[str, Any]]) -> dict[str, Any]:
    return {kv["key"]: _value(kv.get("value", {})) for kv in kvs}


def parse_traces(line: str) -> list[CollectedSpan]:
    """The spans of one line of the file exporter's output (an OTLP/JSON ExportTraceServiceRequest)."""
    out = []
    for rs in json.loads(line).get("resourceSpans", []):
        resource = _attributes(rs.get("resource", {}).get("attributes", []))
        for ss in rs.get("scopeSpans", []):
            scope = ss.get("scope", {}).get("name", "")
            for s in ss.get("spans", []):
                out.append(CollectedSpan(
                    name=s["name"], kind=SPAN_KINDS[int(s.get("kind", 0))], trace_id=s["traceId"],
                    span_id=s["spanId"], parent_span_id=s.get("parentSpanId", ""),
                    start_ns=int(s["startTimeUnixNano"]), end_ns=int(s["endTimeUnixNano"]),
                    attributes=_attributes(s.get("attributes", [])), resource=resource, scope=scope))
    return out


class OtelCollector(ServerProcess):
    START_DEADLINE_S = 60.0

    def __init__(self, binary: Path) -> None:
        self.binary = binary
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.traces_path: Path | None = None

    @property
    def grpc_endpoint(self) -> str:
        """What an OTLP/gRPC exporter takes (vLLM's `--otlp-traces-endpoint` with protocol grpc)."""
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_traces_url(self) -> str:
        """What an OTLP/HTTP exporter posts to, as given (with protocol http/protobuf)."""
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def config(self) -> dict[str, Any]:
        assert self.traces_path is not None
        return {
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}"},
                                                 "http": {"endpoint": f"127.0.0.1:{self.http_port}"}}}},
            # The default rotation settings make each export one unbuffered write of one line.
            "exporters": {"file": {"path": str(self.traces_path), "format": "json"}},
            "service": {
                "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}},
                # Its own metrics would listen on :8888, which parallel tests and other users share.
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
            },
        }

    def start(self) -> Self:
        try:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvpilot-otelcol-")
            tmp = Path(self._tmp.name)
            self.grpc_port, self.http_port = free_port(), free_port()
            self.traces_path = tmp / "traces.jsonl"
            config_path = tmp / "config.yaml"
            config_path.write_text(yaml.safe_dump(self.config()))
            self.log_path = tmp / "otelcol.log"
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen([str(self.binary), "--config", str(config_path)], stdout=self._log,
                                         stderr=subprocess.STDOUT, cwd=tmp)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.START_DEADLINE_S
        while READY_LINE not in self.log_tail(1_000_000):
            if self.proc.poll() is not None:
                raise CollectorStartError(f"otelcol exited with {self.proc.returncode}:\n{self.log_tail(4000)}")
            if time.monotonic() > deadline:
                raise CollectorStartError(f"otelcol not ready within {self.START_DEADLINE_S:.0f} s:\n"
                                          f"{self.log_tail(4000)}")
            time.sleep(0.05)

    def spans(self) -> list[CollectedSpan]:
        """Every span written so far, in file order (a line still being written is left for later)."""
        if self.traces_path is None or not self.traces_path.exists():
            return []
        text = self.traces_path.read_text()
        complete = text[:text.rfind("\n") + 1]
        return [span for line in complete.splitlines() if line.strip() for span in parse_traces(line)]

    def wait_for(self, done: Callable[[list[CollectedSpan]], bool], timeout: float = 30.0) -> list[CollectedSpan]:
        """Poll the file (with a deadline) until `done(spans)`; the spans then, or AssertionError
        with what came and the collector's log."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if done(spans):
                return spans
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"otelcol exited with {self.proc.returncode}:\n{self.log_tail(4000)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"otelcol: condition not met within {timeout:.0f} s; wrote "
                                     f"{[(s.name, s.trace_id) for s in spans]}; its log:\n{self.log_tail(3000)}")
            time.sleep(0.05)
