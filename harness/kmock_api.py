"""A Kubernetes API for tests: KMock with its 0.8 quirks fixed, on a free port, with a kubeconfig.

KMock (kopf's own API emulator) serves a Kubernetes-like API from memory.  Version 0.8 stores
bodies exactly as sent and so misses what an API server adds; `KvpilotEmulator` fills that in
(each found by running kopf and kubectl against it):

1. objects get `uid`, `resourceVersion`, `creationTimestamp` and `generation` on create;
   every write bumps `resourceVersion`; a change to anything but metadata/status bumps
   `generation` (kopf and the operator key on it);
2. `GET /api/v1/namespaces[/NAME]` is answered (KMock's path parser cannot take it);
3. `/api/v1` discovery says `groupVersion: v1` (not `/v1`);
4. list responses carry `kind` and `apiVersion`;
5. `metadata.generateName` works on create.

InferenceServices have the `scale` subresource as the CRD declares it: GET and PATCH
`.../inferenceservices/NAME/scale` read and write an autoscaling/v1 Scale (spec.replicas; status.replicas
and status.selector from the object's status), and a write records its `fieldManager` as the owner of
spec.replicas in `metadata.managedFields` with `subresource: scale`, as the API server does.

Besides, for resources with a `status` subresource, a write to the main resource ignores
`status` and a write to `/status` changes only `status`, as a real API server does.

A write whose body carries `metadata.resourceVersion` is refused with 409 Conflict when the object
has moved on, as a real API server does (optimistic concurrency).

KMock does not serve `pods/NAME/log`: a test puts a container's log in `pod_logs` (keyed by
namespace, pod, container, and whether it is the previous instance's) and it is served as the API
server does (text/plain; `tailLines`, `limitBytes`; 400 for a container or instance it has no log of).

Every request is recorded as (method, path) in `calls`, so a test can compare what the operator
really calls with the RBAC it declares.  `KMockAPI.fail(method, path, Fault(...), ...)` answers the
next matching requests with API faults instead (a Status error with an optional `Retry-After`, a
dropped connection, an answer that never comes), before KMock sees them: KMock's own reactions
(`emulator[...] << 503`) only change the answer, after the emulator has already applied a write,
where a real API server that answers 429 or 503 has changed nothing.  `KMockAPI.after(method, path, action)` runs a test's
action right after KMock has served a matching request and before the client gets the answer,
so a test can act deterministically inside the window between two of the operator's calls.

`KMockAPI` runs the emulator in a background thread with its own event loop, so tests, a
subprocess operator and synchronous helpers can all reach it; `kopf_operator()` runs a real
`kvpilot operator` process (kopf in standalone mode) against it and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest.mock
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import attrs
import kmock
import yaml

ISVC_GROUP, ISVC_VERSION, ISVC_PLURAL = "kvpilot.dev", "v1alpha1", "inferenceservices"
ISVC_PATH = f"/apis/{ISVC_GROUP}/{ISVC_VERSION}"

_NAMESPACES_PATH = re.compile(r"^/api/v1/namespaces/?(?P<name>[^/]+)?/?$")
_POD_LOG_PATH = re.compile(r"^/api/v1/namespaces/(?P<namespace>[^/]+)/pods/(?P<name>[^/]+)/log$")


def _merge_patch(value: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (what the emulator applies), used to foresee a write's result."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(value) if isinstance(value, Mapping) else {}
    for key, item in patch.items():
        if item is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), item)
    return result


@attrs.frozen
class ResourceVersionConflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = "the object has been modified; please apply your changes to the latest version and try again"


@dataclass(frozen=True)
class Fault:
    """One faulty answer: `status` (a Status error; 0 drops the connection) after `stall` seconds,
    with a `Retry-After: retry_after` header when given.  A stall longer than the client's timeout
    is a request that times out."""

    status: int = 503
    retry_after: int | None = None
    stall: float = 0.0

    REASONS = {409: "Conflict", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
               502: "BadGateway", 503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class FaultRule:
    """Serve `faults` in turn to the requests with this method whose path matches `path`; each
    served fault is recorded as the monotonic time its request arrived, with its status (a fault
    without a stall is answered at once)."""

    method: str
    path: re.Pattern[str]
    faults: list[Fault]
    served: list[tuple[float, int]] = field(default_factory=list)
    agent: str | None = None  # only requests whose User-Agent contains it (the tuner's, not the operator's)

    def matches(self, raw_request: Any) -> bool:
        return (bool(self.faults) and self.method == raw_request.method and bool(self.path.search(raw_request.path))
                and (self.agent is None or self.agent in raw_request.headers.get("User-Agent", "")))

    @property
    def exhausted(self) -> bool:
        return not self.faults


@dataclass
class Hook:
    """Run `action` (in a thread: it may call KMock through the synchronous helpers) once, after
    KMock has served the first request with this method whose path matches `path`."""

    method: str
    path: re.Pattern[str]
    action: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@attrs.define(kw_only=True)
class KvpilotEmulator(kmock.KubernetesEmulator):
    """KMock's emulator with the API-server bookkeeping it lacks (see the module docstring)."""

    calls: list[tuple[str, str]] = attrs.field(factory=list)
    # Every request as (monotonic time it arrived, method, path), faulted ones included.
    timed_requests: list[tuple[float, str, str]] = attrs.field(factory=list)
    # Resource requests with the monotonic time each arrived, as (time, method, path, object name);
    # the name comes from the body for a create.  Benchmarks read create -> first status from it.
    timed_calls: list[tuple[float, str, str, str | None]] = attrs.field(factory=list)
    # Requests being dispatched right now; see __iter__.
    _dispatching: list[Any] = attrs.field(factory=list)
    _namespaces: set[str] = attrs.field(factory=lambda: {"default"})
    _namespace_watchers: list[asyncio.Queue[dict[str, Any]]] = attrs.field(factory=list)
    _rv: int = attrs.field(default=0)
    hooks: list[Hook] = attrs.field(factory=list)
    fault_rules: list[FaultRule] = attrs.field(factory=list)
    # (namespace, pod, container, previous) -> the log text (see the module docstring).
    pod_logs: dict[tuple[str, str, str, bool], str] = attrs.field(factory=dict)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _has_status_subresource(self, resource: Any) -> bool:
        try:
            return "status" in self.resources[resource].subresources
        except KeyError:
            return False

    async def __call__(self, raw_request: Any) -> Any:
        self.calls.append((raw_request.method, raw_request.path))
        self.timed_requests.append((time.monotonic(), raw_request.method, raw_request.path))
        for rule in self.fault_rules:
            if rule.matches(raw_request):
                return await self._serve_fault(raw_request, rule, rule.faults.pop(0))
        # Quirk 2: namespaces are cluster-scoped; KMock's path parser reads /namespaces/NAME as a
        # namespaced prefix and fails.  Namespaces are not stored: every namespace an object was
        # created in exists, and "default".  kopf lists and watches them for --namespace patterns.
        match = _NAMESPACES_PATH.match(raw_request.path)
        if match and raw_request.method == "GET":
            return await self._serve_namespaces(raw_request, match.group("name"))
        match = _POD_LOG_PATH.match(raw_request.path)
        if match and raw_request.method == "GET":
            return self._serve_pod_log(raw_request, match.group("namespace"), match.group("name"))
        response = await super().__call__(raw_request)
        for hook in list(self.hooks):
            if hook.method == raw_request.method and hook.path.search(raw_request.path):
                self.hooks.remove(hook)
                try:
                    await asyncio.to_thread(hook.action)
                except Exception as exc:  # surfaced to the test by KMockAPI.after
                    hook.error = exc
                finally:
                    hook.done.set()
        return response

    async def _serve_fault(self, raw_request: Any, rule: FaultRule, fault: Fault) -> Any:
        import aiohttp.web

        await raw_request.read()
        rule.served.append((time.monotonic(), fault.status))
        if fault.stall:
            await asyncio.sleep(fault.stall)  # cancelled where the client gives up first
        if fault.status == 0:
            # The connection is dropped without an answer (a reset, a proxy that gave up).
            if raw_request.transport is not None:
                raw_request.transport.close()
            return aiohttp.web.Response(status=500)  # never sent: the connection is gone
        headers = {} if fault.retry_after is None else {"Retry-After": str(fault.retry_after)}
        reason = Fault.REASONS.get(fault.status, "InternalError")
        return aiohttp.web.json_response(
            {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": fault.status,
             "reason": reason, "message": f"injected by the test: {fault.status} {reason}",
             "details": {} if fault.retry_after is None else {"retryAfterSeconds": fault.retry_after}},
            status=fault.status, headers=headers)

    def __iter__(self) -> Any:
        # KMock dispatches a request by asking every reaction whether the request is "in" its view,
        # and a view iterates over every request ever received: quadratic, seconds per request after
        # a few thousand.  The dispatch check only needs the requests in flight, so that is all the
        # root view yields (`calls` keeps the history the tests read).
        yield from list(self._dispatching)

    @staticmethod
    def _namespace(name: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "uid": f"ns-{name}",
                "resourceVersion": "1"}, "status": {"phase": "Active"}}

    def _note_namespace(self, name: str | None) -> None:
        if name and name not in self._namespaces:
            self._namespaces.add(name)
            for queue in self._namespace_watchers:
                queue.put_nowait({"type": "ADDED", "object": self._namespace(name)})

    async def _serve_namespaces(self, raw_request: Any, name: str | None) -> Any:
        import aiohttp.web

        if name:
            if name not in self._namespaces:
                return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                                  "code": 404, "reason": "NotFound"}, status=404)
            return aiohttp.web.json_response(self._namespace(name))
        if raw_request.query.get("watch") != "true":
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "NamespaceList", "metadata": {"resourceVersion": str(self._rv)},
                "items": [self._namespace(n) for n in sorted(self._namespaces)]})
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw_request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        for known in sorted(self._namespaces):
            queue.put_nowait({"type": "ADDED", "object": self._namespace(known)})
        self._namespace_watchers.append(queue)
        try:
            while True:
                await response.write(json.dumps(await queue.get()).encode() + b"\n")
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._namespace_watchers.remove(queue)
        return response

    def _serve_pod_log(self, raw_request: Any, namespace: str, name: str) -> Any:
        import aiohttp.web

        container = raw_request.query.get("container", "")
        previous = raw_request.query.get("previous") == "true"
        log = self.pod_logs.get((namespace, name, container, previous))
        if log is None:
            which = "previous terminated container" if previous else "container"
            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "status": "Failure", "code": 400, "reason": "BadRequest",
                "message": f'{which} "{container}" in pod "{name}" not found'}, status=400)
        if "tailLines" in raw_request.query:
            log = "".join(log.splitlines(keepends=True)[-int(raw_request.query["tailLines"]):])
        data = log.encode()
        if "limitBytes" in raw_request.query:
            data = data[:int(raw_request.query["limitBytes"])]
        return aiohttp.web.Response(body=data, content_type="text/plain")

    async def _handle(self, request: Any) -> Any:
        self._dispatching.append(request)
        if len(self._requests) > 256:  # the history nobody reads any more (see __iter__)
            del self._requests[:-64]
            for payload in self._payloads:
                del payload._requests[:-64]
        try:
            return await self._handle_tracked(request)
        finally:
            self._dispatching.remove(request)

    async def _handle_tracked(self, request: Any) -> Any:
        if request.resource is not None:
            name = request.name
            if name is None and isinstance(request.data, dict):
                name = (request.data.get("metadata") or {}).get("name")
            self.timed_calls.append((time.monotonic(), str(request.method.value).upper(), request.url.path, name))
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._fill_on_create(request)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                self._fill_on_update(request)
        return await super()._handle(request)

    def _fill_on_create(self, request: Any) -> None:
        data = request.data
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):  # quirk 5
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        self._note_namespace(meta.get("namespace"))
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta["resourceVersion"] = self._next_rv()
        meta["generation"] = 1
        if request.subresource is None and self._has_status_subresource(request.resource):
            data.pop("status", None)

    def _fill_on_update(self, request: Any) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # the emulator answers 404 itself
        data = request.data
        expected = (data.get("metadata") or {}).get("resourceVersion")
        current = (self.objects[key].raw.get("metadata") or {}).get("resourceVersion")
        if expected is not None and str(expected) != str(current):
            raise ResourceVersionConflict()
        if request.subresource == "scale":
            self._scale_to_update(request, self.objects[key].raw)
        elif self._has_status_subresource(request.resource):
            if request.subresource == "status":
                for k in list(data):
                    if k != "status":
                        del data[k]
            elif request.subresource is None:
                data.pop("status", None)
        old = self.objects[key].raw
        new = _merge_patch(old, data)
        meta = data.setdefault("metadata", {})
        # The server owns these; a client's stale copy must not overwrite them.
        for owned in ("uid", "creationTimestamp", "generation"):
            meta.pop(owned, None)
        meta["resourceVersion"] = self._next_rv()
        strip = ("metadata", "status")
        if {k: v for k, v in old.items() if k not in strip} != {k: v for k, v in new.items() if k not in strip}:
            meta["generation"] = int(old.get("metadata", {}).get("generation", 1)) + 1

    def _scale_to_update(self, request: Any, old: dict[str, Any]) -> None:
        """A write to `/scale` (an autoscaling/v1 Scale) as the API server applies it: only
        spec.replicas of the object changes, and `metadata.managedFields` records the writer's
        field manager with `subresource: scale` as the owner of spec.replicas (taken from whoever held
        it), which the operator's Scaled Event names."""
        replicas = ((request.data or {}).get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message=f"spec.replicas: Invalid value: {replicas!r}: must be an integer >= 0")
        manager = request.params.get("fieldManager", "unknown")
        fields = []
        for entry in (old.get("metadata") or {}).get("managedFields") or []:
            entry = copy.deepcopy(entry)
            spec = (entry.get("fieldsV1") or {}).get("f:spec") or {}
            spec.pop("f:replicas", None)
            if entry.get("manager") != manager or entry.get("subresource") != "scale":
                if not spec and (entry.get("fieldsV1") or {}).get("f:spec") is not None:
                    entry["fieldsV1"].pop("f:spec")
                if entry.get("fieldsV1"):
                    fields.append(entry)
        fields.append({"manager": manager, "operation": "Update", "apiVersion": "autoscaling/v1", "time": _now(),
                       "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {"f:replicas": {}}}, "subresource": "scale"})
        request.data.clear()
        request.data.update({"spec": {"replicas": replicas}, "metadata": {"managedFields": fields}})

    @staticmethod
    def _scale_of(obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 1)},
                "status": {"replicas": status.get("replicas", 0), "selector": status.get("selector", "")}}

    # KMock finds an object by scanning every stored object (events included) on each request;
    # at a thousand InferenceServices that is most of the server's time.  Look it up by key instead.
    def _stored(self, request: Any, namespace: str | None = None, name: str | None = None) -> Any:
        key = (request.resource, namespace if namespace is not None else request.namespace, name or request.name)
        obj = self.objects._objects.get(key)
        if obj is None or obj.empty:
            raise kmock.KubernetesObjectNotFoundError()
        return obj

    async def _serve_fetch(self, request: Any) -> Any:
        obj = self._stored(request)
        if obj.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return self._scale_of(obj.raw) if request.subresource == "scale" else obj.raw

    async def _serve_create(self, request: Any) -> Any:
        meta = request.data.get("metadata", {}) if isinstance(request.data, dict) else {}
        return self._stored(request, request.namespace or meta.get("namespace"), meta.get("name")).raw

    async def _serve_update(self, request: Any) -> Any:
        raw = self._stored(request).last.raw
        return self._scale_of(raw) if request.subresource == "scale" else raw

    async def _serve_delete(self, request: Any) -> Any:
        return self._stored(request).last.raw

    async def _render_error(self, exc: Exception) -> Any:
        # A 404 is routine (get-before-create); KMock formats a traceback into every error body.
        if isinstance(exc, kmock.KubernetesError) and exc.status < 500:
            import aiohttp.web

            return aiohttp.web.json_response({
                "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": exc.status,
                "reason": exc.reason or type(exc).__name__, "message": exc.message or repr(exc),
                "details": exc.details or {}}, status=exc.status)
        return await super()._render_error(exc)

    async def _serve_version(self, request: Any) -> Any:
        result = await super()._serve_version(request)
        if isinstance(result, dict) and result.get("groupVersion", "").startswith("/"):
            result["groupVersion"] = result["groupVersion"].lstrip("/")  # quirk 3
        return result

    async def _serve_list(self, request: Any) -> Any:
        result = await super()._serve_list(request)
        resource = request.resource
        try:
            kind = self.resources[resource].kind or resource.plural.capitalize()
        except KeyError:
            kind = resource.plural.capitalize()
        api_version = resource.version if not resource.group else f"{resource.group}/{resource.version}"
        result["kind"] = f"{kind}List"  # quirk 4
        result["apiVersion"] = api_version
        result["metadata"] = {"resourceVersion": str(self._rv)}
        items = []
        for item in result["items"]:
            item = dict(item)
            item.setdefault("kind", kind)
            item.setdefault("apiVersion", api_version)
            items.append(item)
        result["items"] = items
        return result


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def register_resources(emulator: kmock.KubernetesEmulator, *, monitoring_crds: bool = False) -> None:
    """Built-in group-versions, the InferenceService CRD, and optionally the Prometheus Operator's."""
    emulator.resources.load_bundled()
    emulator.resources[f"{ISVC_GROUP}/{ISVC_VERSION}/{ISVC_PLURAL}"] = kmock.ResourceInfo(
        kind="InferenceService", singular="inferenceservice", namespaced=True, shortnames={"kvis"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )
    if monitoring_crds:
        verbs = {"get", "list", "watch", "create", "update", "patch", "delete"}
        emulator.resources["monitoring.coreos.com/v1/servicemonitors"] = kmock.ResourceInfo(
            kind="ServiceMonitor", singular="servicemonitor", namespaced=True, verbs=verbs)
        emulator.resources["monitoring.coreos.com/v1/podmonitors"] = kmock.ResourceInfo(
            kind="PodMonitor", singular="podmonitor", namespaced=True, verbs=verbs)
        emulator.resources["monitoring.coreos.com/v1/prometheusrules"] = kmock.ResourceInfo(
            kind="PrometheusRule", singular="prometheusrule", namespaced=True, verbs=verbs)


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass
class KMockAPI:
    """A running emulator on 127.0.0.1:<free port>, served from a background thread."""

    monitoring_crds: bool = False
    emulator: KvpilotEmulator = field(init=False)
    port: int = field(init=False, default=0)
    _loop: asyncio.AbstractEventLoop = field(init=False)
    _thread: threading.Thread = field(init=False)
    _stop: asyncio.Event | None = field(init=False, default=None)

    def start(self) -> KMockAPI:
        started = threading.Event()
        failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()

        async def serve() -> None:
            self._stop = asyncio.Event()
            try:
                self.emulator = KvpilotEmulator()
                register_resources(self.emulator, monitoring_crds=self.monitoring_crds)
                async with self.emulator, kmock.Server(self.emulator, port=free_port()) as server:
                    self.port = server.port
                    started.set()
                    await self._stop.wait()
            except BaseException as exc:  # surfaced in start()
                failure.append(exc)
                started.set()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(serve())

        self._thread = threading.Thread(target=run, name="kmock", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("KMock did not start within 30 s")
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self._loop.close()

    def __enter__(self) -> KMockAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def calls(self) -> list[tuple[str, str]]:
        return list(self.emulator.calls)

    def after(self, method: str, path: str, action: Callable[[], Any]) -> Hook:
        """Run `action` once, right after KMock served the next `method` request whose path
        matches the regular expression `path`, before that request's client gets the answer."""
        hook = Hook(method, re.compile(path), action)
        self.emulator.hooks.append(hook)
        return hook

    def fail(self, method: str, path: str, *faults: Fault, agent: str | None = None) -> FaultRule:
        """Answer the next len(faults) `method` requests whose path matches the regular expression
        `path` (and, given `agent`, whose User-Agent contains it) with these faults, in order, without
        KMock processing them; later ones are served."""
        rule = FaultRule(method, re.compile(path), list(faults), agent=agent)
        self.emulator.fault_rules.append(rule)  # a list append is atomic; KMock reads it per request
        return rule

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "kmock-test-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock",
                                                       "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    # Synchronous HTTP helpers for tests (a real client over the real port).
    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/merge-patch+json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type if method == "PATCH" else "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode()) from None
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def get_or_none(self, path: str) -> Any:
        try:
            return self.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, body)

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)

    # InferenceService shortcuts.
    @staticmethod
    def isvc_path(namespace: str, name: str | None = None) -> str:
        base = f"{ISVC_PATH}/namespaces/{namespace}/{ISVC_PLURAL}"
        return f"{base}/{name}" if name else base

    def create_isvc(self, obj: Mapping[str, Any]) -> Any:
        return self.create(self.isvc_path(obj["metadata"]["namespace"]), dict(obj))

    def get_isvc(self, namespace: str, name: str) -> Any:
        return self.get(self.isvc_path(namespace, name))

    def events(self, namespace: str) -> list[dict[str, Any]]:
        return list(self.get(f"/api/v1/namespaces/{namespace}/events").get("items", []))

    def create_engine_pod(self, deployment: Mapping[str, Any], name: str, container_status: Mapping[str, Any],
                          *, log: str | None = None, previous_log: str | None = None) -> Any:
        """Play the ReplicaSet controller and the kubelet: a pod of the Deployment's current template
        (its labels and config-hash annotation) whose engine container has this status; `log` and
        `previous_log` are what `kubectl logs [--previous]` would show of it."""
        namespace = deployment["metadata"]["namespace"]
        template = deployment["spec"]["template"]
        container = template["spec"]["containers"][0]["name"]
        pods = f"/api/v1/namespaces/{namespace}/pods"
        self.create(pods, {"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": name, "namespace": namespace,
                                        "labels": dict(template["metadata"]["labels"]),
                                        "annotations": dict(template["metadata"]["annotations"])},
                           "spec": template["spec"]})
        for previous, text in ((False, log), (True, previous_log)):
            if text is not None:
                self.emulator.pod_logs[(namespace, name, container, previous)] = text
        return self.set_engine_status(namespace, name, {"name": container, **container_status})

    def set_engine_status(self, namespace: str, name: str, container_status: Mapping[str, Any]) -> Any:
        """Play the kubelet: the engine container's status (a pod has one container)."""
        return self.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status",
                          {"status": {"phase": "Running", "containerStatuses": [dict(container_status)]}})


