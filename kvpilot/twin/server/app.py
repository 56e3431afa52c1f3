# Over 500 lines: one aiohttp application whose OpenAI routes share the request's lifecycle, streaming and metrics.
"""The engine twin's HTTP server: vLLM's OpenAI-compatible API, paced by the simulated engine.

`EngineLoop` drives the engine in real time, `TwinServer` is the aiohttp application and `serve()` the
process lifecycle.  The engine is injected (`EngineLike`).  Details: docs/architecture.md, "The twin's
HTTP server".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import hdrs, web
from prometheus_client.exposition import gzip_accepted

from kvpilot.api import vllm
from kvpilot.twin import text as tokens
from kvpilot.twin.metrics import CONTENT_TYPE, VllmMetrics
from kvpilot.twin.server import protocol as proto
from kvpilot.twin.server.connection import Runner, keepalive_timeout
from kvpilot.twin.server.jsonlog import LOGGER_NAME
from kvpilot.twin.server.parsing import parse_body
from kvpilot.twin.server.tracing import RequestTracer, trace_headers
from kvpilot.twin.server.workers import ParseWorkers, WorkerDied

log = logging.getLogger(LOGGER_NAME)

# Prompts of long-context models run to megabytes of JSON (a million-token prompt is ~6 MB of text
# or ~7 MB of token ids); aiohttp's default cap is 1 MiB.  The cap holds for the bytes received
# and again for the bytes a compressed body inflates to.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Bodies larger than this, and every compressed body, are inflated, decoded and counted in worker
# processes, so the event loop (the engine loop, /health, every stream) keeps running while clients
# send megabytes: in a thread the parse would still hold the GIL for most of its CPU-seconds.  At
# most PARSE_SLOTS at once, which also bounds the memory they take, and PARSE_QUEUE waiting: more
# are answered 503 with Retry-After.
INLINE_PARSE_BYTES = 64 * 1024
PARSE_SLOTS = 2
PARSE_QUEUE = 8
# A client has this long to send its body once its headers are in (a slow upload is cut off).
BODY_TIMEOUT_S = 60.0
# How far behind the simulated timeline the engine loop may fall and still catch up.
CATCH_UP_S = 0.05
# After the drain, how long handlers get to write their final chunk before the sockets close.
_FLUSH_SECONDS = 2.0


class EngineLike(Protocol):
    """What the server needs from the twin's engine (kvpilot.twin.engine.Engine)."""

    def add_request(self, request_id: str, prompt_tokens: int, max_tokens: int,
                    arrival_time: float, *, prefix_key: str | None = None,
                    prefix_tokens: int = 0) -> Any: ...

    def abort_request(self, request_id: str) -> Any: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> Any: ...


@dataclass(frozen=True)
class ServingInfo:
    """What the API reports about the served model, and the cache config for /metrics."""

    served_model_name: str  # the first name: the model_name label of every metric
    model: str
    max_model_len: int
    cache_config: dict[str, Any] = field(default_factory=dict)
    extra_served_names: tuple[str, ...] = ()  # further --served-model-name values
    api_key: str | None = None  # --api-key / VLLM_API_KEY: /v1/* then needs "Authorization: Bearer KEY"

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.extra_served_names)


@dataclass
class Delivery:
    """Tokens the engine produced for one request in one step."""

    tokens: int
    finished: bool
    finish_reason: str | None
    at: float


@dataclass
class Tracked:
    """One request in flight, with the timestamps vLLM's frontend keeps for it."""

    request_id: str
    req: proto.GenerationRequest
    arrival: float
    eos_stop: bool  # True: the engine's max_tokens is the "model's" natural end, not the client's cap
    queue: asyncio.Queue[Delivery] = field(default_factory=asyncio.Queue)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    done: bool = False
    trace_headers: dict[str, str] | None = None  # traceparent / tracestate, kept only while tracing


