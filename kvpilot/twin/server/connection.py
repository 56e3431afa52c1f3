"""The twin server's HTTP connections: what happens before a request reaches a route.

aiohttp's defaults suit a trusted client; these adjust them for any client:

* Malformed HTTP (a garbage request line, a bad header, a body that does not decompress) is
  answered with an OpenAI-style JSON error, like every other client error, and logged as one JSON
  line without a traceback (it is the client's fault, not the server's).
* A client that half-closes its side after sending a request (`shutdown(SHUT_WR)`, as some HTTP/1.0
  tools and `nc -N` do) still gets its answer; the connection closes after it.
* Idle keep-alive connections, and connections that send their request head too slowly, are closed
  after `keepalive_timeout()` seconds (vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s by default; aiohttp
  also runs this timer from the moment a connection opens, so a slow request head hits it too).

aiohttp has no public hook for the first two, so a RequestHandler subclass provides them; the
integration tests hold them to what a client sees on the wire.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from kvpilot.twin.server import protocol as proto
from kvpilot.twin.server.jsonlog import LOGGER_NAME

log = logging.getLogger(LOGGER_NAME)

DEFAULT_KEEPALIVE_S = 5.0  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default (uvicorn's timeout_keep_alive)

# Errors that a client causes; they are logged without a traceback.
_CLIENT_ERRORS = (HttpProcessingError, web.RequestPayloadError, ConnectionError, asyncio.TimeoutError)


def keepalive_timeout() -> float:
    """Seconds an idle connection (or one still sending its request head) stays open."""
    text = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "")
    try:
        value = float(text) if text else DEFAULT_KEEPALIVE_S
    except ValueError:
        return DEFAULT_KEEPALIVE_S
    return value if value > 0 else DEFAULT_KEEPALIVE_S


def _brief(value: Any, limit: int = 200) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Handler(RequestHandler):
    _last_payload: Any = None  # the body reader of the latest request parsed on this connection

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._messages:
            self._last_payload = self._messages[-1][1]

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio's contract: True keeps it open
        waiter = self._waiter
        idle = waiter is not None and not waiter.done() and not self._messages
        if idle:
            return None  # nothing asked (or half a request head): let the transport close
        # A request is queued or running: keep the socket open to write its answer, then close.
        # A body still missing bytes will never get them: its reader fails now (a 400), rather
        # than wait for the body timeout.
        incomplete = web.RequestPayloadError("the client closed its side before sending the whole body")
        payload = self._last_payload
        if payload is not None and not payload.is_eof():
            payload.set_exception(incomplete)
        self.close()
        return True

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        what = message or (str(exc) if exc is not None else "")
        if status >= 500:
            log.error("error handling request", extra={"fields": {"status": status, "error": _brief(what)}})
            text = "Internal server error."
        else:
            log.info("bad HTTP request", extra={"fields": {"status": status, "error": _brief(what)}})
            text = f"Invalid HTTP request: {_brief(what)}"
        if request.writer.output_size > 0:
            raise ConnectionError("the response had started; the connection is closed instead")
        resp = web.json_response(proto.OpenAIError(text, status=status).body(), status=status)
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        try:
            message = str(args[0]) % args[1:] if len(args) > 1 else str(args[0] if args else "error")
        except (TypeError, ValueError):
            message = str(args[0])
        if isinstance(exc, _CLIENT_ERRORS):
            log.debug(_brief(message), extra={"fields": {"error": _brief(exc)}})
            return
        log.error(_brief(message), exc_info=exc if isinstance(exc, BaseException) else True)


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """web.AppRunner whose connections are `_Handler`s."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # same object, one method more: aiohttp builds it privately
        return server
