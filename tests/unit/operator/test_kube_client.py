"""The operator's API client and create-or-patch against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import kopf
import pytest
from aiohttp import web

from kvpilot.api.retry import Backoff
from kvpilot.operator.apply import NotOwned, ensure
from kvpilot.operator.builders import build_deployment
from kvpilot.operator.kube import ApiError, KubeClient
from tests.unit.operator.fixtures import isvc

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def status(code: int, reason: str, message: str = "") -> web.Response:
    return web.json_response({"kind": "Status", "code": code, "reason": reason, "message": message}, status=code)


FAST = Backoff(retries=3, base=0.01, cap=0.01, max_wait=5.0)


async def serve(handler: Handler, body: Callable[[KubeClient, list[tuple[str, str]]], Awaitable[Any]], *,
                backoff: Backoff = FAST, timeout_s: float = 30.0,
                arrivals: list[float] | None = None) -> Any:
    """Run `body` with a client of a real HTTP server on 127.0.0.1 whose answers `handler` gives;
    `arrivals` gets the server's monotonic time of each request."""
    seen: list[tuple[str, str]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append((request.method, request.path_qs))
        if arrivals is not None:
            arrivals.append(time.monotonic())
        return await handler(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = KubeClient(backoff=backoff, field_manager="kvpilot-test", timeout_s=timeout_s, rng=random.Random(7))
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


def test_a_forbidden_answer_is_retried_as_after_an_api_server_restart() -> None:
    """kube-apiserver answers 403 until its RBAC caches have synced after a restart (kopf retries its
    own calls on 403 too); one that lasts reaches the caller once the tries are spent."""
    answers = [status(403, "Forbidden"), web.json_response({"ok": 1})]

    async def handler(request: web.Request) -> web.StreamResponse:
        return answers.pop(0) if answers else status(403, "Forbidden")

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        first = await client.get("/api/v1/namespaces/x/services/y")
        with pytest.raises(ApiError) as info:
            await client.get("/api/v1/namespaces/x/services/z")
        return first, info.value, seen

    first, exc, seen = asyncio.run(serve(handler, body))
    assert first == {"ok": 1}
    assert exc.status == 403 and len(seen) == 2 + 4  # the first call twice; the second 1 try + 3 retries


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


def test_a_retry_after_is_the_least_wait_before_the_retry() -> None:
    """429 with Retry-After: 1 while the client's own backoff is 10 ms: the retry reaches the server
    no sooner than a second after the 429 left it (both times read by the server)."""
    answers = [web.json_response({"kind": "Status", "code": 429, "reason": "TooManyRequests"}, status=429,
                                 headers={"Retry-After": "1"}), web.json_response({"ok": 1})]
    arrivals: list[float] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        return answers.pop(0)

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        return await client.get("/api/v1/namespaces/x/services/y"), len(seen)

    result, calls = asyncio.run(serve(handler, body, arrivals=arrivals))
    assert result == {"ok": 1} and calls == 2
    assert arrivals[1] - arrivals[0] >= 1.0


def test_a_retry_after_longer_than_the_client_waits_is_handed_to_the_caller() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"kind": "Status", "code": 503, "reason": "ServiceUnavailable"}, status=503,
                                 headers={"Retry-After": "120"})

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        with pytest.raises(ApiError) as info:
            await client.get("/api/v1/namespaces/x/services/y")
        return info.value, len(seen)

    exc, calls = asyncio.run(serve(handler, body))
    assert (exc.status, exc.retry_after, calls) == (503, 120.0, 1)  # not slept through inside the call


def test_a_timed_out_and_a_dropped_request_are_retried() -> None:
    answers = ["stall", "drop", "ok"]

    async def handler(request: web.Request) -> web.StreamResponse:
        answer = answers.pop(0)
        if answer == "stall":
            await asyncio.sleep(2)
        if answer == "drop" and request.transport is not None:
            request.transport.close()
        return web.json_response({"ok": 1})

    async def body(client: KubeClient, seen: list[tuple[str, str]]) -> Any:
        return await client.merge_patch("/api/v1/namespaces/x/services/y", {"spec": {}}), len(seen)

    result, calls = asyncio.run(serve(handler, body, timeout_s=0.5))
    assert (result, calls, answers) == ({"ok": 1}, 3, [])


def test_the_backoff_grows_to_its_cap_and_its_jitter_follows_the_seed() -> None:
    policy = Backoff(retries=6, base=0.2, factor=2.0, cap=2.0, jitter=0.25)
    first = [policy.delay(n, random.Random(3)) for n in range(7)]
    assert first == [policy.delay(n, random.Random(3)) for n in range(7)]  # the same seed, the same waits
    assert first[-1] is None  # out of retries
    for n, wait in enumerate(first[:-1]):
        nominal = min(2.0, 0.2 * 2 ** n)
        assert wait is not None and 0.75 * nominal <= wait <= 1.25 * nominal
    assert policy.delay(0, random.Random(3), retry_after=1.5) == 1.5
    assert policy.delay(0, random.Random(3), retry_after=31) is None  # beyond max_wait


def test_a_backoff_out_of_range_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"retries must be >= 0 \(got -1\); jitter must be a fraction"):
        Backoff(retries=-1, jitter=1.5)


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
