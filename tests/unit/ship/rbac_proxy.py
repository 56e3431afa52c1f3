"""An RBAC-enforcing proxy in front of a test Kubernetes API (KMock has no authorization).

Every request is mapped to the (namespace, apiGroup, resource, verb) the API server's
authorizer would check; requests the given grants do not allow get the API server's own
answer, 403 Forbidden with a Status body, and everything else is forwarded (watch streams
included). So a real operator run through it proves the chart's RBAC is enough, rather than
comparing lists: kopf's graceful fallbacks on 403 are exercised too.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Permission = tuple[str, str, str]
Grants = dict[str | None, set[Permission]]  # namespace (None: cluster-wide) -> permissions


@dataclass
class RbacProxy:
    upstream: str
    grants: Grants
    permission_of: Callable[[str, str], tuple[str | None, Permission] | None]
    # KMock stores no Namespace objects and cannot watch them (toolchain notes, quirk 2): the
    # proxy answers namespace reads itself, from this list, once RBAC has allowed them.
    namespaces: tuple[str, ...] = ()
    denied: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: Any = None

    def allows(self, namespace: str | None, permission: Permission) -> bool:
        if permission in self.grants.get(None, set()):
            return True
        return namespace is not None and permission in self.grants.get(namespace, set())

    async def _handle(self, request: Any) -> Any:
        import aiohttp
        from aiohttp import web

        target = self.permission_of(request.method, request.path_qs)
        if target is not None and not self.allows(*target):
            namespace, (group, resource, verb) = target
            self.denied.append((request.method, request.path_qs))
            where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
            return web.json_response(
                status=403,
                data={
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Failure",
                    "reason": "Forbidden",
                    "code": 403,
                    "details": {"group": group, "kind": resource},
                    "message": f'{resource}{"." + group if group else ""} is forbidden: User "test" cannot {verb} '
                    f'resource "{resource}" in API group "{group}"{where}',
                },
            )
        if request.path.rstrip("/") == "/api/v1/namespaces" and request.method == "GET":
            return await self._namespaces(request)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.request(
                request.method, self.upstream + request.path_qs, data=body or None, headers=headers
            ) as upstream,
        ):
            response = web.StreamResponse(status=upstream.status)
            if "Content-Type" in upstream.headers:
                response.content_type = upstream.headers["Content-Type"].split(";")[0]
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except (ConnectionResetError, aiohttp.ClientError, asyncio.CancelledError):
                pass  # the client (a watch) went away, or the test is stopping
            return response

    async def _namespaces(self, request: Any) -> Any:
        from aiohttp import web

        items = [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": n, "resourceVersion": "1"},
                "status": {"phase": "Active"},
            }
            for n in self.namespaces
        ]
        if request.query.get("watch") not in ("true", "1"):
            return web.json_response(
                {
                    "apiVersion": "v1",
                    "kind": "NamespaceList",
                    "metadata": {"resourceVersion": "1"},
                    "items": items,
                }
            )
        # A watch: nothing changes; hold the stream open until the client or the proxy stops.
        response = web.StreamResponse(status=200)
        response.content_type = "application/json"
        await response.prepare(request)
        await asyncio.Event().wait()  # cancelled when the client or the proxy goes away
        return response

    def start(self) -> RbacProxy:
        from aiohttp import web

        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            # Watch streams never end by themselves: cut them 1 s into a shutdown.
            self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="rbac-proxy", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the RBAC proxy did not start")
        return self

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    def stop(self) -> None:
        if self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(15)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(15)

    def __enter__(self) -> RbacProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig that reaches the API through this proxy (the shape KMockAPI writes)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "proxy",
            "clusters": [{"name": "proxy", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "rbac-proxy-token"}}],
            "contexts": [
                {"name": "proxy", "context": {"cluster": "proxy", "user": "test", "namespace": namespace}}
            ],
        }
        path.write_text(yaml.safe_dump(config))
        return path
