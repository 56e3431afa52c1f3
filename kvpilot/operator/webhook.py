"""The validating admission webhook's HTTPS server: aiohttp's low-level server on its own port, in the
operator process (the review itself is kvpilot.operator.reviews).

`WebhookServer`, with `server_ssl_context`. Why not kopf's webhook server: docs/architecture.md, "The
admission webhook".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from kvpilot.api.vocabulary import WEBHOOK_PATH
from kvpilot.operator.listener import BoundedListener
from kvpilot.operator.reviews import Answer, Reviewer, bad_review_answer

logger = logging.getLogger("kvpilot.operator.webhook")

# The API server's own request limit is 3 MiB, and an UPDATE's review carries the object twice
# (object and oldObject, each up to etcd's 1.5 MiB): 8 MiB holds any real review.
MAX_REVIEW_BYTES = 8 * 1024 * 1024
_JSON = {"Content-Type": "application/json"}


def server_ssl_context(cert_file: str | os.PathLike[str], key_file: str | os.PathLike[str]) -> ssl.SSLContext:
    """TLS 1.2+ with the serving certificate (and its chain) and key, HTTP/1.1 offered by ALPN."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()  # follows the ..data symlink a Secret volume swaps on renewal
    except OSError:
        return None
    return st.st_mtime_ns, st.st_ino, st.st_size


