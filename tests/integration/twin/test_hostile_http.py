"""Hostile HTTP against a real `kvpilot twin serve` process (tests/fuzz/http_requests.py).

Every case ends in its expected 4xx with an OpenAI-style error body (or, for a well-formed request
from a half-closing client, its answer), never a 5xx; each costs the server at most 2 CPU-seconds
(from /proc/PID/stat, the server's and its body-parsing workers') and 200 MB of peak memory (VmHWM
growth, summed over those processes); afterwards the server is healthy and its
log holds JSON lines only.  Slow request heads and idle keep-alive connections are closed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import proctree
from harness.twin_process import FAST_TWIN_ARGS, TwinProcess, twin_server
from tests.fuzz.http_requests import CASES, HttpCase, _post

pytestmark = pytest.mark.integration

CPU_BOUND_S = 2.0
MEMORY_BOUND_MB = 200.0
HANG_GUARD_S = 60.0  # a socket timeout so a regression fails instead of hanging; not a speed goal
KEEPALIVE_S = 1.0


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> TwinProcess:
    env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(KEEPALIVE_S)}
    with twin_server(*FAST_TWIN_ARGS, log_dir=tmp_path_factory.mktemp("hostile"), env=env) as t:
        # The server starts its body-parsing worker at the first large body: a one-time start-up
        # cost (a fresh interpreter compiling its imports), not what any case costs. Pay it here.
        _exchange(t.port, HttpCase("warm-up", _post(json.dumps({"prompt": "a " * 100_000}))))
        yield t


def _exchange(port: int, case: HttpCase) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S) as sock:
        # The server may answer and close before a large body is all sent.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(case.data)
        if case.half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out


def _parse(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1."), response[:200]
    return int(status_line.split()[1]), body


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_case(twin: TwinProcess, case: HttpCase) -> None:
    base_hwm = proctree.memory_mb(twin.pid, "VmHWM")
    cpu_before = proctree.cpu_seconds(twin.pid)
    response = _exchange(twin.port, case)
    cpu = proctree.growth(cpu_before, proctree.cpu_seconds(twin.pid))
    status, body = _parse(response)
    expected = (case.status,) if isinstance(case.status, int) else case.status
    assert status in expected, response[:500]
    if case.json_error:
        error = json.loads(body)["error"]
        assert error["message"] and error["code"] == status and len(error["message"]) <= 1000, error
    assert cpu <= CPU_BOUND_S, f"{cpu:.2f} CPU-seconds"
    assert proctree.growth(base_hwm, proctree.memory_mb(twin.pid, "VmHWM")) <= MEMORY_BOUND_MB
    with urllib.request.urlopen(twin.health_url, timeout=HANG_GUARD_S) as resp:
        assert resp.status == 200


def test_slow_request_head_is_cut_off(twin: TwinProcess) -> None:
    with socket.create_connection(("127.0.0.1", twin.port), timeout=HANG_GUARD_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()
        deadline = started + 30 * KEEPALIVE_S
        closed = False
        while time.monotonic() < deadline:
            try:
                sock.sendall(b"X-Slow: 1\r\n")  # a header every 0.2 s, never the blank line
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.2)
            try:
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
        assert closed, "the server kept a connection that never finished its request head"


def test_idle_keepalive_is_closed(twin: TwinProcess) -> None:
    with socket.create_connection(("127.0.0.1", twin.port), timeout=30 * KEEPALIVE_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        assert sock.recv(65536) == b""  # closed by the server after the keep-alive timeout


def test_log_is_json_lines_only(twin: TwinProcess) -> None:
    _exchange(twin.port, CASES[0])  # at least one bad request logged
    lines = [line for line in twin.logs().splitlines() if line.strip()]
    assert lines
    for line in lines:
        json.loads(line)
    assert "Traceback" not in twin.logs()


def test_large_body_without_a_writable_temp_dir(tmp_path) -> None:
    """Where no temporary file can be written (a read-only container), a large body is parsed from
    memory instead: the same 400, no 5xx."""
    case = next(c for c in CASES if c.id == "ten-mb-prompt")
    env = {"TMPDIR": str(tmp_path / "missing")}
    with twin_server(*FAST_TWIN_ARGS, log_dir=tmp_path, env=env) as t:
        status, body = _parse(_exchange(t.port, case))
        assert status == 400 and "maximum context length" in json.loads(body)["error"]["message"]


# The classes an attacker found costly (issue 38): a 32 KB gzip of empty objects or arrays, a gzip
# of 8 GiB of zeros, a 32 MiB token-id list.
COSTLY = ["gzip-empty-objects", "gzip-empty-arrays", "gzip-bomb-8gb", "token-ids-32-mib"]


def _case(case_id: str) -> HttpCase:
    return next(c for c in CASES if c.id == case_id)


@pytest.mark.parametrize("case_id", COSTLY)
def test_four_at_once_stay_within_the_bounds_each(twin: TwinProcess, case_id: str) -> None:
    case = _case(case_id)
    base_hwm = proctree.memory_mb(twin.pid, "VmHWM")
    cpu_before = proctree.cpu_seconds(twin.pid)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: _exchange(twin.port, case), range(4)))
    cpu = proctree.growth(cpu_before, proctree.cpu_seconds(twin.pid))
    for response in responses:
        assert _parse(response)[0] == case.status, response[:500]
    assert cpu <= 4 * CPU_BOUND_S, f"{cpu:.2f} CPU-seconds for four"
    assert proctree.growth(base_hwm, proctree.memory_mb(twin.pid, "VmHWM")) <= 4 * MEMORY_BOUND_MB
