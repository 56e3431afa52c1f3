"""The Kubernetes REST API as both of kvpilot's clients speak it (the operator's asyncio one and the
tuner's blocking one): resource paths, and the Status error an API server answers with."""

from __future__ import annotations

import datetime
import email.utils
import json
import math
from typing import Protocol


class Headers(Protocol):
    """An answer's headers, looked up case-insensitively (aiohttp's CIMultiDict, http.client's Message)."""

    def get(self, name: str, /) -> str | None: ...


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
                      headers: Headers | None = None) -> ApiError:
        """From an error answer: the Status object's reason and message where the body is one, and
        the wait the server asked for (its Retry-After header, else the Status's retryAfterSeconds)."""
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
            retry_after = parse_retry_after(details.get("retryAfterSeconds"))
        return cls(status, str(reason), str(message), method=method, path=path, retry_after=retry_after)

    @property
    def retriable(self) -> bool:
        return self.status in RETRIABLE_STATUSES or self.status == 0

    @property
    def not_found(self) -> bool:
        return self.status == 404


def parse_retry_after(value: object) -> float | None:
    """Retry-After in seconds: delay-seconds (what the Kubernetes API server sends, on 429 and some
    5xx) or an HTTP-date (RFC 9110 10.2.3; one in the past is 0). None when absent or malformed
    (a negative or non-finite number included): the client's own backoff applies then."""
    if value is None or value == "":
        return None
    try:
        seconds = float(str(value).strip())
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(str(value))
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "GMT" per RFC 9110; an obsolete form may carry no zone
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path
