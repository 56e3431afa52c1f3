"""The Kubernetes REST API as both of kvpilot's clients speak it (the operator's asyncio one and the
tuner's blocking one): resource paths, and the Status error an API server answers with."""

from __future__ import annotations

import json

# 401 too: a service-account token rotates; kopf logs in again when its own watches get 401,
# which hands the clients the new credentials before the retries run out.
RETRIABLE_STATUSES = frozenset({401, 409, 429, 500, 502, 503, 504})


class ApiError(Exception):
    """A Kubernetes API error: HTTP status, the Status reason and message."""

    def __init__(self, status: int, reason: str, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message

    @classmethod
    def from_response(cls, status: int, reason: str, text: str, *, method: str, path: str) -> ApiError:
        """From an error answer: the Status object's reason and message where the body is one."""
        message = text[:500]
        try:
            payload = json.loads(text)
            reason = payload.get("reason") or reason
            message = payload.get("message") or message
        except (ValueError, AttributeError):
            pass
        return cls(status, str(reason), str(message), method=method, path=path)

    @property
    def retriable(self) -> bool:
        return self.status in RETRIABLE_STATUSES or self.status == 0

    @property
    def not_found(self) -> bool:
        return self.status == 404


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path
