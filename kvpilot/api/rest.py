"""The Kubernetes REST API as both of kvpilot's clients speak it (the operator's asyncio one and the
tuner's blocking one): resource paths, and the Status error an API server answers with."""

from __future__ import annotations

import datetime
import email.utils
import json
import math

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
        # Seconds the server asked the client to wait before trying again (None: it did not say).
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, status: int, reason: str, text: str, *, method: str, path: str,
                      retry_after: str | None = None) -> ApiError:
        """From an error answer: the Status object's reason and message where the body is one.
        `retry_after` is the answer's Retry-After header; without one, the Status's
        details.retryAfterSeconds (the API server sets both on a 429 and on some 5xx)."""
        message = text[:500]
        wait = parse_retry_after(retry_after)
        try:
            payload = json.loads(text)
            reason = payload.get("reason") or reason
            message = payload.get("message") or message
            if wait is None:
                wait = parse_retry_after((payload.get("details") or {}).get("retryAfterSeconds"))
        except (ValueError, AttributeError):
            pass
        return cls(status, str(reason), str(message), method=method, path=path, retry_after=wait)

    @property
    def retriable(self) -> bool:
        return self.status in RETRIABLE_STATUSES or self.status == 0

    @property
    def not_found(self) -> bool:
        return self.status == 404


def parse_retry_after(value: object) -> float | None:
    """Retry-After as seconds: delta-seconds (what the API server sends) or an HTTP-date (RFC 9110
    10.2.3); None for no value or one that is neither."""
    if value is None or value == "":
        return None
    try:
        seconds = float(str(value).strip())
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
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
