"""A real OTLP/HTTP trace receiver for tests: an aiohttp server on 127.0.0.1 (a free port) that
accepts `POST /v1/traces` (protobuf, optionally gzip), decodes each body with opentelemetry-proto's
ExportTraceServiceRequest and keeps every span, flattened, for the test to read.

    with OtlpReceiver() as receiver:
        receiver.url                      # http://127.0.0.1:PORT/v1/traces
        spans = receiver.wait_for(lambda spans: len(spans) >= 2, timeout=30)

It runs its own event loop in a thread, so sync tests and servers in other processes can use it.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

from aiohttp import web

TRACES_PATH = "/v1/traces"


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
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
    flags: int = 0
    content_type: str = ""
    raw: Any = field(default=None, repr=False, compare=False)


def decode(body: bytes, content_type: str = "") -> list[ReceivedSpan]:
    """The spans of one ExportTraceServiceRequest body."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(ReceivedSpan(
                    name=s.name, kind=Span.SpanKind.Name(s.kind), trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                    parent_span_id=s.parent_span_id.hex(), start_ns=s.start_time_unix_nano,
                    end_ns=s.end_time_unix_nano, attributes=_attributes(s.attributes), resource=resource,
                    scope=ss.scope.name, flags=s.flags, content_type=content_type, raw=s))
    return out


class OtlpReceiver:
    """The receiver; `spans` is every span received so far, in arrival order."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port: int | None = None
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._stopped: asyncio.Event | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "not started"
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    async def _traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        body = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        try:
            spans = decode(body, request.content_type)
        except Exception as exc:  # a body that is not an ExportTraceServiceRequest: say so, as a collector does
            with self._lock:
                self.errors.append(repr(exc))
            return web.Response(status=400, text=f"cannot decode ExportTraceServiceRequest: {exc}")
        with self._lock:
            self.requests += 1
            self.spans.extend(spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def _serve(self, ready: threading.Event) -> None:
        self._stopped = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(TRACES_PATH, self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        ready.set()
        await self._stopped.wait()
        await self._runner.cleanup()

    def start(self) -> Self:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            self._loop.run_until_complete(self._serve(ready))
            self._loop.close()

        self._thread = threading.Thread(target=run, name="otlp-receiver", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the OTLP receiver did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
            self._thread.join(10)
        self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0) -> list[ReceivedSpan]:
        """Poll (with a deadline) until `done(spans)`; the spans then, or AssertionError with what came."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.received()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"OTLP receiver: condition not met within {timeout:.0f} s; received "
                                     f"{[(s.name, s.trace_id) for s in spans]}, errors {self.errors}")
            time.sleep(0.02)
