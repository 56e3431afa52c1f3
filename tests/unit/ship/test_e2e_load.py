"""The e2e suite's load generator (tests/e2e/load.py), run here against a real `kvpilot twin serve`
process: it must count answers, stop cleanly on SIGTERM with a summary, and count a dead
endpoint as failures (or the e2e "not one request failed" would prove nothing).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LOAD = ROOT / "tests" / "e2e" / "load.py"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def twin(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "twin.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpilot.cli",
            "twin",
            "serve",
            MODEL,
            "--gpu",
            "H100-80GB",
            "--port",
            str(port),
            "--max-num-batched-tokens",
            "2048",
            "--seed",
            "7",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"twin exited {proc.returncode}: {(tmp_path / 'twin.log').read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, 60, "the twin's /health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


class LoadProcess:
    def __init__(self, url: str, tmp_path: Path) -> None:
        env = dict(os.environ, LOAD_URL=url, LOAD_MODEL=MODEL, LOAD_CONCURRENCY="2", LOAD_TIMEOUT="5")
        self.out = tmp_path / "load.out"
        self._file = self.out.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(LOAD)], stdout=self._file, stderr=subprocess.STDOUT, env=env
        )

    def progress(self) -> dict[str, int]:
        lines = [ln for ln in self.out.read_text().splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {"ok": 0, "failed": 0, "in_flight": 0}

    def stop(self) -> tuple[int, dict[str, object]]:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(30)
        self._file.close()
        line = next(ln for ln in self.out.read_text().splitlines() if ln.startswith("SUMMARY "))
        return code, json.loads(line.removeprefix("SUMMARY "))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self._file.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_load_counts_answers_and_summarises_on_sigterm(twin: str, tmp_path: Path) -> None:
    load = LoadProcess(twin, tmp_path)
    try:
        wait_until(lambda: load.progress()["ok"] >= 5, 60, "5 answers")
        code, summary = load.stop()
    finally:
        load.kill()
    assert code == 0
    assert summary["failed"] == 0 and summary["errors"] == []
    assert isinstance(summary["ok"], int) and summary["ok"] >= 5
    assert summary["in_flight"] == 0  # it waited for the requests in flight


@pytest.mark.timeout(60)
def test_load_counts_a_dead_endpoint_as_failures(tmp_path: Path) -> None:
    load = LoadProcess(f"http://127.0.0.1:{free_port()}", tmp_path)
    try:
        wait_until(lambda: load.progress()["failed"] >= 3, 30, "3 failures")
        code, summary = load.stop()
    finally:
        load.kill()
    assert code == 1
    assert summary["ok"] == 0
    assert any("Connection refused" in e or "URLError" in e for e in summary["errors"])  # type: ignore[union-attr]


def test_e2e_manifests_are_valid() -> None:
    """What the (opt-in) e2e suite sends to a cluster is checked here, where no cluster is needed."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kvpilot.api import validate_object
    from tests.e2e.test_rollout import load_pod, twin_service
    from tests.unit.ship.pss import restricted_violations

    isvc = twin_service("kvpilot-e2e-test")
    assert validate_object(isvc) == []
    assert isvc["spec"]["tuning"]["enabled"] is False  # the test, not the tuner, changes the engine
    pod = load_pod("kvpilot-e2e-test", isvc["metadata"]["name"], isvc["spec"]["model"], "kvpilot:dev")
    for version in ("1.30", "1.33"):
        kubernetes_validate.validate(pod, version, strict=True)
    assert restricted_violations(pod["spec"]) == []
    # The load script travels inline; it must be the one tested above.
    assert pod["spec"]["containers"][0]["command"][:2] == ["python", "-c"]
    assert pod["spec"]["containers"][0]["command"][2] == LOAD.read_text()
