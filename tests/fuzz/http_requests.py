"""Hostile HTTP requests for the twin server, as raw bytes on a socket (no client library would send
most of them).  Each expects a status class: every client error is a 4xx with an OpenAI-style
`{"error": {"message", ...}}` body; none is a 5xx."""

from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpCase:
    id: str
    data: bytes
    status: int | tuple[int, ...] = 400  # the status, or any of several
    half_close: bool = False  # shut down the client's sending side after the request
    json_error: bool = True  # the answer carries an OpenAI-style error body


def _post(body: bytes | str, path: str = "/v1/completions", headers: str = "",
          content_length: int | None = None) -> bytes:
    raw = body.encode() if isinstance(body, str) else body
    length = len(raw) if content_length is None else content_length
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n")
    return head.encode() + raw


def _completion(**fields: object) -> bytes:
    return _post(json.dumps({"prompt": "hello", "max_tokens": 2, **fields}))


def _chat(**fields: object) -> bytes:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return _post(json.dumps(body), "/v1/chat/completions")


def _raw_field(name: str, literal: str) -> bytes:
    return _post('{"prompt": "hello", "max_tokens": 2, "' + name + '": ' + literal + "}")


TEN_MB_PROMPT = json.dumps({"prompt": "hello world, this is a prompt. " * 340_000, "max_tokens": 2})
GZIP = "Content-Encoding: gzip\r\n"


def _gzip_of_list(item: bytes, n: int) -> bytes:
    """A gzip body of ~32 KB that inflates to `{"prompt":[item,item,...]}` (~3 bytes an item)."""
    return gzip.compress(b'{"prompt":[' + b",".join([item] * n) + b"]}", 9)


