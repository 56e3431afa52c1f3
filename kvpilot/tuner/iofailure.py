"""Storage and report failures named as what they are: a full disk, a read-only file or directory,
a damaged study file, each one line and its own exit status (sysexits.h, beside the CLI's 2 for
bad input and 70 for a bug).

Optuna reports a failed SQLite write as a StorageInternalError ("invalid data in the commit"), whose
cause is SQLAlchemy's error, whose cause is sqlite3's, which alone says what happened
(`sqlite_errorname`); `named` reads the chain down to it.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from kvpilot.tuner.secrets import redacted

EX_DATAERR = 65  # the study file is not a database, or is damaged
EX_UNAVAILABLE = 69  # the database server cannot be reached or refuses the connection
EX_CANTCREAT = 73  # a file or directory that cannot be written: read-only, no permission
EX_IOERR = 74  # the disk is full (or a file size limit), or another I/O error
IO_EXIT_CODES = (EX_DATAERR, EX_UNAVAILABLE, EX_CANTCREAT, EX_IOERR)

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


class IOFailure(Exception):
    """A file the run needs could not be written or read; `exit_code` says which way (sysexits)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        orig = getattr(e, "orig", None)  # SQLAlchemy's DBAPIError wraps the driver's error here
        e = orig if isinstance(orig, BaseException) else (e.__cause__ or e.__context__)


def _no_space(path: Path, code: int | None) -> str:
    """A write found no room: the device full (ENOSPC, EDQUOT), or the file at this process's size
    limit (EFBIG, ulimit -f); SQLite does not keep the errno, so for it either, as far as can be told."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = f"the file reached this process's size limit (ulimit -f: {soft} bytes)"
    if code == errno.EFBIG:
        return limit
    if code is not None:
        return "no space left on the device (the disk, or the quota, is full)"
    try:
        free = f"{shutil.disk_usage(path.parent).free // 2**20} MiB free"
    except OSError:
        free = "its free space unknown"
    if soft != resource.RLIM_INFINITY:
        return f"the disk is full or {limit} ({free})"
    return f"the disk is full or failing ({free})"


def _read_only(path: Path, why_dir: str = "") -> str:
    """Which of the file and its directory cannot be written."""
    parent = path.parent
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is read-only"
    if parent.exists() and not os.access(parent, os.W_OK):
        return f"its directory {parent} is read-only{why_dir}"
    return "its file system is read-only, or the file cannot be opened for writing"


def sqlite_path(url: str) -> Path | None:
    """The file a sqlite:/// URL names (None: another database, or in memory)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # not a URL at all: the storage check has said so already
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database).expanduser()


def storage_failure(exc: BaseException, url: str, shown: str) -> IOFailure | None:
    """`exc` (anything raised while the study was open) as a storage failure of `url` (`shown`: the
    URL with its password masked), or None when it is something else."""
    path = sqlite_path(url)
    where = f"the study storage {shown}"
    for e in _chain(exc):
        if path is None and _is_connection_failure(e):
            # The user's environment (the server down, a wrong host or port, a refused login), not a bug.
            said = " ".join(str(getattr(e, "orig", None) or e).split())
            return IOFailure(f"cannot connect to {where}: {redacted(said)}", EX_UNAVAILABLE)
        if isinstance(e, sqlite3.Error) and path is not None:
            name = getattr(e, "sqlite_errorname", "") or ""
            if name.startswith(("SQLITE_FULL", "SQLITE_IOERR")):
                return IOFailure(f"cannot write {where}: {_no_space(path, None)} ({name}: {e})", EX_IOERR)
            if name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")):
                why = _read_only(path, " (SQLite writes its journal beside the file)")
                return IOFailure(f"cannot write {where}: {why} ({name}: {e})", EX_CANTCREAT)
            if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
                return IOFailure(f"{where} is not a SQLite database or is damaged ({name}: {e}): move the file "
                                 "aside (or restore it from a copy) and run again", EX_DATAERR)
        if isinstance(e, OSError) and path is not None and e.filename is not None \
                and Path(os.fsdecode(e.filename)).resolve().is_relative_to(path.parent.resolve()):
            failure = _os_failure(e, path, where)
            if failure is not None:
                return failure
    return None


def _is_connection_failure(e: BaseException) -> bool:
    """SQLAlchemy's OperationalError from connecting to a database server (psycopg's, PyMySQL's)."""
    try:
        from sqlalchemy.exc import OperationalError
    except ImportError:  # pragma: no cover - optuna depends on SQLAlchemy
        return False
    return isinstance(e, OperationalError) and "connect" in str(e).lower()


def report_failure(exc: OSError, path: Path) -> IOFailure:
    """A report that could not be written: what stopped it (the answer is printed already)."""
    where = f"the report {path}"
    failure = _os_failure(exc, path, where)
    if failure is not None:
        return failure
    return IOFailure(f"cannot write {where}: {exc.strerror or exc}", EX_IOERR)


def _os_failure(e: OSError, path: Path, where: str) -> IOFailure | None:
    if e.errno in _FULL:
        return IOFailure(f"cannot write {where}: {_no_space(path, e.errno)} ({e.strerror})", EX_IOERR)
    if e.errno in _READ_ONLY:
        return IOFailure(f"cannot write {where}: {_read_only(path)} ({e.strerror})", EX_CANTCREAT)
    if e.errno == errno.EIO:
        return IOFailure(f"cannot write {where}: an I/O error ({e.strerror})", EX_IOERR)
    return None
