"""Structured (JSON lines) logging for the twin's HTTP server.

One JSON object per line on stderr: `ts`, `level`, `logger`, `msg`, and the fields passed as
`extra={"fields": {...}}`.  Log shippers in a cluster parse it without a grok pattern, and tests
can read it back with `json.loads`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LOGGER_NAME = "kvpilot.twin.server"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def _json_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler._kvpilot_json = True  # type: ignore[attr-defined]
    return handler


def configure(level: str) -> logging.Logger:
    """Send the server's logger to stderr as JSON lines at `level` (debug shows every request).

    Every other logger (aiohttp's, asyncio's, warnings) goes through the root logger, which gets
    the same JSON handler at warning level: the process writes nothing but JSON lines, and a
    traceback, when there is one, is the `exc` field of its line."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level.upper())
    logger.propagate = False
    if not any(getattr(h, "_kvpilot_json", False) for h in logger.handlers):
        logger.addHandler(_json_handler())
    root = logging.getLogger()
    if not any(getattr(h, "_kvpilot_json", False) for h in root.handlers):
        root.addHandler(_json_handler())
        root.setLevel(max(logging.WARNING, logger.level))
    logging.captureWarnings(True)
    return logger
