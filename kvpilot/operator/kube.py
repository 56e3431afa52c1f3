"""A small asyncio Kubernetes client over aiohttp, with the credentials kopf logged in with.

Why not the official `kubernetes` client: its generated API and model modules add about 11 MB
of RSS here (measured on top of kopf, pydantic and aiohttp), and the operator only needs get,
create, merge-patch and delete of a handful of resources.  Credentials come from kopf's own login
(`kopf.ConnectionInfo`), so in-cluster service accounts and kubeconfigs both work.

Every call is retried on 409 Conflict, 429, transient 5xx, 401 (a rotated token), 403 (kube-apiserver
answers it for a few seconds after it restarts, until its RBAC caches have synced; kopf retries its own
calls on 403 for the same reason, so a 403 that lasts reaches the caller about 6 s late), timeouts and
dropped connections, with bounded exponential backoff and jitter (`kvpilot.api.retry.Backoff`),
never sooner than the server's Retry-After; anything else raises `ApiError` at once, for the caller
to turn into a condition.  A Retry-After longer than the policy's `max_wait` is not slept through:
the call raises at once with `ApiError.retry_after` set, and the handler hands that wait to kopf.

Retrying writes is safe because each is idempotent or checked: a create that timed out but was
made answers 409 AlreadyExists (the caller reads and patches), a merge patch says what the object
should hold, a delete that was done answers 404, and a status write carries the resourceVersion it
was computed from (its 409 goes back to the caller, which reads again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

import aiohttp

from kvpilot.api.rest import RETRIABLE_STATUSES, ApiError, resource_path
from kvpilot.api.retry import Backoff

__all__ = ["RETRIABLE_STATUSES", "ApiError", "KubeClient", "resource_path"]

logger = logging.getLogger("kvpilot.operator.kube")


class KubeClient:
    """One aiohttp session for the operator's own calls; created lazily from a kopf ConnectionInfo."""

    def __init__(self, *, backoff: Backoff | None = None, field_manager: str = "kvpilot",
                 timeout_s: float = 30.0, rng: random.Random | None = None) -> None:
        self._info: Any = None  # kopf.ConnectionInfo
        self._session: aiohttp.ClientSession | None = None
        self.backoff = backoff or Backoff()
        self.timeout_s = timeout_s
        self.rng = rng or random.Random()
        self.field_manager = field_manager

    def set_credentials(self, info: Any) -> None:
        """Called from kopf's login handler; a re-login replaces the session on next use."""
        if info is not self._info:
            self._info = info
            old, self._session = self._session, None
            if old is not None:
                asyncio.ensure_future(old.close())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        if self._info is None:
            raise ApiError(0, "NotLoggedIn", "no Kubernetes credentials yet")
        if self._session is None:
            info = self._info
            ssl: Any = None
            if info.server.startswith("https"):
                ssl = info.as_ssl_context()
            headers = {"Accept": "application/json", "User-Agent": "kvpilot-operator",
                       **info.as_http_headers()}
            self._session = aiohttp.ClientSession(
                headers=headers,
                connector=aiohttp.TCPConnector(ssl=ssl, limit=32),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def request(self, method: str, path: str, body: Any = None, *,
                      content_type: str = "application/json", params: dict[str, str] | None = None,
                      retry_conflicts: bool = True, text: bool = False) -> Any:
        retry = 0
        while True:
            try:
                return await self._request_once(method, path, body, content_type, params, text)
            except ApiError as exc:
                if not (exc.retriable or exc.status == 403) or (exc.status == 409 and not retry_conflicts):
                    raise
                delay = self.backoff.delay(retry, self.rng, exc.retry_after)
                if delay is None:  # out of retries, or the server asked for a longer wait than we sleep
                    raise
                logger.info("retrying %s %s in %.2fs after %s %s%s", method, path, delay, exc.status, exc.reason,
                            "" if exc.retry_after is None else f" (Retry-After {exc.retry_after:g}s)")
                await asyncio.sleep(delay)
                retry += 1

    async def _request_once(self, method: str, path: str, body: Any, content_type: str,
                            params: dict[str, str] | None, text_answer: bool = False) -> Any:
        session = self._session_now()
        url = self._info.server.rstrip("/") + path
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        if text_answer:  # a log is text/plain; ask for it as kubectl does
            headers["Accept"] = "text/plain, */*"
        try:
            async with session.request(method, url, data=data, headers=headers, params=params) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise ApiError.from_response(resp.status, resp.reason or "", text, method=method, path=path,
                                                 headers=resp.headers)
                if text_answer:
                    return text
                return json.loads(text) if text else None
        except TimeoutError as exc:
            raise ApiError(0, "Timeout", f"no answer within {self.timeout_s:g}s", method=method, path=path) from exc
        except aiohttp.ClientError as exc:
            raise ApiError(0, type(exc).__name__, str(exc) or "connection failed", method=method, path=path) from exc

    # ---- verbs ----
    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def get_or_none(self, path: str) -> Any:
        try:
            return await self.get(path)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def get_text(self, path: str, params: dict[str, str] | None = None) -> str:
        """A plain-text answer, e.g. a container's log (`pods/NAME/log`)."""
        return str(await self.request("GET", path, params=params, text=True) or "")

    async def create(self, path: str, body: dict[str, Any]) -> Any:
        # 409 on create means AlreadyExists: retrying the same create cannot help.
        return await self.request("POST", path, body, params={"fieldManager": self.field_manager},
                                  retry_conflicts=False)

    async def merge_patch(self, path: str, body: dict[str, Any], *, retry_conflicts: bool = True) -> Any:
        """retry_conflicts=False for a body with a resourceVersion precondition: sent again it would
        conflict again; the caller reads anew and recomputes."""
        return await self.request("PATCH", path, body, content_type="application/merge-patch+json",
                                  params={"fieldManager": self.field_manager}, retry_conflicts=retry_conflicts)

    async def delete(self, path: str, params: dict[str, str] | None = None) -> Any:
        return await self.request("DELETE", path, params=params)