def gzip_of_zeros(gib: int) -> bytes:
    """A gzip member of `gib` GiB of zeros (~1 KB per MiB), built from one compressed MiB repeated:
    a full flush resets the compressor, so every MiB after the first compresses to the same bytes.
    The member is cut before its end (no final block, no CRC): the server must stop at its 32 MiB
    limit long before, or it inflates all of it."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    mib = b"\0" * (1 << 20)
    first = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(mib) + c.flush(zlib.Z_FULL_FLUSH)
    return first + again * ((gib << 10) - 1)


TOKEN_IDS_32_MIB = json.dumps({"prompt": [1000 + i % 9000 for i in range((32 << 20) // 6 - 1000)]}).encode()

CASES: list[HttpCase] = [
    # --- bodies that are not what they claim
    HttpCase("json-nested-arrays-10kb", _post("[" * 5000 + "]" * 5000)),
    HttpCase("json-nested-objects", _post('{"a":' * 3000 + "1" + "}" * 3000)),
    HttpCase("json-nested-in-prompt", _post('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}")),
    HttpCase("gzip-garbage", _post(b"garbage!!", headers="Content-Encoding: gzip\r\n")),
    HttpCase("deflate-garbage", _post(b"\x00\x01garbage", headers="Content-Encoding: deflate\r\n")),
    HttpCase("gzip-bomb-100mb", _post(gzip.compress(b"\x00" * (100 << 20), 9),
                                      headers="Content-Encoding: gzip\r\n"), status=413),
    HttpCase("gzip-valid-json-array", _post(gzip.compress(b"[1, 2]"), headers="Content-Encoding: gzip\r\n")),
    HttpCase("deflate-truncated", _post(zlib.compress(b'{"prompt": "x"}')[:-4],
                                        headers="Content-Encoding: deflate\r\n")),
    HttpCase("not-json", _post("prompt=hello")),
    HttpCase("json-array", _post("[1, 2, 3]")),
    HttpCase("empty-body", _post("")),
    HttpCase("invalid-utf8", _post(b'{"prompt": "\xff\xfe"}')),
    HttpCase("huge-integer", _post('{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}")),
    HttpCase("ten-mb-prompt", _post(TEN_MB_PROMPT)),
    # --- small bodies that are large work: each is bounded before it is built
    HttpCase("gzip-empty-objects", _post(_gzip_of_list(b"{}", 10_000_000), headers=GZIP)),
    HttpCase("gzip-empty-arrays", _post(_gzip_of_list(b"[]", 10_000_000), headers=GZIP)),
    HttpCase("gzip-bomb-8gb", _post(gzip_of_zeros(8), headers=GZIP), status=413),
    HttpCase("token-ids-32-mib", _post(TOKEN_IDS_32_MIB)),
    HttpCase("gzip-many-members", _post(gzip.compress(b"{}") * 2000, headers=GZIP)),
    HttpCase("brotli-unsupported", _post(b"\x0b\x02\x80{}\x03", headers="Content-Encoding: br\r\n"), status=415),
    HttpCase("json-nested-70", _post('{"prompt": "x", "tools": [' + "[" * 70 + "]" * 70 + "]}")),
    HttpCase("gzip-prompt-32-mib", _post(gzip.compress(json.dumps({"prompt": "a b. " * ((32 << 20) // 5 - 10)}).encode(), 6),
                                         headers=GZIP)),
    # --- optional fields with the wrong type or value
    HttpCase("temperature-nan", _raw_field("temperature", "NaN")),
    HttpCase("temperature-infinity", _raw_field("temperature", "Infinity")),
    HttpCase("top-p-minus-infinity", _raw_field("top_p", "-Infinity")),
    HttpCase("temperature-string", _completion(temperature="hot")),
    HttpCase("temperature-negative", _completion(temperature=-1)),
    HttpCase("top-p-zero", _completion(top_p=0)),
    HttpCase("presence-penalty-3", _completion(presence_penalty=3)),
    HttpCase("stop-int", _completion(stop=5)),
    HttpCase("stop-list-of-ints", _completion(stop=[1, 2])),
    HttpCase("seed-string", _completion(seed="x")),
    HttpCase("seed-beyond-int64", _completion(seed=1 << 70)),
    HttpCase("logprobs-string", _completion(logprobs="yes")),
    HttpCase("chat-logprobs-int", _chat(logprobs=5)),
    HttpCase("chat-top-logprobs-100", _chat(logprobs=True, top_logprobs=100)),
    HttpCase("user-int", _completion(user=5)),
    HttpCase("logit-bias-list", _completion(logit_bias=[1])),
    HttpCase("response-format-string", _chat(response_format="json")),
    HttpCase("tools-object", _chat(tools={"type": "function"})),
    HttpCase("top-k-minus-5", _completion(top_k=-5)),
    HttpCase("min-p-2", _completion(min_p=2)),
    HttpCase("n-2", _completion(n=2)),
    HttpCase("stream-string", _completion(stream="yes")),
    HttpCase("stream-options-without-stream", _completion(stream_options={"include_usage": True})),
    HttpCase("max-tokens-string", _completion(max_tokens="10")),
    HttpCase("max-tokens-negative", _completion(max_tokens=-1)),
    HttpCase("max-tokens-float-huge", _raw_field("max_tokens", "1e400")),
    HttpCase("min-tokens-above-max", _completion(min_tokens=10)),
    # --- what vLLM 0.32 refuses (its max_logprobs default is 20; logit_bias keys must be token ids)
    HttpCase("logprobs-21", _completion(logprobs=21)),
    HttpCase("chat-top-logprobs-21", _chat(logprobs=True, top_logprobs=21)),
    HttpCase("logit-bias-word-key", _completion(logit_bias={"hello": 5})),
    HttpCase("logit-bias-float-key", _completion(logit_bias={"1.5": 5})),
    # --- prompts and messages
    HttpCase("prompt-missing", _post('{"max_tokens": 2}')),
    HttpCase("prompt-int", _post('{"prompt": 5}')),
    HttpCase("prompt-batch", _post('{"prompt": [[1, 2], [3]]}')),
    HttpCase("prompt-negative-token", _post('{"prompt": [-1]}')),
    HttpCase("messages-empty", _post('{"messages": []}', "/v1/chat/completions")),
    HttpCase("messages-not-objects", _post('{"messages": [5]}', "/v1/chat/completions")),
    HttpCase("message-role-int", _post('{"messages": [{"role": 5, "content": "x"}]}', "/v1/chat/completions")),
    HttpCase("message-image-part", _post('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
                                         "/v1/chat/completions")),
    HttpCase("model-unknown", _completion(model="gpt-4"), status=404),
    HttpCase("model-long-unknown", _completion(model="m" * 100_000), status=404),
    HttpCase("model-int", _completion(model=5)),
    # --- HTTP itself
    HttpCase("garbage-request-line", b"GARBAGE\r\n\r\n"),
    HttpCase("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    HttpCase("tls-client-hello", bytes.fromhex("160301020001") + b"\x00" * 64 + b"\r\n\r\n"),
    HttpCase("header-without-colon", b"GET /health HTTP/1.1\r\nHost: x\r\nbroken header\r\n\r\n"),
    HttpCase("header-too-long", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
             status=(400, 431)),
    HttpCase("content-length-not-a-number", _post('{"prompt": "x"}').replace(b"Content-Length: 15",
                                                                          b"Content-Length: abc")),
    HttpCase("content-length-negative", _post('{"prompt": "x"}').replace(b"Content-Length: 15",
                                                                      b"Content-Length: -5")),
    HttpCase("chunked-and-length", _post("0\r\n\r\n", headers="Transfer-Encoding: chunked\r\n")),
    HttpCase("chunked-bad-size", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                 b"Connection: close\r\n\r\nzz\r\nabc\r\n0\r\n\r\n"),
    HttpCase("body-shorter-than-length-half-closed", _post('{"prompt": "x"}', content_length=100), half_close=True),
    HttpCase("unknown-path", b"GET /v2/secrets HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", status=404),
    HttpCase("wrong-method", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", status=405),
    HttpCase("post-to-health", _post("{}", "/health"), status=405),
    # --- a well-formed request from a client that half-closes: it gets its answer
    HttpCase("half-closed-after-request", _completion(), status=200, half_close=True, json_error=False),
]
