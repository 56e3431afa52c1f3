"""A real PostgreSQL server for tests: Debian's `initdb` and `postgres` on a free 127.0.0.1 port.

    from harness.postgres import PostgresServer, postgres_server, postgres_url  # fixtures

    with PostgresServer() as pg:
        url = pg.create_database("study")   # postgresql+psycopg://kvpilot:<password>@127.0.0.1:<port>/study

The cluster lives in a temporary directory (data and socket), has one superuser with a random
password (scram-sha-256 on TCP, so a URL without the password is refused as it would be in a
cluster), and is stopped (SIGINT: "fast" shutdown, then SIGKILL) on exit.  PostgreSQL refuses to
run as root, so under root the server runs as the `postgres` system user (or `nobody`) via
setpriv.  Tests that use it skip with a clear reason when the binaries are missing, except in CI
(`CI` set), where a missing server fails them: `scripts/install-test-tools.sh` installs Debian's
`postgresql`.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.prometheus import free_port
from harness.server_process import ServerProcess

USER = "kvpilot"
# Debian keeps the server binaries out of PATH, one directory per major version.
BINDIR = os.environ.get("KVPILOT_PG_BINDIR", "")


class PostgresError(RuntimeError):
    pass


def postgres_bindir() -> Path | None:
    """The directory holding initdb and postgres: $KVPILOT_PG_BINDIR, Debian's newest, or PATH."""
    candidates = [BINDIR] if BINDIR else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True)
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(str(Path(os.path.realpath(on_path)).parent))
    for d in candidates:
        if all(os.access(Path(d) / b, os.X_OK) for b in ("initdb", "postgres")):
            return Path(d)
    return None


def require_postgres() -> Path:
    bindir = postgres_bindir()
    if bindir is None:
        why = ("PostgreSQL server binaries (initdb, postgres) not found in $KVPILOT_PG_BINDIR, "
               "/usr/lib/postgresql/*/bin or PATH (apt-get install postgresql; scripts/install-test-tools.sh)")
        if os.environ.get("CI"):
            pytest.fail(f"{why}; CI must run the PostgreSQL tests")
        pytest.skip(why)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        msg = "psycopg is not installed (pip install 'kvpilot[postgresql]')"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return bindir


def _unprivileged() -> pwd.struct_passwd | None:
    """The user to run the server as when we are root (PostgreSQL refuses root); None otherwise."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresError("running as root and neither a postgres nor a nobody user exists to run the server as")


class PostgresServer(ServerProcess):
    """One PostgreSQL cluster with its data and socket directories in a temporary directory."""

    # SIGINT: "fast" shutdown, which ends open sessions (SIGTERM's "smart" one waits for them,
    # and a test's own SQLAlchemy pool may still hold one).
    STOP_SIGNAL = signal.SIGINT
    STOP_TIMEOUT_S = 15.0

    def __init__(self, *, ready_timeout: float = 60.0) -> None:
        self.ready_timeout = ready_timeout
        self.password = secrets.token_hex(12)
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def url(self, database: str = "postgres", *, password: bool = True) -> str:
        if self.port is None:
            raise PostgresError("PostgreSQL is not started")
        auth = f"{USER}:{self.password}" if password else USER
        return f"postgresql+psycopg://{auth}@127.0.0.1:{self.port}/{database}"

    def _as_server_user(self, argv: list[str]) -> list[str]:
        who = _unprivileged()
        if who is None:
            return argv
        return ["setpriv", f"--reuid={who.pw_uid}", f"--regid={who.pw_gid}", "--clear-groups",
                "--reset-env", *argv]

    def start(self) -> PostgresServer:
        bindir = require_postgres()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpilot-pg-")
        root = Path(self._tmp.name)
        who = _unprivileged()
        if who is not None:
            os.chown(root, who.pw_uid, who.pw_gid)
        pwfile = root / "pwfile"
        pwfile.write_text(self.password + "\n")
        if who is not None:
            os.chown(pwfile, who.pw_uid, who.pw_gid)
        pwfile.chmod(0o600)
        data = root / "data"
        init = subprocess.run(
            self._as_server_user([str(bindir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}",
                                  "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync"]),
            capture_output=True, cwd=root, timeout=120,
        )
        pwfile.unlink()
        if init.returncode != 0:
            self.stop()
            raise PostgresError(f"initdb failed ({init.returncode}): {init.stderr.decode(errors='replace')[-2000:]}")
        self.log_path = root / "postgres.log"
        last_error = ""
        for _attempt in range(3):  # a free port can be taken between picking and binding it
            self.port = free_port()
            log = open(self.log_path, "wb")  # noqa: SIM115 - closed in _terminate()
            self._log = log
            self.proc = subprocess.Popen(
                self._as_server_user([
                    str(bindir / "postgres"), "-D", str(data), "-p", str(self.port),
                    "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={root}",
                    # a test database: durability is not what is under test
                    "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                ]),
                stdout=log, stderr=subprocess.STDOUT, cwd=root,
            )
            try:
                self._wait_ready()
                return self
            except PostgresError as exc:
                last_error = str(exc)
                self._terminate()
        self.stop()
        raise PostgresError(f"PostgreSQL did not start: {last_error}")

    def _connect(self, database: str = "postgres"):  # type: ignore[no-untyped-def]
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=USER, password=self.password,
                               dbname=database, connect_timeout=2, autocommit=True)

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise PostgresError(f"exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with self._connect() as conn:
                    conn.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise PostgresError(f"not ready after {self.ready_timeout}s: {self.log_tail()}")

    def create_database(self, name: str) -> str:
        """A new empty database; returns its SQLAlchemy URL (password included)."""
        with self._connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One started PostgreSQL for the session (initdb takes seconds); tests take a database each."""
    with PostgresServer() as pg:
        yield pg


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of a fresh database on the session's server, so no study leaks between tests."""
    return postgres_server.create_database(f"t{secrets.token_hex(6)}")
