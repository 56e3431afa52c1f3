"""Jobs for the parse-worker tests (kvpilot.twin.server.workers): module-level functions, so a
spawned worker can import them by name."""

from __future__ import annotations

import os
import time


def echo(value: object) -> object:
    return value


def fail(message: str) -> None:
    raise ValueError(message)


def spin(marker: str, seconds: float) -> int:
    """Write this worker's pid to `marker`, then burn CPU for `seconds` (a long parse)."""
    with open(marker + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(marker + ".tmp", marker)
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        pass
    return os.getpid()