def tuner_client(api: KMockAPI, workdir: Path, namespace: str) -> Any:
    """The tuner's own API client (kvpilot.tuner.kubeapi.KubeAPI), configured from a kubeconfig for KMock
    as the tuner process configures itself from $KUBECONFIG."""
    from kvpilot.tuner.kubeapi import KubeAPI

    path = api.write_kubeconfig(workdir / "kubeconfig", namespace=namespace)
    with unittest.mock.patch.dict(os.environ, {"KUBECONFIG": str(path)}):
        return KubeAPI.from_environment()


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05,
             what: str = "condition",
             errors: tuple[type[Exception], ...] = (ApiError, KeyError, IndexError, TypeError)) -> Any:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout` s.
    `errors` raised by the predicate count as "not yet" (the last one is named on failure)."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except errors as exc:
            last_exc, result = exc, None
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" +
                         (f" (last error: {last_exc})" if last_exc else ""))


@dataclass
class OperatorProcess:
    """A running `kvpilot operator` process (kopf in standalone mode) and where to reach it."""

    proc: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http_get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"operator died:\n{self.log()[-4000:]}"

    def assert_no_errors_logged(self) -> None:
        """No error or critical line, and no traceback, in its JSON log."""
        errors = [line for line in self.log().splitlines()
                  if json.loads(line).get("severity") in ("error", "critical") or "Traceback" in line]
        assert errors == [], "\n".join(errors[:5])

    def assert_stops_cleanly(self) -> None:
        assert self.stop() == 0, f"operator did not shut down cleanly:\n{self.log()[-4000:]}"

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)


@contextlib.contextmanager
def kopf_operator(api: KMockAPI, workdir: Path, *extra_args: str,
                  ready_timeout: float = 60.0) -> Iterator[OperatorProcess]:
    """Run `kvpilot operator --all-namespaces` against `api`; yield once /healthz answers 200."""
    kubeconfig = api.write_kubeconfig(workdir / "kubeconfig")
    with operator_process(kubeconfig, workdir, *extra_args, ready_timeout=ready_timeout) as op:
        yield op


@contextlib.contextmanager
def operator_process(kubeconfig: Path, workdir: Path, *extra_args: str, ready_timeout: float = 60.0,
                     log_name: str = "operator.log") -> Iterator[OperatorProcess]:
    """Run `kvpilot operator` (--all-namespaces unless a scope is given) with `kubeconfig`'s
    credentials; yield once /healthz answers 200, stop it (SIGINT) afterwards."""
    metrics_port = free_port()
    log_path = workdir / log_name
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    args = [sys.executable, "-m", "kvpilot.cli", "operator", "--metrics-port", str(metrics_port),
            "--log-format", "json", *extra_args]
    if not any(a.startswith("--namespace") or a == "--all-namespaces" for a in extra_args):
        args.append("--all-namespaces")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parents[1])
    op = OperatorProcess(proc, metrics_port, log_path)
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"operator exited with {proc.returncode}:\n{op.log()[-4000:]}")
            try:
                return op.http_get("/healthz")[0] == 200
            except OSError:
                return False
        wait_for(healthy, timeout=ready_timeout, interval=0.1, what="operator /healthz")
        yield op
    finally:
        op.stop()