@dataclass
class WebhookServer:
    """Serve `reviewer` at POST WEBHOOK_PATH over HTTPS on host:port (port 0: a free one).

    The certificate files are read again whenever they change (checked every reload_seconds),
    so a renewed certificate (cert-manager, a Helm upgrade) is served without a restart."""

    reviewer: Reviewer
    cert_file: Path
    key_file: Path
    host: str = "0.0.0.0"
    port: int = 9443
    reload_seconds: float = 60.0
    # The longest the body of one review may take to arrive; the API server's own timeout is
    # the webhook's timeoutSeconds (at most 30 s), so a slower body is never an honest one.
    read_timeout_seconds: float = 10.0
    # A connection without a whole request head this long after its handshake or its last answer
    # is closed: the keep-alive and the header-read timeout in one (aiohttp's default is an hour,
    # which let half-open connections pile up).  The API server reconnects when it needs to.
    idle_timeout_seconds: float = 30.0
    handshake_timeout_seconds: float = 10.0
    # Open connections at once, handshakes included; at the cap new ones wait in the backlog.  Each
    # costs the process up to ~270 KB under TLS: 512 of them stay well inside the operator's 512Mi.
    max_connections: int = 512
    on_result: Callable[[str], None] | None = None
    _listener: BoundedListener | None = field(default=None, init=False, repr=False)
    _reload: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _context: ssl.SSLContext | None = field(default=None, init=False, repr=False)
    _stamps: tuple[object, object] = field(default=(None, None), init=False, repr=False)
    bound_port: int = field(default=0, init=False)

    async def start(self) -> None:
        """Bind and serve; an unreadable certificate or a taken port raises here (OSError, ssl.SSLError)."""
        self._stamps = (_stamp(self.cert_file), _stamp(self.key_file))
        self._context = server_ssl_context(self.cert_file, self.key_file)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, backlog=1024)
        self.bound_port = sock.getsockname()[1]
        # aiohttp's low-level server: one path, one method, no router or middlewares to run per review.
        # auto_decompress off: aiohttp would inflate a compressed body without limit; _read_body
        # inflates it here with the limit on the inflated bytes.
        try:
            self._listener = BoundedListener(
                self._handle, sock, max_connections=self.max_connections, ssl_context=self._context,
                handshake_timeout_seconds=self.handshake_timeout_seconds,
                idle_timeout_seconds=self.idle_timeout_seconds, access_log=None, auto_decompress=False)
        except BaseException:
            sock.close()
            raise
        self._listener.start()
        self._reload = asyncio.create_task(self._watch_certificates(), name="webhook certificate reload")

    async def stop(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reload
            self._reload = None
        if self._listener is not None:
            await self._listener.close(timeout=5.0)
            self._listener = None

    @property
    def open_connections(self) -> int:
        return 0 if self._listener is None else self._listener.open_connections

    def reload_certificates(self) -> bool:
        """Load the certificate files again if they changed; True when the served certificate changed.
        A half-written pair (a renewal in progress) is logged and tried again at the next check."""
        stamps = (_stamp(self.cert_file), _stamp(self.key_file))
        if stamps == self._stamps or self._context is None:
            return False
        try:
            self._context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            logger.warning("webhook certificate %s not reloaded (kept the one served): %s", self.cert_file, exc)
            return False
        self._stamps = stamps
        logger.info("webhook certificate %s reloaded", self.cert_file)
        return True

    async def _watch_certificates(self) -> None:
        while True:
            await asyncio.sleep(self.reload_seconds)
            self.reload_certificates()

    async def _handle(self, request: web.BaseRequest) -> web.Response:
        if request.path != WEBHOOK_PATH:
            answer = bad_review_answer(f"no webhook at {request.path[:200]!r}; AdmissionReviews go to {WEBHOOK_PATH}", 404)
        elif request.method != "POST":
            answer = bad_review_answer(f"AdmissionReviews are POSTed (got {request.method[:20]})", 405)
        else:
            answer = await self._review(request)
        if self.on_result is not None:
            self.on_result(answer.result)
        response = web.Response(status=answer.status, body=answer.body, headers=_JSON)
        if answer.status in (408, 413) or (answer.status != 200 and not request.content.is_eof()):
            response.force_close()  # the rest of that body is never read: the connection cannot go on
        return response

    async def _review(self, request: web.BaseRequest) -> Answer:
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in _WBITS:
            return bad_review_answer(f"Content-Encoding {encoding[:40]!r} is not served; "
                                     f"allowed: {', '.join(sorted(_WBITS))}", 415)
        body = await self._read_body(request)
        if isinstance(body, Answer):
            return body
        if encoding != "identity":
            body = _inflate(body, _WBITS[encoding])
            if isinstance(body, Answer):
                return body
        return self.reviewer.answer(body)

    async def _read_body(self, request: web.BaseRequest) -> bytes | Answer:
        length = request.content_length
        if length is not None and length > MAX_REVIEW_BYTES:
            return bad_review_answer(f"the body is {length} bytes, more than the {MAX_REVIEW_BYTES} allowed", 413)
        if request.content.is_eof():
            # The whole body came with the headers (a review usually does): no wait, no timer.
            body = request.content.read_nowait()
            if len(body) > MAX_REVIEW_BYTES:
                return bad_review_answer(f"the body is more than the {MAX_REVIEW_BYTES} bytes allowed", 413)
            return body
        try:
            async with asyncio.timeout(self.read_timeout_seconds):
                if length is not None:
                    return await request.content.readexactly(length) if length else b""
                parts, size = [], 0  # chunked: read up to the limit
                while chunk := await request.content.readany():
                    size += len(chunk)
                    if size > MAX_REVIEW_BYTES:
                        return bad_review_answer(f"the body is more than the {MAX_REVIEW_BYTES} bytes allowed", 413)
                    parts.append(chunk)
                return b"".join(parts)
        except TimeoutError:
            return bad_review_answer(f"the body did not arrive within {self.read_timeout_seconds:g} s", 408)
        except asyncio.IncompleteReadError:
            return bad_review_answer("the connection closed inside the body", 400)


# Content-Encoding -> zlib's wbits: gzip, and HTTP's "deflate" (zlib-wrapped, or raw as some send it).
_WBITS = {"identity": 0, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_INFLATE_STEP = 1 << 20


def _inflate(data: bytes, wbits: int) -> bytes | Answer:
    """`data` inflated, a step at a time so that the limit applies to the inflated bytes: a small
    body that would inflate past MAX_REVIEW_BYTES is refused after at most the limit's worth of work."""
    if wbits == zlib.MAX_WBITS and not (len(data) > 1 and (data[0] & 0x0F) == 8 and (data[0] << 8 | data[1]) % 31 == 0):
        wbits = -zlib.MAX_WBITS  # raw deflate, without zlib's header
    name = "gzip" if wbits > zlib.MAX_WBITS else "deflate"
    try:
        inflater = zlib.decompressobj(wbits)
        parts, size, pending = [], 0, data
        while not inflater.eof:
            part = inflater.decompress(pending, min(_INFLATE_STEP, MAX_REVIEW_BYTES + 1 - size))
            size += len(part)
            if size > MAX_REVIEW_BYTES:
                return bad_review_answer(
                    f"the body inflates to more than the {MAX_REVIEW_BYTES} bytes allowed", 413)
            parts.append(part)
            pending = inflater.unconsumed_tail
            if not part and not pending:
                break
    except zlib.error as exc:
        return bad_review_answer(f"the body is not valid {name}: {exc}", 400)
    if not inflater.eof:
        return bad_review_answer(f"the {name} body is cut short", 400)
    if inflater.unused_data:
        return bad_review_answer(f"the body has bytes after its {name} stream", 400)
    return b"".join(parts)
