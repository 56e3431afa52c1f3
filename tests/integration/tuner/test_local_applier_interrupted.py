"""An engine change interrupted mid-start (SIGTERM from a service manager, Ctrl-C) leaves no engine behind:
the engine being started is not yet the applier's, so `stop()` alone would miss it.

The engines are real processes: a few lines of Python that answer /health when their token budget is
the starting one, and otherwise tell the test they are up (SIGUSR1 to their parent) and never get healthy.
The test's SIGUSR1 handler raises, as `kvpilot tune --local`'s SIGTERM handler does, while `apply` waits.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from kvpilot.tuner.adapters.local import LocalApplier, free_port
from kvpilot.tuner.core.space import EngineParams

pytestmark = pytest.mark.integration

START = EngineParams(2048, 0.9, 64)

ENGINE = r"""
import http.server, os, signal, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
tokens = int(args[args.index("--max-num-batched-tokens") + 1])
with open(os.environ["PIDS"], "a") as f:
    f.write(f"{os.getpid()}\n")
if tokens != 2048:
    os.kill(os.getppid(), signal.SIGUSR1)  # up, and never healthy
    while True:
        time.sleep(60)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


class Interrupted(BaseException):
    """What SystemExit from `kvpilot tune --local`'s SIGTERM handler is to apply(): not an ApplyFailed."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted()


@pytest.fixture
def usr1_raises() -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_apply_interrupted_mid_start_stops_the_engine_it_was_starting(tmp_path: Path, usr1_raises: None) -> None:
    pids = tmp_path / "pids"
    applier = LocalApplier([sys.executable, "-c", ENGINE], port=free_port(), start=START, startup_timeout_s=60,
                           shutdown_timeout_s=5, log_dir=str(tmp_path), env={"PIDS": str(pids)})
    applier.start()
    try:
        with pytest.raises(Interrupted):
            applier.apply(EngineParams(512, 0.9, 64), trial=1)
        started, starting = (int(p) for p in pids.read_text().split())
        # The interrupted start is stopped (and reaped) before the exception leaves apply; the engine
        # in force keeps serving.
        assert not alive(starting)
        assert alive(started) and applier.current() == START
    finally:
        applier.stop()
    assert not alive(started)


def test_a_start_interrupted_mid_start_stops_the_engine_it_was_starting(tmp_path: Path, usr1_raises: None) -> None:
    pids = tmp_path / "pids"
    applier = LocalApplier([sys.executable, "-c", ENGINE], port=free_port(), start=EngineParams(512, 0.9, 64),
                           startup_timeout_s=60, shutdown_timeout_s=5, log_dir=str(tmp_path), env={"PIDS": str(pids)})
    with pytest.raises(Interrupted):
        applier.start()
    (starting,) = (int(p) for p in pids.read_text().split())
    assert not alive(starting)
    applier.stop()  # nothing left to stop; harmless
