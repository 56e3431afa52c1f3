"""Request bodies parsed in worker processes (kvpilot.twin.server.app sends the large and the
compressed ones here; small plain ones are parsed in place, by the same function).

This module is what a worker imports, so it imports only the protocol and body: a worker starts in a
fraction of a second and holds a few MB.
"""

from __future__ import annotations

from kvpilot.twin.server import protocol as proto
from kvpilot.twin.server.body import VALUE_SLACK, check_structure, inflate


def parse_body(raw: bytes | str, content_encoding: str, kind: proto.Kind, served_model_names: tuple[str, ...],
               max_model_len: int, max_body_bytes: int) -> proto.GenerationRequest | tuple[str, int, str | None]:
    """Inflate, bound, decode and validate a request body (its bytes as received, or the path of
    the file they were spooled to): the request, or (message, status, param) of its error (a
    tuple, as an exception with keyword arguments does not cross a process boundary whole)."""
    if isinstance(raw, str):
        with open(raw, "rb") as f:
            raw = f.read()
    try:
        data = inflate(raw, content_encoding, max_body_bytes)
        del raw  # the compressed bytes are not needed past here
        check_structure(data, max_model_len + VALUE_SLACK)
        body = proto.decode_json_object(data)
        del data
        return proto.parse_generation_request(body, kind, served_model_name=served_model_names,
                                              max_model_len=max_model_len)
    except proto.OpenAIError as exc:
        return exc.message, exc.status, exc.param
