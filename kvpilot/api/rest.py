"""The Kubernetes REST API as both of kvpilot's clients speak it (the operator's asyncio one and the
tuner's blocking one): resource paths, and the Status error an API server answers with."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

# 401 too: a service-account token rotates; kopf logs in again when its own watches get 401,
# which hands the clients the new credentials before the retries run out.
RETRIABLE_STATUSES = frozenset({401, 409, 429, 500, 502, 503, 504})


class ApiError(Exception):
    """A Kubernetes API error: HTTP status, the Status reason and message."""

    def __init__(self, status: int, reason: str, message: str, *, method: str = "", path: str = "",
                 retry_after: float | None = None) -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message
        # Seconds the server asked the client to wait before trying again (Retry-After), if it did.
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, status: int, reason: str, text: str, *, method: str, path: str,
                      headers: Mapping[str, str] | None = None) -> ApiError:
        """From an error answer: the Status object's reason and message where the body is one, and
        the wait the server asked for (`headers` are the answer's; case-insensitive lookup is the
        caller's mapping's, as aiohttp's and http.client's are)."""
        message = text[:500]
        details: object = None
        try:
            payload = json.loads(text)
            reason = payload.get("reason") or reason
            message = payload.get("message") or message
            details = payload.get("details")
        except (ValueError, AttributeError):
            pass
        retry_after = parse_retry_after(headers.get("Retry-After") if headers is not None else None)
        if retry_after is None and isinstance(details, dict):
            # The Status object's own field (details.retryAfterSeconds), as older API servers send it.
            retry_after = parse_retry_after(str(details.get("retryAfterSeconds", "")) or None)
        return cls(status, str(reason), str(message), method=method, path=path, retry_after=retry_after)

    @property
    def retriable(self) -> bool:
        return self.status in RETRIABLE_STATUSES or self.status == 0

    @property
    def not_found(self) -> bool:
        return self.status == 404


def parse_retry_after(value: str | None) -> float | None:
    """A Retry-After header's delay in seconds, from its delay-seconds form (the one the Kubernetes
    API server sends: `Retry-After: 1` on 429 and on some 5xx).  None when absent or not that form
    (an HTTP-date is not read: the client's own backoff applies then)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path
