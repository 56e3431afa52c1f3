"""Which failures the tuner's Kubernetes client tries again, and how long it waits (RetryPolicy).
The calls themselves, against KMock with each fault injected: tests/integration/tuner/test_kube_faults.py."""

from __future__ import annotations

from kvpilot.api.rest import ApiError
from kvpilot.tuner.kubeapi import RetryPolicy


def err(status: int, retry_after: float | None = None, reason: str = "") -> ApiError:
    return ApiError(status, reason, "m", retry_after=retry_after)


def test_transient_answers_are_retried_and_answers_about_the_request_are_not() -> None:
    policy = RetryPolicy()
    for status in (0, 429, 500, 502, 503, 504):
        assert policy.delay(1, "GET", err(status)) == 0.5, status
    for status in (400, 401, 403, 404, 422):
        assert policy.delay(1, "PATCH", err(status)) is None, status
    # A conflict on a PATCH without a precondition is the server's race: send it again.  On a
    # POST it is AlreadyExists: the same create cannot succeed.
    assert policy.delay(1, "PATCH", err(409, reason="Conflict")) == 0.5
    assert policy.delay(1, "POST", err(409, reason="AlreadyExists")) is None


def test_the_wait_doubles_up_to_its_cap_and_the_tries_are_bounded() -> None:
    policy = RetryPolicy(attempts=9, base_s=0.5, max_s=30.0)
    waits = [policy.delay(n, "GET", err(503)) for n in range(1, 10)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, None]


def test_retry_after_is_never_cut_short_and_an_overlong_one_is_not_waited_on() -> None:
    policy = RetryPolicy(max_retry_after_s=120.0)
    assert policy.delay(1, "PATCH", err(429, retry_after=5)) == 5.0
    assert policy.delay(5, "PATCH", err(429, retry_after=1)) == 8.0  # the back-off is longer
    assert policy.delay(1, "PATCH", err(503, retry_after=600)) is None
