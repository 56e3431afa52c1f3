"""The signals reader's typed errors and result handling, against small real HTTP servers.

The full reader against a real Prometheus is in tests/integration/slo/.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.prometheus import free_port
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.promql import Selector
from kvpilot.slo.signals import (
    NoData,
    PrometheusQueryError,
    PrometheusReader,
    PrometheusUnreachable,
    read_signals,
    signal_queries,
)

SLO = SloTarget(namespace="local", name="local")
SEL = Selector.for_job("twin")

Reply = Callable[[str], tuple[int, bytes]]


@pytest.fixture
def fake_api() -> Iterator[Callable[[Reply], str]]:
    """Start an HTTP server on 127.0.0.1 that answers /api/v1/query with `reply(query)`."""
    servers: list[ThreadingHTTPServer] = []

    def start(reply: Reply) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                from urllib.parse import parse_qs, urlparse

                length = int(self.headers.get("Content-Length") or 0)
                form = parse_qs(self.rfile.read(length).decode()) if length else {}
                form.update(parse_qs(urlparse(self.path).query))
                status, body = reply(form.get("query", [""])[0])
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _vector(value: str) -> bytes:
    return json.dumps({"status": "success", "data": {"resultType": "vector",
                                                     "result": [{"metric": {}, "value": [1.0, value]}]}}).encode()


def test_unreachable_names_the_url_and_reason() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PrometheusUnreachable, match=r"127\.0\.0\.1.*(refused|did not answer)"):
        read_signals(SEL, slo=SLO, prometheus_url=url, timeout=2)


def test_query_error_carries_prometheus_message(fake_api: Callable[[Reply], str]) -> None:
    err = json.dumps({"status": "error", "errorType": "bad_data", "error": "parse error: unexpected }"}).encode()
    url = fake_api(lambda q: (400, err))
    with pytest.raises(PrometheusQueryError, match="bad_data: parse error: unexpected }") as info:
        PrometheusReader(url).query("up{")
    assert info.value.query == "up{"


def test_not_prometheus_is_a_query_error(fake_api: Callable[[Reply], str]) -> None:
    url = fake_api(lambda q: (200, b"<html>hello</html>"))
    with pytest.raises(PrometheusQueryError, match="did not answer like Prometheus"):
        PrometheusReader(url).query("up")


def test_no_requests_is_no_data_not_zero_latency(fake_api: Callable[[Reply], str]) -> None:
    empty = json.dumps({"status": "success", "data": {"resultType": "vector", "result": []}}).encode()
    url = fake_api(lambda q: (200, empty))
    with pytest.raises(NoData, match="no requests in the last 5m"):
        read_signals(SEL, slo=SLO, prometheus_url=url)
    url = fake_api(lambda q: (200, _vector("0")))
    with pytest.raises(NoData):
        read_signals(SEL, slo=SLO, prometheus_url=url)


def test_snapshot_maps_each_query_and_nan_to_none(fake_api: Callable[[Reply], str]) -> None:
    queries = signal_queries(SEL, SLO, "600s")
    values = {expr: str(i + 1.5) for i, expr in enumerate(queries.values())}
    values[queries["itl_p99_seconds"]] = "NaN"
    url = fake_api(lambda q: (200, _vector(values[q])))
    snap = read_signals(SEL, "600s", slo=SLO, prometheus_url=url, at=1_700_000_000.0)
    assert snap.time == 1_700_000_000.0 and snap.window == "600s"
    assert snap.samples == 2  # round(1.5)
    assert snap.itl_p99_seconds is None  # NaN: no observations, not zero
    names = list(queries)
    assert snap.ttft_p99_seconds == names.index("ttft_p99_seconds") + 1.5
    assert snap.preemption_rate == names.index("preemption_rate") + 1.5
    assert snap.worst_burn_rate_5m == max(snap.ttft_burn_rate_5m or 0, snap.itl_burn_rate_5m or 0)


def test_several_series_is_an_error(fake_api: Callable[[Reply], str]) -> None:
    two = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"a": "1"}, "value": [1, "1"]}, {"metric": {"a": "2"}, "value": [1, "2"]}]}}).encode()
    url = fake_api(lambda q: (200, two))
    with pytest.raises(PrometheusQueryError, match="expected one series, got 2"):
        PrometheusReader(url).scalar("x")


def test_bad_url_and_window() -> None:
    with pytest.raises(ValueError, match="must start with http"):
        PrometheusReader("localhost:9090")
    with pytest.raises(ValueError, match="not a Prometheus duration"):
        signal_queries(SEL, SLO, "ten minutes")
