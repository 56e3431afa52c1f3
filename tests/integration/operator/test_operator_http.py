"""The operator's /healthz and /metrics port (kvpilot.operator.metrics.start_http) on 127.0.0.1: what
it answers, and that a client cannot hold it (idle and half-sent connections closed, a cap on open
connections)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.operator.metrics import OperatorMetrics, start_http

pytestmark = pytest.mark.integration


def _request(port: int, head: str) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    return _request(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _wait_for(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def serving(scenario: Callable[[Any, int], Any], healthy: bool = True, **kwargs: Any) -> Any:
    async def main() -> Any:
        metrics = OperatorMetrics()
        metrics.count_admission("allowed")
        listener = await start_http(metrics, "127.0.0.1", 0, lambda: healthy, **kwargs)
        try:
            return await asyncio.to_thread(scenario, listener, listener.sock.getsockname()[1])
        finally:
            await listener.close()

    return asyncio.run(main())


def test_healthz_and_metrics_are_served_and_nothing_else() -> None:
    def scenario(_listener: Any, port: int) -> Any:
        return (_get(port, "/healthz"), _get(port, "/metrics"), _get(port, "/metrics", "HEAD"),
                _get(port, "/metrics", "POST"), _get(port, "/other"))

    healthz, metrics, head, post, other = serving(scenario)
    assert healthz == (200, b"ok\n")
    assert metrics[0] == 200 and b'kvpilot_admission_reviews_total{result="allowed"} 1.0' in metrics[1]
    assert head == (200, b"")
    assert post[0] == 405 and other[0] == 404
    assert serving(lambda _l, port: _get(port, "/healthz"), healthy=False) == (503, b"not ready\n")


def test_idle_and_half_sent_connections_are_closed() -> None:
    def scenario(listener: Any, port: int) -> Any:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle, \
                socket.create_connection(("127.0.0.1", port), timeout=10) as loris:
            loris.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            closed = _closed_by_server(idle), _closed_by_server(loris)
        _wait_for(lambda: listener.open_connections == 0)
        return closed, _get(port, "/healthz")

    closed, after = serving(scenario, idle_timeout_seconds=0.3)
    assert closed == (True, True)
    assert after == (200, b"ok\n")


def test_connections_past_the_cap_wait_for_a_free_slot() -> None:
    def scenario(listener: Any, port: int) -> Any:
        first, second = (socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(2))
        _wait_for(lambda: listener.open_connections == 2)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(_get, port, "/healthz")
            with pytest.raises(concurrent.futures.TimeoutError):
                waiting.result(timeout=0.3)  # the third waits in the backlog
            at_cap = listener.open_connections
            first.close()
            third = waiting.result(timeout=10)
        second.close()
        return at_cap, third

    assert serving(scenario, max_connections=2) == (2, (200, b"ok\n"))


@pytest.mark.parametrize(("kwargs", "complaint"), [
    ({"max_connections": 0}, "max_connections must be at least 1 (got 0)"),
    ({"idle_timeout_seconds": 0}, "idle_timeout_seconds must be a positive number of seconds (got 0)"),
])
def test_bounds_that_would_bound_nothing_are_refused_naming_them(kwargs: dict[str, Any], complaint: str) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
            await start_http(OperatorMetrics(), "127.0.0.1", 0, lambda: True, **kwargs)

    asyncio.run(main())
