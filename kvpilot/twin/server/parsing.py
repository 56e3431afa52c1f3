"""Request bodies parsed in worker processes (kvpilot.twin.server.app sends the large ones here).

This module is what a worker imports, so it imports only the protocol: a worker starts in a
fraction of a second and holds a few MB.
"""

from __future__ import annotations

import contextlib
import os

from kvpilot.twin.server import protocol as proto


def lower_priority() -> None:
    """Worker initializer: parsing a hostile body must not take CPU from serving; on a busy machine
    the event loop's process (streams, /health) goes first."""
    with contextlib.suppress(OSError):
        os.nice(10)


def parse_body(raw: bytes | str, kind: proto.Kind, served_model_names: tuple[str, ...],
               max_model_len: int) -> proto.GenerationRequest | tuple[str, int, str | None]:
    """Decode and validate a request body (its bytes, or the path of the file it was spooled to):
    the request, or (message, status, param) of its error (a tuple, as an exception with keyword
    arguments does not cross a process boundary whole)."""
    if isinstance(raw, str):
        with open(raw, "rb") as f:
            raw = f.read()
    try:
        body = proto.decode_json_object(raw)
        return proto.parse_generation_request(body, kind, served_model_name=served_model_names,
                                              max_model_len=max_model_len)
    except proto.OpenAIError as exc:
        return exc.message, exc.status, exc.param
