"""A small synchronous Kubernetes client for the tuner, on kopf's credentials and the standard library.

`KubeAPI`; errors are `kvpilot.api.rest.ApiError`; transient failures are retried (`RetryPolicy`). Why not
the official client, and what is retried: docs/architecture.md, "The tuner in a cluster".
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.api.rest import ApiError, resource_path
from kvpilot.api.retry import Backoff

__all__ = ["ApiError", "KubeAPI", "KubeCredentialsError", "RetryPolicy", "resource_path"]

log = logging.getLogger(__name__)

# Answers that say "not now" rather than "no".  401 is left out (unlike the operator's client,
# whose credentials kopf renews): the tuner's token is read once, so the same call would fail again.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long the tuner's client tries a call again (docs/architecture.md, "The tuner in
    a cluster").
    The defaults ride out about a minute of API-server trouble: 0.5+1+2+4+8+16+30+30 s."""

    attempts: int = 9  # tries in all, the first one included
    base_s: float = 0.5
    max_s: float = 30.0
    max_retry_after_s: float = 120.0
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)

    def transient(self, method: str, exc: ApiError) -> bool:
        if exc.status == 0:  # timeout, refused or reset connection: the call may not have arrived
            return True
        if exc.status == 409:
            return method == "PATCH"
        return exc.status in TRANSIENT_STATUSES

    @property
    def backoff(self) -> Backoff:
        # The operator's policy (kvpilot.api.retry) without jitter: one tuner per cluster has no
        # herd to spread, and a test can then say exactly when each try comes.
        return Backoff(retries=self.attempts - 1, base=self.base_s, factor=2.0, cap=self.max_s, jitter=0.0,
                       max_wait=self.max_retry_after_s)

    def delay(self, attempt: int, method: str, exc: ApiError) -> float | None:
        """Seconds to wait before try `attempt + 1` (attempt counts from 1); None: give up."""
        if not self.transient(method, exc):
            return None
        return self.backoff.delay(attempt - 1, _UNUSED_RNG, exc.retry_after)


NO_RETRY = RetryPolicy(attempts=1)
_UNUSED_RNG = random.Random(0)  # jitter 0: never drawn from


class KubeCredentialsError(Exception):
    """No usable Kubernetes credentials (no service account, no readable kubeconfig)."""


def load_credentials(**kwargs: Any) -> kopf.ConnectionInfo:
    """In a pod: the service account; elsewhere: $KUBECONFIG / ~/.kube/config."""
    kwargs.setdefault("settings", kopf.OperatorSettings())
    try:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    except (OSError, ValueError, KeyError, TypeError, kopf.LoginError) as exc:
        raise KubeCredentialsError(f"cannot read Kubernetes credentials: {exc}") from None
    if info is None:
        raise KubeCredentialsError(
            "no Kubernetes credentials: no in-cluster service account and no kubeconfig "
            "(set KUBECONFIG, or run in a pod with a service account)")
    return info


class KubeAPI:
    """Blocking JSON calls to one API server; safe to share between threads (no state per call)."""

    def __init__(self, info: kopf.ConnectionInfo, *, user_agent: str = "kvpilot-tuner",
                 timeout_s: float = 30.0, retry: RetryPolicy | None = None) -> None:
        self.server = info.server.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry if retry is not None else RetryPolicy()
        self._headers = {"Accept": "application/json", "User-Agent": user_agent, **info.as_http_headers()}
        context: ssl.SSLContext | None = None
        if self.server.startswith("https"):
            context = info.as_ssl_context()
        # The API server is reached directly, as kubectl does unless the kubeconfig names a proxy.
        handlers: list[Any] = [urllib.request.ProxyHandler({})]
        if info.proxy_url:
            handlers = [urllib.request.ProxyHandler({"http": info.proxy_url, "https": info.proxy_url})]
        self._opener = urllib.request.build_opener(*handlers, urllib.request.HTTPSHandler(context=context))

    @classmethod
    def from_environment(cls, **kwargs: Any) -> KubeAPI:
        return cls(load_credentials(), **kwargs)

    def close(self) -> None:
        """Nothing is held between calls; here for symmetry with the official client."""

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = "application/json", params: dict[str, str] | None = None) -> Any:
        """One call, tried again while the failure is transient (see `RetryPolicy`)."""
        attempt = 1
        while True:
            try:
                return self._request_once(method, path, body, content_type, params)
            except ApiError as exc:
                delay = self.retry.delay(attempt, method, exc)
                if delay is None:
                    raise
                log.warning("%s %s: %s %s; try %d of %d in %.1fs%s", method, path, exc.status, exc.reason,
                            attempt + 1, self.retry.attempts, delay,
                            "" if exc.retry_after is None else f" (Retry-After {exc.retry_after:g}s)")
                self.retry.sleep(delay)
                attempt += 1

    def _request_once(self, method: str, path: str, body: Any, content_type: str,
                      params: dict[str, str] | None) -> Any:
        url = self.server + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        data = None if body is None else json.dumps(body).encode()
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            raise ApiError.from_response(exc.code, str(exc.reason or ""), text, method=method, path=path,
                                         headers=exc.headers) from None
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:  # incl. a body cut short
            raise ApiError(0, type(exc).__name__, str(exc) or "connection failed", method=method, path=path) from exc
        return json.loads(text) if text else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def create(self, path: str, body: dict[str, Any], *, field_manager: str) -> Any:
        return self.request("POST", path, body, params={"fieldManager": field_manager})

    def apply(self, path: str, body: dict[str, Any], *, field_manager: str, force: bool = True) -> Any:
        """Server-side apply (JSON is YAML, so the body goes as JSON)."""
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return self.request("PATCH", path, body, content_type="application/apply-patch+yaml", params=params)

    def merge_patch(self, path: str, body: dict[str, Any], *, field_manager: str) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json",
                            params={"fieldManager": field_manager})
