"""`kvpilot tuner --namespace NS` as a real process that a test or a chaos run kills and starts again;
each start logs to its own file, and every process it started is stopped on close."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from harness.cluster import ROOT


class TunerProcess:
    # A SIGTERMed tuner finishes the trial in progress first.
    STOP_TIMEOUT_S = 90.0

    def __init__(self, kubeconfig: Path, prometheus: str, storage: str, workdir: Path, namespace: str) -> None:
        self.args = [sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", prometheus,
                     "--namespace", namespace, "--storage", storage, "--metrics-port", "0", "--resync", "1",
                     "--poll", "1"]
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.start()

    def log_path(self, i: int) -> Path:
        return self.workdir / f"tuner-{i}.log"

    def start(self) -> None:
        with self.log_path(len(self.procs)).open("wb") as log:
            self.procs.append(subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                               cwd=ROOT))

    def log(self) -> str:
        """Every start's log, in order."""
        return "".join(self.log_path(i).read_text(errors="replace") for i in range(len(self.procs)))

    def exited(self) -> int | None:
        return self.procs[-1].poll()

    def check_alive(self) -> bool:
        """True (for polling predicates); raises with the log's tail once the tuner has exited."""
        if self.exited() is not None:
            raise AssertionError(f"tuner exited {self.procs[-1].returncode}:\n{self.log()[-4000:]}")
        return True

    def kill(self) -> None:
        """SIGKILL: no shutdown, whatever it was doing cut where it stood."""
        self.procs[-1].kill()
        self.procs[-1].wait(15)

    def kill_and_restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> int:
        """SIGTERM: the tuner finishes the trial in progress and exits 0."""
        proc = self.procs[-1]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return int(proc.returncode)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def stop_cleanly(proc: subprocess.Popen[bytes], log: Callable[[], str], timeout_s: float = 30.0) -> None:
    """SIGTERM a tuner a test started, which must obey promptly and exit 0 (whatever the test found);
    killed, with its log's tail in the error, where it does not."""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise AssertionError(f"tuner ignored SIGTERM:\n{log()[-3000:]}") from None
    assert rc == 0, log()[-3000:]
