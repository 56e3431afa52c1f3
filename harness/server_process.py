"""The lifecycle both test servers (Prometheus, PostgreSQL) share: a process started by `start()`
in a temp dir of its own with its output in `log_path`, stopped (and the dir removed) by `stop()`
or by leaving a `with` block."""

from __future__ import annotations

import signal
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any, Self


class ServerProcess:
    # The signal that asks the server to stop; it is killed if it has not within STOP_TIMEOUT_S.
    STOP_SIGNAL = signal.SIGTERM
    STOP_TIMEOUT_S = 10.0

    proc: subprocess.Popen[Any] | None = None
    log_path: Path | str = ""
    _log: IO[Any] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def _terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(self.STOP_SIGNAL)
            try:
                self.proc.wait(timeout=self.STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()

    def stop(self) -> None:
        self._terminate()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""
