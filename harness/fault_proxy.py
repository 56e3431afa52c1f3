"""A TLS reverse proxy in front of kube-apiserver that answers 429 and 5xx in bursts, on a seed.

A client is pointed at it (its kubeconfig's `server`), with the same CA and token it would give the
API server: everything passes through unchanged (watches streamed chunk by chunk) until `burst()`,
after which, for the burst's length, each new request is refused with one of 429 (with Retry-After),
500, 502, 503 or 504 and a Kubernetes Status body, drawn from `random.Random(seed)`. While the API
server itself is down, requests get 502 as from a load balancer. Requests already passing (an open
watch) are left alone: a burst is what a flaky front end does to new calls.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from harness.kmock_api import free_port

FAULT_STATUSES = (429, 500, 502, 503, 504)
# Hop-by-hop headers, and those the proxy's own framing replaces (a response is re-chunked).
_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
                   "proxy-connection", "te", "trailer"})


def _status(code: int, message: str) -> web.Response:
    reason = {429: "TooManyRequests", 500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable",
              504: "Timeout"}.get(code, "InternalError")
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
    headers = {"Retry-After": "1"} if code == 429 else {}
    return web.json_response(body, status=code, headers=headers)


class FaultProxy:
    def __init__(self, upstream: str, upstream_ca: Path, cert: Path, key: Path, *, seed: int) -> None:
        self.upstream = upstream.rstrip("/")
        self._upstream_ssl = ssl.create_default_context(cafile=str(upstream_ca))
        self._serving_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._serving_ssl.load_cert_chain(str(cert), str(key))
        self._rng = random.Random(seed)
        self._burst_until = 0.0
        self._burst_fraction = 0.0
        self.injected: Counter[int] = Counter()
        self.forwarded = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(30)
        return self

    async def _serve(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=5))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._serving_ssl).start()

    def stop(self) -> None:
        async def close() -> None:
            # The upstream streams first: a watch left open would hold the server's shutdown.
            if self._session is not None:
                await self._session.close()
            if self._runner is not None:
                await self._runner.cleanup()
            # Handlers of connections the clients left open (kept alive, idle) end here, not at exit.
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def burst(self, seconds: float, fraction: float) -> None:
        """For the next `seconds`, refuse each new request with probability `fraction`."""
        self._burst_fraction = fraction
        self._burst_until = time.monotonic() + seconds

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if time.monotonic() < self._burst_until and self._rng.random() < self._burst_fraction:
            code = self._rng.choice(FAULT_STATUSES)
            self.injected[code] += 1
            return _status(code, f"injected by the chaos proxy ({code})")
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        body = await request.read()
        try:
            upstream = await self._session.request(request.method, self.upstream + request.path_qs,
                                                   headers=headers, data=body or None, ssl=self._upstream_ssl,
                                                   allow_redirects=False)
        except (aiohttp.ClientError, OSError) as exc:
            return _status(502, f"the API server cannot be reached: {exc}")
        self.forwarded += 1
        response = web.StreamResponse(status=upstream.status, headers={
            k: v for k, v in upstream.headers.items() if k.lower() not in _DROP})
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
        except (aiohttp.ClientError, ConnectionError, asyncio.CancelledError) as exc:
            # The API server went away mid-stream (a watch, at a restart), or the client did: the
            # client sees its stream end, as it would without the proxy.
            if isinstance(exc, asyncio.CancelledError):
                raise
            return response
        finally:
            upstream.release()
        return response

    def stats(self) -> dict[str, Any]:
        return {"forwarded": self.forwarded, "injected": dict(sorted(self.injected.items()))}
