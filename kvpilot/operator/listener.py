"""A listening socket served with a cap on open connections and a deadline on TLS handshakes.

`BoundedListener` accepts for an aiohttp low-level server (`web.Server`, which the webhook and the
metrics port both use).  asyncio's own `create_server` accepts without limit, and a connection
that never finishes its handshake, or an idle one, is memory the operator keeps: about 270 KB each
under TLS, so some thousands of them would OOM-kill it (and with `failurePolicy: Ignore`, admit
everything unchecked).  At the cap this listener stops accepting: new connections wait in the
kernel's backlog, as Go's netutil.LimitListener does, until a connection closes (the idle and
header timeouts of `web.Server` close the ones that hold a slot for nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("kvpilot.operator.listener")


class _CountingServer(web.Server):
    """web.Server that tells its listener when a connection ends, to hand its slot back."""

    def __init__(self, handler: Any, on_lost: Callable[[RequestHandler], None], **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._on_lost = on_lost

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._on_lost(handler)


class BoundedListener:
    """Serve `handler` (aiohttp's low-level handler: a request in, a response out) on `sock`, at most
    `max_connections` at once, handshakes included.

    `ssl_context` None serves plain HTTP.  A TLS handshake not done within
    `handshake_timeout_seconds` is dropped; a connection without a whole request head
    `idle_timeout_seconds` after its handshake or its last answer is closed (aiohttp's keep-alive
    timer, which runs until a request's head is complete).  `server_kwargs` go to web.Server."""

    def __init__(self, handler: Any, sock: socket.socket, *, max_connections: int, idle_timeout_seconds: float,
                 ssl_context: ssl.SSLContext | None = None, handshake_timeout_seconds: float = 10.0,
                 **server_kwargs: Any) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1 (got {max_connections})")
        # aiohttp takes a keep-alive timeout of 0 as no timer at all.
        for name, value in (("idle_timeout_seconds", idle_timeout_seconds),
                            ("handshake_timeout_seconds", handshake_timeout_seconds)):
            if not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds (got {value})")
        server_kwargs["keepalive_timeout"] = idle_timeout_seconds
        self.server: web.Server = _CountingServer(handler, self._lost, **server_kwargs)
        self.sock = sock
        self.max_connections = max_connections
        self.ssl_context = ssl_context
        self.handshake_timeout = handshake_timeout_seconds
        self._slots = asyncio.Semaphore(max_connections)
        self._held: set[RequestHandler] = set()  # connections past their handshake, each with a slot
        self._pending: set[asyncio.Task[None]] = set()  # handshakes under way, each with a slot
        self._accepting: asyncio.Task[None] | None = None

    @property
    def open_connections(self) -> int:
        return len(self._held) + len(self._pending)

    def start(self) -> None:
        self.sock.setblocking(False)
        self._accepting = asyncio.create_task(self._accept(), name=f"accept {self.sock.getsockname()}")

    async def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, drop handshakes under way, and shut the open connections down (a request
        being answered gets `timeout` seconds to finish)."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        self.sock.close()
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self.server.shutdown(timeout)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except asyncio.CancelledError:
                self._slots.release()
                raise
            except OSError as exc:  # EMFILE and the like: the cap is above what the process may open
                self._slots.release()
                logger.warning("accept on %s failed: %s", self.sock.getsockname(), exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._connect(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        made: list[RequestHandler] = []

        def factory() -> RequestHandler:
            made.append(self.server())
            return made[0]

        try:
            if self.ssl_context is None:
                await loop.connect_accepted_socket(factory, conn)
            else:
                await loop.connect_accepted_socket(factory, conn, ssl=self.ssl_context,
                                                   ssl_handshake_timeout=self.handshake_timeout)
        except (OSError, ssl.SSLError, asyncio.CancelledError) as exc:
            conn.close()
            self._slots.release()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if made and made[0].transport is not None:
            self._held.add(made[0])
        else:
            self._slots.release()  # it closed before the handshake's waiter woke us

    def _lost(self, handler: RequestHandler) -> None:
        if handler in self._held:
            self._held.discard(handler)
            self._slots.release()
