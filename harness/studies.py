"""Reading a running tuner's SQLite study from outside it, without disturbing it."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def complete_trials(db: Path) -> int:
    """The COMPLETE trials in the study file, read-only (0 while there is no file or no table yet)."""
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return int(con.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0])
    except sqlite3.Error:
        return 0
