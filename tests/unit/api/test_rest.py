"""The Kubernetes REST pieces both clients share."""

from __future__ import annotations

import json

from kvpilot.api.rest import ApiError, parse_retry_after, resource_path


def test_an_error_answer_reads_the_status_object() -> None:
    status = {"kind": "Status", "reason": "Conflict", "message": "the object has been modified", "code": 409}
    err = ApiError.from_response(409, "Conflict (HTTP)", json.dumps(status), method="PATCH", path="/x")
    assert (err.status, err.reason, err.message) == (409, "Conflict", "the object has been modified")
    assert err.retriable and not err.not_found
    assert str(err) == "PATCH /x: 409 Conflict: the object has been modified"


def test_an_error_answer_that_is_not_json_keeps_the_http_reason_and_the_start_of_the_body() -> None:
    err = ApiError.from_response(502, "Bad Gateway", "<html>" + "x" * 2000, method="GET", path="/y")
    assert (err.status, err.reason) == (502, "Bad Gateway") and err.message.startswith("<html>")
    assert len(err.message) == 500 and err.retriable
    assert not ApiError.from_response(404, "Not Found", "[]", method="GET", path="/z").retriable


def test_an_error_answer_reads_the_wait_the_server_asks_for() -> None:
    status = {"kind": "Status", "reason": "TooManyRequests", "code": 429, "details": {"retryAfterSeconds": 3}}
    header = ApiError.from_response(429, "Too Many Requests", json.dumps(status), method="GET", path="/x",
                                    headers={"Retry-After": "1"})
    assert header.retry_after == 1.0 and header.retriable  # the header first
    assert ApiError.from_response(429, "", json.dumps(status), method="GET", path="/x").retry_after == 3.0
    assert ApiError.from_response(500, "", "oops", method="GET", path="/x").retry_after is None
    assert ApiError(503, "ServiceUnavailable", "").retry_after is None  # the old constructor still works


def test_retry_after_is_read_in_its_seconds_and_its_date_form() -> None:
    assert [parse_retry_after(v) for v in ("2", " 0.5 ", "0", None, "", "-1", "nan", "inf", "soon")] == [
        2.0, 0.5, 0.0, None, None, None, None, None, None]
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now


def test_resource_paths() -> None:
    assert resource_path("v1", "events", "ns") == "/api/v1/namespaces/ns/events"
    assert resource_path("kvpilot.dev/v1alpha1", "inferenceservices", "ns", "a", "status") == (
        "/apis/kvpilot.dev/v1alpha1/namespaces/ns/inferenceservices/a/status")
    assert resource_path("apps/v1", "deployments", None) == "/apis/apps/v1/deployments"


def test_retry_after_comes_from_the_header_or_else_the_status_details() -> None:
    status = {"kind": "Status", "reason": "TooManyRequests", "code": 429, "details": {"retryAfterSeconds": 7}}
    text = json.dumps(status)
    assert ApiError.from_response(429, "", text, method="GET", path="/x").retry_after == 7.0
    assert ApiError.from_response(429, "", text, method="GET", path="/x",
                                  headers={"Retry-After": "2"}).retry_after == 2.0
    assert ApiError.from_response(503, "", "oops", method="GET", path="/x").retry_after is None