class EngineLoop:
    """Drives the engine in real time and routes its outputs to the requests' queues."""

    def __init__(self, engine: EngineLike, metrics: VllmMetrics, tracer: RequestTracer | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tracer = tracer
        self.tracked: dict[str, Tracked] = {}
        self.dead: BaseException | None = None
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        self.simulated_s = 0.0
        self.behind_s = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="twin-engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, req: proto.GenerationRequest, trace_headers: dict[str, str] | None = None) -> Tracked:
        if self.dead is not None:
            raise proto.OpenAIError("The engine is dead; the server must be restarted.", status=503)
        budget, eos_stop = req.output_budget()
        tr = Tracked(request_id=proto.new_request_id(req.kind), req=req, arrival=time.monotonic(),
                     eos_stop=eos_stop, trace_headers=trace_headers)
        extra: dict[str, Any] = {}
        if req.prefix_key is not None:
            extra = {"prefix_key": req.prefix_key, "prefix_tokens": req.prefix_tokens}
        try:
            self.engine.add_request(tr.request_id, req.prompt_tokens, budget, tr.arrival, **extra)
        except ValueError as exc:  # the engine's own admission check (vLLM's wording)
            raise proto.OpenAIError(str(exc)) from None
        self.tracked[tr.request_id] = tr
        self._empty.clear()
        self._wake.set()
        return tr

    def abort(self, tr: Tracked, why: str) -> None:
        """Abort a request that is still in the engine (client gone, shutdown, engine error)."""
        if tr.done:
            return
        tr.done = True
        self.tracked.pop(tr.request_id, None)
        if self.dead is None:
            self.engine.abort_request(tr.request_id)
        self.metrics.record_aborted()
        self._refresh_gauges()
        tr.queue.put_nowait(Delivery(0, True, "abort", time.monotonic()))
        if not self.tracked:
            self._empty.set()
        log.debug("request aborted", extra={"fields": {"request_id": tr.request_id, "reason": why,
                                                       "generated_tokens": tr.generated}})

    def abort_all(self, why: str) -> None:
        for tr in list(self.tracked.values()):
            self.abort(tr, why)

    def _refresh_gauges(self) -> None:
        """Scheduler gauges outside a step: an abort frees a slot and KV blocks at once, and an
        idle engine takes no further step that would report it."""
        engine: Any = self.engine
        try:
            running, waiting = int(engine.num_running), int(engine.num_waiting)
            usage = float(engine.kv_cache_usage())
        except (AttributeError, TypeError):
            return  # an engine without these accessors: the next step reports them
        self.metrics.set_scheduler_state(num_running=running, num_waiting=waiting, kv_cache_usage=usage)

    async def wait_empty(self, timeout: float) -> bool:
        """Until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        loop_clock = time.monotonic
        next_start = loop_clock()
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()
                    next_start = loop_clock()
                    continue
                # The step starts when the previous one ended in simulated time: the CPU time of
                # delivering tokens and of step() itself is absorbed by the next sleep, so the
                # twin keeps the simulated pace on average.  Once the loop is more than
                # CATCH_UP_S behind (an overloaded CPU), it restarts the timeline from now rather
                # than rush steps out back to back; the dropped time is counted as "behind".
                now = loop_clock()
                behind = now - next_start
                if behind > CATCH_UP_S:
                    self.behind_s += behind
                    self.metrics.record_behind(behind)
                    next_start = now
                started = next_start
                out = self.engine.step()
                next_start = started + float(out.duration_s)
                self.steps += 1
                self.simulated_s += float(out.duration_s)
                self.metrics.record_engine_step(float(out.duration_s))
                await asyncio.sleep(max(0.0, next_start - loop_clock()))
                self._deliver(out, started, loop_clock())
                if not self.engine.has_unfinished_requests():
                    self._refresh_gauges()  # an abort during the step left `out` stale
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine bug must not hang every client: fail them, go unhealthy
            log.exception("engine loop failed", extra={"fields": {"error": repr(exc)}})
            self.dead = exc
            self.abort_all("engine error")

    def _deliver(self, out: Any, started: float, now: float) -> None:
        prompt_tokens_done = generation_tokens = 0
        for o in out.outputs:
            tr = self.tracked.get(o.request_id)
            if tr is None:
                continue  # aborted while the step ran
            if tr.scheduled_at is None:
                # A loop catching up starts steps slightly in the past; never before arrival.
                tr.scheduled_at = max(started, tr.arrival)
            n = int(o.new_token_count)
            if n > 0:
                if tr.first_token_at is None:
                    tr.first_token_at = now
                    prompt_tokens_done += tr.req.prompt_tokens
                    self.metrics.record_first_token(now - tr.arrival)
                else:
                    assert tr.last_token_at is not None
                    self.metrics.record_inter_token(now - tr.last_token_at)
                tr.last_token_at = now
                tr.generated += n
                generation_tokens += n
            reason = None
            if o.finished:
                reason = str(o.finish_reason or "length")
                if reason == "length" and tr.eos_stop:
                    reason = "stop"
                self._finish(tr, reason, now)
            if n > 0 or o.finished:
                tr.queue.put_nowait(Delivery(n, bool(o.finished), reason, now))
        self.metrics.record_step(
            num_running=int(out.num_running), num_waiting=int(out.num_waiting),
            kv_cache_usage=float(out.kv_cache_usage), num_preemptions=int(out.num_preemptions),
            num_prompt_tokens=prompt_tokens_done, num_generation_tokens=generation_tokens,
            prefix_queries=int(getattr(out, "num_prefix_queries", 0)),
            prefix_hits=int(getattr(out, "num_prefix_hits", 0)))

    @staticmethod
    def _trace(tracer: RequestTracer, tr: Tracked, scheduled: float, first: float, last: float, now: float) -> None:
        try:
            tracer.request_finished(
                request_id=tr.request_id, trace_headers=tr.trace_headers, arrival=tr.arrival, scheduled=scheduled,
                first_token=first, last_token=last, now=now, prompt_tokens=tr.req.prompt_tokens,
                completion_tokens=tr.generated, max_tokens=tr.req.max_tokens, temperature=tr.req.temperature,
                top_p=tr.req.top_p)
        except Exception as exc:  # a span must never fail the request or the engine loop
            log.warning("request span not recorded", extra={"fields": {"request_id": tr.request_id,
                                                                       "error": repr(exc)}})

    def _finish(self, tr: Tracked, reason: str, now: float) -> None:
        tr.done = True
        self.tracked.pop(tr.request_id, None)
        if not self.tracked:
            self._empty.set()
        scheduled = tr.scheduled_at if tr.scheduled_at is not None else now
        first = tr.first_token_at if tr.first_token_at is not None else now
        last = tr.last_token_at if tr.last_token_at is not None else now
        if reason == "abort":
            self.metrics.record_aborted()
        else:
            self.metrics.record_finished(
                finish_reason=reason if reason in ("stop", "length") else "stop",
                e2e_s=now - tr.arrival, queued_s=scheduled - tr.arrival,
                prefill_s=first - scheduled, decode_s=last - first, inference_s=last - scheduled,
                num_prompt_tokens=tr.req.prompt_tokens, num_generation_tokens=tr.generated,
                max_tokens_param=tr.req.max_tokens_param)
            if self.tracer is not None:
                self._trace(self.tracer, tr, scheduled, first, last, now)
        log.debug("request finished", extra={"fields": {
            "request_id": tr.request_id, "kind": tr.req.kind, "finish_reason": reason,
            "prompt_tokens": tr.req.prompt_tokens, "generated_tokens": tr.generated,
            "queue_s": round(scheduled - tr.arrival, 6), "ttft_s": round(first - tr.arrival, 6),
            "e2e_s": round(now - tr.arrival, 6)}})




def _spool_dir() -> str | None:
    """Where a large body is spooled: /dev/shm (memory) when it has room for several bodies (a
    container's default 64 MB does not), else the temp dir, whose disk writes can be throttled."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    room = stat.f_bavail * stat.f_frsize
    return "/dev/shm" if room >= 4 * MAX_BODY_BYTES and os.access("/dev/shm", os.W_OK) else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _json_error(exc: proto.OpenAIError) -> web.Response:
    resp = web.json_response(exc.body(), status=exc.status)
    if exc.retry_after is not None:
        resp.headers[hdrs.RETRY_AFTER] = str(exc.retry_after)
    return resp


def _one_line(value: Any, limit: int = 200) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class TwinServer:
    """The aiohttp application around one engine."""

    def __init__(self, engine: EngineLike, info: ServingInfo, tracer: RequestTracer | None = None) -> None:
        self.info = info
        self.metrics = VllmMetrics(info.served_model_name, max_model_len=info.max_model_len,
                                   cache_config=info.cache_config)
        self.tracer = tracer
        self._warned_untraced = False
        self.engine_loop = EngineLoop(engine, self.metrics, tracer)
        self.draining = False
        self.created = int(time.time())
        self._handlers: set[asyncio.Task[Any]] = set()
        self.parse_workers = ParseWorkers(PARSE_SLOTS, PARSE_QUEUE)
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        self.app.add_routes([
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat_completions),
            web.get("/v1/models", self._models),
            web.get("/health", self._health),
            web.get("/ping", self._health),
            web.get("/metrics", self._metrics),
            web.get("/metrics/{tail:.*}", self._metrics_mount),
            web.get("/version", self._version),
        ])

    # ------------------------------------------------------------------ lifecycle

    async def start(self, host: str, port: int) -> None:
        """Start the engine loop and open the port (raises OSError if it is taken)."""
        self.engine_loop.start()
        # handler_cancellation: a client that goes away cancels its handler, which aborts the
        # request in the engine (vLLM does the same on disconnect) or kills the worker parsing it.
        # auto_decompress off: aiohttp would inflate a body on the event loop, and go on inflating
        # a bomb after the answer (its lingering read); the parse workers inflate within a cap.
        self._runner = Runner(self.app, handle_signals=False, handler_cancellation=True,
                              access_log=None, shutdown_timeout=_FLUSH_SECONDS,
                              keepalive_timeout=keepalive_timeout(), auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            await self.engine_loop.stop()
            raise
        # The bound address tells the real port when 0 (any free port) was asked for.
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else port

    async def shutdown(self, timeout: float, force: asyncio.Event | None = None) -> None:
        """Refuse new work, drain for up to `timeout` seconds (or until `force` is set: a second
        signal), abort the rest, close."""
        self.draining = True
        in_flight = len(self.engine_loop.tracked)
        log.info("shutting down", extra={"fields": {"in_flight": in_flight, "shutdown_timeout_s": timeout}})
        drained = not in_flight
        if timeout > 0 and in_flight:
            waiters = [asyncio.create_task(self.engine_loop.wait_empty(timeout))]
            if force is not None:
                waiters.append(asyncio.create_task(force.wait()))
            _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            drained = not self.engine_loop.tracked
        if not drained:
            left = len(self.engine_loop.tracked)
            why = ("second signal" if force is not None and force.is_set()
                   else "shutdown timeout reached" if timeout > 0 else "shutdown timeout is 0")
            log.info("aborting in-flight requests", extra={"fields": {"aborted": left, "reason": why}})
            self.engine_loop.abort_all("shutdown")
        # Let every handler write its last chunk and [DONE] before the sockets close.
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=_FLUSH_SECONDS)
        if self._runner is not None:
            await self._runner.cleanup()
        self.parse_workers.close()
        await self.engine_loop.stop()
        if self.tracer is not None:  # export the spans still queued (up to the exporter's timeout)
            await asyncio.to_thread(self.tracer.shutdown)
        loop = self.engine_loop
        log.info("shutdown complete", extra={"fields": {
            "drained": drained, "engine_steps": loop.steps, "simulated_s": round(loop.simulated_s, 6),
            "behind_s": round(loop.behind_s, 6)}})

    # ------------------------------------------------------------------ middleware

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            # vLLM's check: only the OpenAI routes need the key; /health and /metrics do not.
            key = self.info.api_key
            if key is not None and request.path.startswith("/v1") and \
                    request.headers.get("Authorization") != f"Bearer {key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)
        except proto.OpenAIError as exc:
            log.debug("request rejected", extra={"fields": {
                "path": request.path, "status": exc.status, "param": exc.param, "error": exc.message[:500]}})
            return _json_error(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _json_error(proto.OpenAIError(exc.reason, status=exc.status))
        except web.RequestPayloadError as exc:  # a body that does not decompress, a broken chunk
            cause = exc.__cause__ or exc
            return _json_error(proto.OpenAIError(f"The request body cannot be read: {_one_line(cause)}"))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # never a traceback to the client; the log gets it (as JSON)
            log.exception("unhandled error", extra={"fields": {"path": request.path}})
            return _json_error(proto.OpenAIError(f"Internal error: {type(exc).__name__}", status=500))

    # ------------------------------------------------------------------ simple routes

    async def _health(self, request: web.Request) -> web.Response:
        if self.draining or self.engine_loop.dead is not None:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(proto.models_body(self.info.served_model_names, self.info.model,
                                                   self.info.max_model_len, self.created))

    async def _metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=self.metrics.render())
        resp.headers["Content-Type"] = CONTENT_TYPE
        return resp

    async def _metrics_mount(self, request: web.Request) -> web.Response:
        # vLLM's prometheus_client mount under /metrics/ (make_asgi_app): the format from every
        # Accept header, gzip when an Accept-Encoding header names it.
        body, content_type = self.metrics.exposition(",".join(request.headers.getall("Accept", [])),
                                                     request.query.getall("name[]", []))
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = content_type
        if gzip_accepted(",".join(request.headers.getall("Accept-Encoding", []))):
            resp.enable_compression(web.ContentCoding.gzip)
        return resp

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": vllm.VLLM_VERSION})

    # ------------------------------------------------------------------ generation

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    def _refuse_if_unavailable(self) -> None:
        if self.draining:
            raise proto.OpenAIError("The server is shutting down and accepts no new requests.",
                                    status=503)
        if self.engine_loop.dead is not None:
            raise proto.OpenAIError("The engine is dead; the server must be restarted.", status=503)

    def _parse_args(self, raw: bytes | str, encoding: str, kind: proto.Kind) -> tuple[Any, ...]:
        return (raw, encoding, kind, self.info.served_model_names, self.info.max_model_len, MAX_BODY_BYTES)

    @staticmethod
    def _parsed(result: proto.GenerationRequest | tuple[str, int, str | None]) -> proto.GenerationRequest:
        if isinstance(result, tuple):
            message, status, param = result
            raise proto.OpenAIError(message, status=status, param=param)
        return result

    async def _parse_elsewhere(self, raw: bytes | str, encoding: str, kind: proto.Kind) -> proto.GenerationRequest:
        try:
            result = await self.parse_workers.run(parse_body, *self._parse_args(raw, encoding, kind))
        except WorkerDied:  # killed, out of memory: the next job starts a fresh worker
            raise proto.OpenAIError("The request could not be parsed: a parser process died; retry.",
                                    status=503, retry_after=1) from None
        return self._parsed(result)

    @staticmethod
    async def _read_body(request: web.Request) -> bytes | str:
        """The body as sent (still compressed, if it is), refused with 413 as soon as it passes MAX_BODY_BYTES.

        A small body comes back as bytes; a large one is spooled, chunk by chunk as it arrives, to
        a temporary file (memory-backed where it can be) whose path comes back: the worker that
        parses it reads it from there, so
        this process never joins, pickles or pipes megabytes (each a stretch of holding the GIL).
        Where no temporary file can be written, a large body comes back as bytes too."""
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=request.content_length)
        chunks: list[bytes] = []
        size = 0
        spool: tuple[int, str] | None = None
        can_spool = True
        try:
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=size)
                if spool is None:
                    chunks.append(chunk)
                    if size > INLINE_PARSE_BYTES and can_spool:
                        try:
                            spool = tempfile.mkstemp(prefix="kvpilot-twin-body-", dir=_spool_dir())
                            _write_all(spool[0], b"".join(chunks))
                            chunks.clear()
                        except OSError:  # read-only or full: keep the body in memory instead
                            if spool is not None:
                                os.close(spool[0])
                                with contextlib.suppress(OSError):
                                    os.unlink(spool[1])
                            spool, can_spool = None, False
                else:
                    _write_all(spool[0], chunk)
        except BaseException:
            if spool is not None:
                os.close(spool[0])
                with contextlib.suppress(OSError):
                    os.unlink(spool[1])
            raise
        if spool is None:
            return b"".join(chunks)
        os.close(spool[0])
        return spool[1]

    async def _read_request(self, request: web.Request, kind: proto.Kind) -> proto.GenerationRequest:
        try:
            raw = await asyncio.wait_for(self._read_body(request), BODY_TIMEOUT_S)
        except TimeoutError:
            raise proto.OpenAIError(f"The request body did not arrive within {BODY_TIMEOUT_S:g} s.",
                                    status=408) from None
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")
        if isinstance(raw, bytes) and len(raw) <= INLINE_PARSE_BYTES and encoding.strip().lower() in ("", "identity"):
            return self._parsed(parse_body(*self._parse_args(raw, encoding, kind)))
        # Inflating, decoding and counting megabytes takes CPU-seconds: a worker process does it.
        try:
            return await self._parse_elsewhere(raw, encoding, kind)
        finally:
            if isinstance(raw, str):
                with contextlib.suppress(OSError):
                    os.unlink(raw)

    async def _generate(self, request: web.Request, kind: proto.Kind) -> web.StreamResponse:
        self._refuse_if_unavailable()
        req = await self._read_request(request, kind)
        self._refuse_if_unavailable()  # reading the body awaited; a SIGTERM may have come meanwhile
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        if self.tracer is not None:
            tr = self.engine_loop.submit(req, trace_headers(request.headers))
        else:
            if not self._warned_untraced and "traceparent" in request.headers:
                self._warned_untraced = True  # vLLM's warning, once
                log.warning("Received a request with trace context but tracing is disabled")
            tr = self.engine_loop.submit(req)
        try:
            if req.stream:
                return await self._stream(request, tr)
            return await self._collect(tr)
        finally:
            self._handlers.discard(task)
            if not tr.done:  # cancelled (client gone) or the write failed
                self.engine_loop.abort(tr, "client disconnected")

    async def _collect(self, tr: Tracked) -> web.Response:
        pieces = tokens.output_pieces(tr.req.output_seed)
        parts: list[str] = []
        while True:
            d = await tr.queue.get()
            parts.extend(next(pieces) for _ in range(d.tokens))
            if d.finished:
                break
        if d.finish_reason == "abort":
            raise proto.OpenAIError("The request was aborted: the server is shutting down.", status=503)
        return web.json_response(proto.full_response(tr.req, tr.request_id, self.created, "".join(parts),
                                                     len(parts), d.finish_reason or "length"))

    async def _stream(self, request: web.Request, tr: Tracked) -> web.StreamResponse:
        req = tr.req
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        pieces = tokens.output_pieces(req.output_seed)
        encoder = proto.TokenChunkEncoder(req, tr.request_id, self.created)
        sent = 0
        try:
            while True:
                d = await tr.queue.get()
                out = bytearray()
                for i in range(d.tokens):
                    if req.kind == "chat" and sent == 0:
                        out += proto.sse(proto.stream_chunk(req, tr.request_id, self.created, text=None,
                                                            finish_reason=None, role=True))
                    sent += 1
                    last = d.finished and i == d.tokens - 1
                    reason = d.finish_reason if last else None
                    if req.continuous_usage_stats:
                        out += proto.sse(proto.stream_chunk(
                            req, tr.request_id, self.created, text=next(pieces), finish_reason=reason,
                            usage_so_far=proto.usage(req.prompt_tokens, sent)))
                    else:
                        out += encoder.token(next(pieces), reason)
                if d.finished and d.tokens == 0:  # aborted: close the choice with its reason
                    out += proto.sse(proto.stream_chunk(req, tr.request_id, self.created, text="",
                                                        finish_reason=d.finish_reason))
                if d.finished:
                    if req.include_usage:
                        out += proto.sse(proto.usage_chunk(req, tr.request_id, self.created, sent))
                    out += proto.sse("[DONE]")
                if out:
                    await resp.write(bytes(out))
                if d.finished:
                    break
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away; _generate's finally aborts the request
        return resp


