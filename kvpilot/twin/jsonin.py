"""Reading a JSON file a user names, bounded before it is believed: its size before it is read whole
(`/dev/zero` is a file too), its nesting before the JSON parser recurses into it (2,000 levels exhaust
Python's recursion).  The twin's JSON inputs (a model's config.json, a device profile, calibration
observations) are kilobytes and nest a few levels."""

from __future__ import annotations

import re
from pathlib import Path

MAX_BYTES = 1024 * 1024
MAX_DEPTH = 32

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def read_head(path: str | Path, limit: int = MAX_BYTES) -> bytes:
    """At most `limit` + 1 bytes of the file: more than `limit` says it is too large.  OSError as open() raises it."""
    with Path(path).open("rb") as f:
        return f.read(limit + 1)


def too_deep(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text nests more than `limit` arrays and objects deep (brackets inside strings aside);
    linear in the text, without recursion."""
    depth = 0
    for bracket in _BRACKETS.findall(_STRING.sub('""', text)):
        depth += 1 if bracket in "[{" else -1
        if depth > limit:
            return True
    return False
