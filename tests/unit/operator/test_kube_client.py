"""The operator's API client and create-or-patch against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
import pytest
from aiohttp import web

from kvpilot.operator.apply import NotOwned, ensure
from kvpilot.operator.builders import build_deployment
from kvpilot.operator.kube import ApiError, KubeClient
from tests.unit.operator.fixtures import isvc

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def status(code: int, reason: str, message: str = "") -> web.Response:
    return web.json_response({"kind": "Status", "code": code, "reason": reason, "message": message}, status=code)


async def serve(handler: Handler, body: Callable[[KubeClient, list[tuple[str, str]]], Awaitable[Any]]) -> Any:
    seen: list[tuple[str, str]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append((request.method, request.path_qs))
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = KubeClient(backoff=(0.01, 0.01, 0.01), field_manager="kvpilot-test")
    client.set_credentials(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}", token="t0ken"))
    try:
        return await body(client, seen)
    finally:
        await client.close()
        await runner.cleanup()


def test_transient_errors_are_retried_with_backoff() -> None:
    answers = [status(503, "ServiceUnavailable"), status(409, "Conflict"), web.json_response({"ok": 1})]

    async def handler(request: web.Request) -> web.StreamResponse:
        assert request.headers["Authorization"] == "Bearer t0ken"
        return answers.pop(0)

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        result = await client.merge_patch("/api/v1/namespaces/x/services/y", {"spec": {}})
        return result, seen

    result, seen = asyncio.run(serve(handler, body))
    assert result == {"ok": 1}
    assert seen == [("PATCH", "/api/v1/namespaces/x/services/y?fieldManager=kvpilot-test")] * 3


def test_permanent_errors_raise_at_once_with_the_api_message() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return status(422, "Invalid", "spec.replicas: Invalid value: -1")

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        with pytest.raises(ApiError) as info:
            await client.merge_patch("/apis/apps/v1/namespaces/x/deployments/y", {})
        return info.value, seen

    exc, seen = asyncio.run(serve(handler, body))
    assert (exc.status, exc.reason, exc.retriable) == (422, "Invalid", False)
    assert "spec.replicas" in str(exc)
    assert len(seen) == 1


def test_retries_give_up_after_the_backoff_schedule() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return status(500, "InternalError")

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        with pytest.raises(ApiError) as info:
            await client.get("/api/v1/namespaces/x/services/y")
        return info.value, seen

    exc, seen = asyncio.run(serve(handler, body))
    assert exc.retriable and len(seen) == 4  # 1 try + 3 retries


def _fake_api(store: dict[str, dict[str, Any]]) -> Handler:
    """Just enough of an API server for create-or-patch of one Deployment."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            obj = store.get(request.path)
            return web.json_response(obj) if obj else status(404, "NotFound")
        if request.method == "POST":
            obj = json.loads(await request.text())
            store[f"{request.path}/{obj['metadata']['name']}"] = obj
            return web.json_response(obj, status=201)
        if request.method == "PATCH":
            patch = json.loads(await request.text())
            obj = store[request.path]
            obj["metadata"].update(patch.get("metadata", {}))
            obj["spec"] = patch["spec"]
            return web.json_response(obj)
        return status(405, "MethodNotAllowed")

    return handler


def test_create_then_unchanged_then_patch_on_drift() -> None:
    store: dict[str, dict[str, Any]] = {}
    desired = build_deployment(isvc())
    changed = build_deployment(isvc(engine={"maxNumBatchedTokens": 4096}))

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        first = await ensure(client, desired)
        second = await ensure(client, desired)
        third = await ensure(client, changed)
        return [first.action, second.action, third.action], third.changed, [m for m, _ in seen]

    actions, drifted, methods = asyncio.run(serve(_fake_api(store), body))
    assert actions == ["created", "unchanged", "updated"]
    assert methods == ["GET", "POST", "GET", "GET", "PATCH"]  # the unchanged pass wrote nothing
    assert "spec.template.spec.containers" in {p.split("[")[0] for p in drifted}


def test_a_child_controlled_by_someone_else_is_not_taken_over() -> None:
    desired = build_deployment(isvc())
    squatter = json.loads(json.dumps(desired))
    squatter["metadata"]["ownerReferences"][0]["uid"] = "someone-else"
    path = "/apis/apps/v1/namespaces/serving/deployments/llama"

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        with pytest.raises(NotOwned):
            await ensure(client, desired)
        return [m for m, _ in seen]

    methods = asyncio.run(serve(_fake_api({path: squatter}), body))
    assert methods == ["GET"]
