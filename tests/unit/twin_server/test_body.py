"""Request bodies bounded before they are parsed (kvpilot.twin.server.body): inflation stops at the
limit on inflated bytes, and JSON with more values or deeper nesting than a request needs is
refused before `json.loads` builds any of it."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib

import pytest

from kvpilot.twin.server.body import MAX_DEPTH, MAX_GZIP_MEMBERS, check_structure, inflate
from kvpilot.twin.server.protocol import OpenAIError
from tests.fuzz.http_requests import gzip_of_zeros

LIMIT = 32 << 20


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(("data", "encoding"), [
    (b'{"prompt": "x"}', ""),
    (b'{"prompt": "x"}', "identity"),
    (gzip.compress(b'{"prompt": "x"}'), "gzip"),
    (gzip.compress(b'{"prompt": "x"}'), " GZIP "),
    (gzip.compress(b'{"prompt": ') + gzip.compress(b'"x"}') + b"\0\0", "gzip"),  # two members, padding
    (zlib.compress(b'{"prompt": "x"}'), "deflate"),
    (_raw_deflate(b'{"prompt": "x"}'), "deflate"),
])
def test_inflates_what_clients_send(data: bytes, encoding: str) -> None:
    assert inflate(data, encoding, LIMIT) == b'{"prompt": "x"}'


def test_a_large_body_inflates_whole_up_to_the_limit() -> None:
    body = bytes(range(256)) * (LIMIT // 256)
    assert inflate(gzip.compress(body, 1), "gzip", LIMIT) == body


def test_a_bomb_stops_at_the_limit_in_bounded_memory() -> None:
    bomb = gzip_of_zeros(8)  # 8 GiB of zeros in ~8 MB
    tracemalloc.start()
    try:
        with pytest.raises(OpenAIError) as info:
            inflate(bomb, "gzip", LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.status == 413 and "larger than 33554432 bytes once inflated" in info.value.message
    assert peak < 2 * LIMIT  # the pieces up to the limit, not the gigabytes after it


@pytest.mark.parametrize(("data", "encoding", "status", "words"), [
    (b"garbage!!", "gzip", 400, "not valid gzip data"),
    (gzip.compress(b"x" * 100_000)[:-100], "gzip", 400, "truncated"),
    (zlib.compress(b'{"p": 1}')[:-4], "deflate", 400, "truncated"),
    (gzip.compress(b"{}") + b"junk", "gzip", 400, "not valid gzip data"),
    (gzip.compress(b"{}") * (MAX_GZIP_MEMBERS + 1), "gzip", 400, f"more than {MAX_GZIP_MEMBERS} gzip members"),
    (b"\x0b\x02\x80{}\x03", "br", 415, 'Content-Encoding "br" is not supported'),
    (b"{}", "gzip, br", 415, "not supported"),
    (b"x" * (LIMIT + 1), "", 413, "larger than"),
])
def test_refuses_what_it_cannot_inflate(data: bytes, encoding: str, status: int, words: str) -> None:
    with pytest.raises(OpenAIError) as info:
        inflate(data, encoding, LIMIT)
    assert info.value.status == status and words in info.value.message, info.value.message


BUDGET = 1000


@pytest.mark.parametrize("raw", [
    b'{"prompt": [' + b"{}," * 5000 + b"{}]}",
    b'{"prompt": [' + b"[]," * 5000 + b"[]]}",
    json.dumps({"prompt": list(range(5000))}).encode(),
    json.dumps({"prompt": ["ab"] * 5000}).encode(),
    json.dumps({"logit_bias": {str(i): 1 for i in range(5000)}}).encode(),
    json.dumps({"prompt": [{}] * 5000}).encode("utf-16"),
])
def test_more_values_than_the_budget_are_refused(raw: bytes) -> None:
    with pytest.raises(OpenAIError) as info:
        check_structure(raw, BUDGET)
    assert info.value.status == 400 and f"more than {BUDGET} JSON values" in info.value.message


def test_deep_nesting_is_refused() -> None:
    with pytest.raises(OpenAIError) as info:
        check_structure(b'{"tools": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", BUDGET)
    assert f"deeper than {MAX_DEPTH} levels" in info.value.message


@pytest.mark.parametrize("raw", [
    json.dumps({"prompt": list(range(BUDGET - 10))}).encode(),
    json.dumps({"tools": [[[[["x"]]]]] * 10, "n": [[[]] * 3]}).encode(),
    # Brackets, commas and quotes inside strings are text, not structure: a code prompt.
    json.dumps({"prompt": 'f(a, b)[0] = {"k": [1, 2]}\n' * 20_000}).encode(),
    json.dumps({"prompt": "[" * 10_000 + '\\"' * 1000}).encode(),
    b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}",  # the object is a level too
])
def test_requests_within_the_budget_pass(raw: bytes) -> None:
    check_structure(raw, BUDGET)
    json.loads(raw)
