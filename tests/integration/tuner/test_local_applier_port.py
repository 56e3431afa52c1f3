"""The public port is the applier's before the first engine starts.

vLLM takes free ports for its own sockets while it starts (torch.distributed's store), and once took the
port the forwarder was about to bind while it waited for the engine: `kvpilot tune --local` then died
with "address already in use".  The engine here is a real process that tries the same: it binds the
public port if it can (and says so), then answers /health.
"""

from __future__ import annotations

import socket
import sys
import urllib.request
from pathlib import Path

import pytest

from kvpilot.tuner.adapters.local import LocalApplier, free_port
from kvpilot.tuner.core.space import EngineParams

pytestmark = pytest.mark.integration

ENGINE = r"""
import errno, http.server, os, socket, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
grab = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
try:
    grab.bind(("127.0.0.1", int(os.environ["PUBLIC"])))
    verdict = "took it"
except OSError as exc:
    verdict = "in use" if exc.errno == errno.EADDRINUSE else f"error {exc.errno}"
    grab.close()
with open(os.environ["VERDICT"], "w") as f:
    f.write(verdict)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_an_engine_starting_cannot_take_the_public_port(tmp_path: Path) -> None:
    public = free_port()
    verdict = tmp_path / "verdict"
    applier = LocalApplier([sys.executable, "-c", ENGINE], port=public, start=EngineParams(2048, 0.9, 64),
                           startup_timeout_s=60, shutdown_timeout_s=5, log_dir=str(tmp_path),
                           env={"PUBLIC": str(public), "VERDICT": str(verdict)})
    applier.start()
    try:
        assert verdict.read_text() == "in use"
        with urllib.request.urlopen(f"http://127.0.0.1:{public}/health", timeout=10) as resp:
            assert resp.read() == b"ok"  # and the forwarder serves once the engine is up
    finally:
        applier.stop()


def test_a_public_port_already_taken_fails_start_and_leaves_nothing(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        public = taken.getsockname()[1]
        pids = tmp_path / "verdict"
        applier = LocalApplier([sys.executable, "-c", ENGINE], port=public, start=EngineParams(2048, 0.9, 64),
                               startup_timeout_s=60, shutdown_timeout_s=5, log_dir=str(tmp_path),
                               env={"PUBLIC": str(public), "VERDICT": str(pids)})
        with pytest.raises(OSError):
            applier.start()
        assert not pids.exists()  # no engine was started for a port the applier could not hold
        applier.stop()
