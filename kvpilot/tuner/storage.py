"""Checking an Optuna storage URL before a study opens it, so that bad input is one clear line.

Optuna's RDB storage is SQLAlchemy: a bare path, a misspelt scheme or a missing database driver
would otherwise surface as a SQLAlchemy traceback from deep inside `create_study`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpilot.tuner.secrets import has_password as has_password
from kvpilot.tuner.secrets import redacted as redacted

# Drivers kvpilot knows how to get: the extra that installs each.
_EXTRAS = {"psycopg": "kvpilot[postgresql]", "psycopg2": "kvpilot[postgresql]"}


# How long a write to a SQLite study waits for the file's lock before it fails.  Python's sqlite3 waits
# 5 s: `kvpilot tune --workers N` forks N writers onto one file beside the parent polling it, and one
# of them descheduled (or its disk slow) while it holds the lock made a sibling fail "database is
# locked", and the whole run end as an internal error.  A writer holds it for milliseconds.
SQLITE_BUSY_TIMEOUT_S = 300.0


class StorageError(ValueError):
    """An unusable storage URL: says what was given (its password masked) and what is allowed."""


def check_storage_url(url: str, flag: str = "--storage") -> str:
    """The URL, if SQLAlchemy can parse it and its database driver is installed; else StorageError."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    if "://" not in url:
        hint = f" (for a SQLite file: sqlite:///{url})" if url else ""
        raise StorageError(f"{flag}: expected a database URL such as sqlite:///out/study.db or "
                           f"postgresql://user:pass@host/db, got {redacted(url)!r}{hint}")
    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise StorageError(f"{flag}: {redacted(url)!r} is not a database URL SQLAlchemy knows "
                           f"(sqlite:///PATH, postgresql://..., mysql+pymysql://...): {redacted(str(exc))}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        module = (exc.name or "").split(".")[0]
        extra = _EXTRAS.get(module)
        how = f"pip install '{extra}'" if extra else f"install the {module or parsed.drivername} package"
        raise StorageError(f"{flag}: the {parsed.get_backend_name()} driver ({module or parsed.drivername}) "
                           f"is not installed: {how}") from None
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        # Optuna does not make the directory of a SQLite file.
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    return url


def sqlite_storage(url: str) -> Any:
    """Optuna's RDB storage on a SQLite URL whose transactions each take the file's write lock first
    (BEGIN IMMEDIATE), waiting SQLITE_BUSY_TIMEOUT_S for it.

    Optuna pops a queued trial by reading it WAITING, then writing it RUNNING, and counts on the read
    locking the row (FOR UPDATE), which SQLite ignores; Python's sqlite3 does not even begin a
    transaction before a read. Two forked `--workers` then both ran vLLM's defaults as trial 0 and the
    budget came one trial short. Serialized transactions make the read and the write one step; a
    transaction here lasts milliseconds, so the workers barely wait. (SQLAlchemy's recipe for
    pysqlite: the driver's own transaction handling off, and a BEGIN of our choosing.)"""
    import optuna
    from sqlalchemy import event

    storage = optuna.storages.RDBStorage(url, engine_kwargs={
        "connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "isolation_level": None}})

    @event.listens_for(storage.engine, "begin")
    def _begin_immediate(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return storage
