"""The planner in the tuner never lowers the count on missing data: with Prometheus answering no rate,
or gone, it holds the count asked for (NoDemandData), with the twin's capacity saying far fewer would do.

A real HTTP server on 127.0.0.1 answers Prometheus' query API (`/api/v1/query`) with the rate the test
sets (or an empty vector); the twin is the real one."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvpilot.fleet import planner
from kvpilot.tuner.capacity import TwinCapacity
from kvpilot.tuner.observe import TunerMetrics
from kvpilot.tuner.scaler import Scaler


class QueryApi:
    """Answers every instant query whose PromQL reads the TTFT count with `rate`; others with no series."""

    def __init__(self) -> None:
        self.rate: float | None = None
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, query: str) -> None:
                result: list[dict[str, Any]] = []
                if api.rate is not None and query.startswith("sum(rate(vllm:time_to_first_token_seconds_count"):
                    result = [{"metric": {}, "value": [0, str(api.rate)]}]
                body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("query", [""])[0])

            def do_POST(self) -> None:  # noqa: N802
                # The query in the form body or the URL, as a client sends it.
                length = int(self.headers.get("Content-Length") or 0)
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                form.update(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query))
                self._answer(form.get("query", [""])[0])

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(10)


@pytest.fixture
def prom() -> Iterator[QueryApi]:
    api = QueryApi()
    try:
        yield api
    finally:
        api.close()


ISVC = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "llama", "namespace": "prod"},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 6,
                 "autoscaling": {"minReplicas": 1, "maxReplicas": 10,
                                 "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}}}


def scaler(url: str) -> Scaler:
    return Scaler(None, ISVC, prometheus=url, interval_s=30.0, metrics=TunerMetrics(CollectorRegistry()),
                  capacity=TwinCapacity(points=4, duration_s=30.0, flood_requests=300))


def test_no_rate_series_holds_the_count(prom: QueryApi) -> None:
    d = scaler(prom.url).decide(0.0, 6)
    assert (d.desired, d.reason) == (6, planner.HELD_NO_DATA)


def test_prometheus_gone_after_a_low_rate_holds_the_count_instead_of_scaling_down(prom: QueryApi) -> None:
    s = scaler(prom.url)
    prom.rate = 0.5  # a small fraction of one replica
    first = s.decide(0.0, 6)
    assert first.needed == 1  # the data says 1 would do (held for the budget, which is unknown here)
    assert first.reason == planner.HELD_BUDGET
    prom.close()
    held = s.decide(30.0, 6)
    assert (held.desired, held.reason) == (6, planner.HELD_NO_DATA)
    assert "never lowered on missing data" in held.message
