"""Request bodies bounded before they are parsed: inflated within a size limit, and their JSON
structure counted before `json.loads` builds it.

A 32 KB gzip body can inflate to 32 MB of `[{},{},...]`, which `json.loads` turns into ten
million dicts (~1 GB) before any field is looked at; a gzip of zeros can inflate without end.  So
a compressed body is inflated a bounded piece at a time, the limit counted on inflated bytes, and
a decoded body whose JSON holds more values than any request to the model could need, or nests
deeper than any does, is refused from byte counts alone.  Pure functions: the server runs them in
its parse workers, off the event loop.
"""

from __future__ import annotations

import json
import re
import zlib

from kvpilot.twin.server.protocol import OpenAIError

# Inflated in pieces of this size, so a bomb stops at the limit rather than after it is all out.
_PIECE = 1 << 20
_INPUT_SLICE = 1 << 16
# JSON values a request may hold beyond one per token of the model's context (a token-id prompt,
# or one message per token at most): tools' JSON schemas, stop lists, logit_bias and the like.
VALUE_SLACK = 65_536
# Deeper than any request's JSON (a tool's schema nests a few levels); the C decoder would go on
# to ~1000 levels, a stack frame each.
MAX_DEPTH = 64
# Clients send one gzip member; each costs a decompressor, so a body of thousands is refused.
MAX_GZIP_MEMBERS = 64

ENCODINGS = ("gzip", "deflate", "identity")
# One JSON string: what sits between its quotes is not structure.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def inflate(data: bytes, content_encoding: str, limit: int) -> bytes:
    """The body decoded per its Content-Encoding: 413 as soon as the inflated bytes pass `limit`,
    415 for an encoding other than gzip, deflate or identity, 400 for a broken stream."""
    coding = content_encoding.strip().lower()
    if coding in ("", "identity"):
        if len(data) > limit:
            raise _too_large(limit, "")
        return data
    if coding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif coding == "deflate":
        # RFC 9110's deflate is zlib-wrapped, but many clients send a raw stream (aiohttp's test).
        wbits = zlib.MAX_WBITS if data[:1] and data[0] & 0x0F == 8 else -zlib.MAX_WBITS
    else:
        raise OpenAIError(f"Content-Encoding {_shown(coding)} is not supported: send one of "
                          f"{', '.join(ENCODINGS)}.", status=415)
    out = _Output(limit, coding)
    view = memoryview(data)
    offset = 0
    try:
        for _ in range(MAX_GZIP_MEMBERS):
            offset = _inflate_member(zlib.decompressobj(wbits), view, offset, out)
            # gzip allows members one after another (zero padding after the last is common).
            if wbits < 0 or coding == "deflate" or not view[offset:].tobytes().strip(b"\0"):
                return b"".join(out.pieces)
        raise OpenAIError(f"The request body cannot be read: it has more than {MAX_GZIP_MEMBERS} gzip members.")
    except zlib.error as exc:
        raise OpenAIError(f"The request body cannot be read: it is not valid {coding} data ({exc}).") from None


class _Output:
    def __init__(self, limit: int, coding: str) -> None:
        self.pieces: list[bytes] = []
        self.size = 0
        self.limit = limit
        self.coding = coding

    def add(self, piece: bytes) -> None:
        self.size += len(piece)
        if self.size > self.limit:
            raise _too_large(self.limit, self.coding)
        self.pieces.append(piece)


def _inflate_member(d: zlib._Decompress, data: memoryview, offset: int, out: _Output) -> int:
    """Inflate the stream at `offset` of `data` into `out`, at most _PIECE bytes per call; the
    offset of what follows it comes back."""
    for start in range(offset, len(data), _INPUT_SLICE):
        end = min(start + _INPUT_SLICE, len(data))
        pending: bytes | memoryview = data[start:end]
        while pending and not d.eof:
            out.add(d.decompress(pending, _PIECE))
            pending = d.unconsumed_tail
        if d.eof:
            return end - len(d.unused_data)  # unused_data is the rest of this slice
    while not d.eof:  # output zlib still holds for input it has consumed
        piece = d.decompress(b"", _PIECE)
        if not piece:
            raise OpenAIError(f"The request body cannot be read: its {out.coding} stream is truncated.")
        out.add(piece)
    return len(data) - len(d.unused_data)


def _too_large(limit: int, coding: str) -> OpenAIError:
    inflated = f" once inflated ({coding})" if coding else ""
    return OpenAIError(f"The request body is larger than {limit} bytes{inflated}.", status=413)


def _shown(value: str) -> str:
    return json.dumps(value if len(value) <= 40 else value[:40] + "...")


def check_structure(raw: bytes, max_values: int) -> None:
    """Refuse (400) a body whose JSON holds more than `max_values` values or nests deeper than
    MAX_DEPTH, from counts over its bytes, before anything is built.

    Every value and member either opens a container or follows a comma, so `{`, `[` and `,`
    outside strings bound them; a body with few of those anywhere is passed at once.  Counts are
    upper bounds for any body `json.loads` would accept, so nothing it would build is missed."""
    if not raw.startswith((b"{", b"[")) and raw[:4].count(b"\0"):
        raw = _as_utf8(raw)  # UTF-16/32 JSON (json.loads takes it): count in UTF-8
    brackets = raw.count(b"{") + raw.count(b"[")
    if brackets + raw.count(b",") <= max_values and brackets <= MAX_DEPTH:
        return
    # Strings hold no structure, but each string is a value or a member's name: with more than
    # 2 * max_values of them (unescaped quotes bound them) the body is too big, uncounted.
    quotes = raw.count(b'"') - raw.count(b'\\"')
    if quotes // 2 > 2 * max_values:
        raise _too_many(max_values)
    bare = _STRING.sub(b"", raw)
    brackets = bare.count(b"{") + bare.count(b"[")
    if brackets + bare.count(b",") > max_values:
        raise _too_many(max_values)
    if brackets > MAX_DEPTH:
        depth = 0
        for byte in bare.translate(None, _NOT_BRACKETS):
            depth += 1 if byte in b"[{" else -1
            if depth > MAX_DEPTH:
                raise OpenAIError(f"The request body is not valid for this server: its JSON nests deeper "
                                  f"than {MAX_DEPTH} levels.")


def _as_utf8(raw: bytes) -> bytes:
    try:
        return raw.decode(json.detect_encoding(raw)).encode()
    except (UnicodeError, LookupError) as exc:
        raise OpenAIError(f"The request body is not valid JSON: {str(exc)[:200]}") from None


def _too_many(max_values: int) -> OpenAIError:
    return OpenAIError(f"The request body holds more than {max_values} JSON values (array items, object "
                       "members and containers): more than any request to this model needs (one per token "
                       f"of its context, plus {VALUE_SLACK}).")