def _install_signal_handlers(stop: asyncio.Event, force: asyncio.Event) -> None:
    """The first SIGTERM/SIGINT starts a graceful shutdown; a second one cuts the drain short."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            log.info("second signal: aborting in-flight requests now")
            force.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)


async def serve(make_engine: Callable[[], tuple[EngineLike, ServingInfo]], *, host: str, port: int,
                startup_delay: float = 0.0, shutdown_timeout: float = 0.0,
                on_ready: Callable[[TwinServer], None] | None = None,
                tracer: RequestTracer | None = None) -> int:
    """Run one server until SIGTERM/SIGINT; the exit code is returned.

    `make_engine` builds the engine (it may raise the engine's start-up error, which the caller
    reports); it runs after the start-up delay, as vLLM loads weights before profiling memory."""
    stop, force = asyncio.Event(), asyncio.Event()
    _install_signal_handlers(stop, force)
    log.info("loading engine", extra={"fields": {"startup_delay_s": startup_delay}})
    if startup_delay > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), startup_delay)
        if stop.is_set():
            log.info("terminated while loading; exiting")
            return 0
    engine, info = make_engine()
    server = TwinServer(engine, info, tracer)
    try:
        await server.start(host, port)
    except OSError as exc:
        log.error("cannot listen", extra={"fields": {"host": host, "port": port, "error": str(exc)}})
        raise
    fields: dict[str, Any] = {"url": f"http://{host}:{server.port}", "model": info.served_model_name,
                              "max_model_len": info.max_model_len}
    if tracer is not None:
        fields["otlp_traces_endpoint"] = tracer.endpoint
    fields.update({k: info.cache_config[k] for k in ("num_gpu_blocks", "block_size") if k in info.cache_config})
    log.info("Starting vLLM API server", extra={"fields": fields})
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    await server.shutdown(shutdown_timeout, force)
    return 0
