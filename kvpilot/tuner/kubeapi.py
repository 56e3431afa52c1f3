"""A small synchronous Kubernetes client for the tuner, on kopf's credentials and the standard library.

Why not the official `kubernetes` client: the tuner makes five kinds of call (list, get, server-side
apply and status merge-patch of InferenceServices, create Events), and that client is about 126 MB
installed (a sync and an async copy of every generated model), more than half of the image's
virtual environment.  Credentials come from kopf's own pure-Python logins, as the operator's do:
the pod's service account first, then $KUBECONFIG / ~/.kube/config (tokens, client certificates,
basic auth; not exec plugins).

Errors are `kvpilot.api.rest.ApiError`, as the operator's: HTTP status, Status reason and message.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import kopf

from kvpilot.api.rest import ApiError, resource_path

__all__ = ["ApiError", "KubeAPI", "KubeCredentialsError", "resource_path"]


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
                 timeout_s: float = 30.0) -> None:
        self.server = info.server.rstrip("/")
        self.timeout_s = timeout_s
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
    def from_environment(cls) -> KubeAPI:
        return cls(load_credentials())

    def close(self) -> None:
        """Nothing is held between calls; here for symmetry with the official client."""

    def request(self, method: str, path: str, body: Any = None, *,
                content_type: str = "application/json", params: dict[str, str] | None = None) -> Any:
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
            raise ApiError.from_response(exc.code, str(exc.reason or ""), text, method=method, path=path) from None
        except (OSError, urllib.error.URLError) as exc:
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
