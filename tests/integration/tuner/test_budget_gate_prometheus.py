"""The budget gate on a real Prometheus: the generated budget recordings computed from vLLM-shaped
histograms, and the gate pausing and resuming on what Prometheus answers.

Synthetic series, served over real HTTP by an exporter in the test (prometheus_client's own server and
exposition): vLLM's TTFT and ITL histograms, labelled as the Prometheus Operator labels an engine pod,
whose good and bad observations grow at rates the test sets; or the budget recordings themselves, to
move the budget both ways within seconds (a real 5m error ratio takes five minutes to forget).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from harness.kmock_api import free_port, wait_for
from harness.prometheus import PrometheusServer, require_prometheus
from kvpilot.api import vllm
from kvpilot.slo import rules
from kvpilot.slo.objectives import SloTarget
from kvpilot.tuner.adapters.prometheus import BudgetLeft
from kvpilot.tuner.core.gate import BUDGET_LOW, BUDGET_UNKNOWN, GatePolicy, PolicyGate

pytestmark = pytest.mark.integration

NS, NAME = "prod", "llama"
TARGET = SloTarget(namespace=NS, name=NAME, ttft_seconds=0.5, itl_seconds=0.05, objective=0.99, period="1h")
POD_LABELS = {"namespace": NS, "kvpilot_dev_inferenceservice": NAME, "pod": "llama-0"}


class SyntheticEngine:
    """vLLM's TTFT and ITL histograms whose counts grow with time: `good` observations per second land
    in the lowest bucket, `bad` ones above every SLO threshold."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.good = self.bad = 0.0  # per second
        self.good_total = self.bad_total = 0.0
        self.t = time.monotonic()

    def set(self, good: float, bad: float) -> None:
        with self.lock:
            self._advance()
            self.good, self.bad = good, bad

    def _advance(self) -> None:
        now = time.monotonic()
        self.good_total += self.good * (now - self.t)
        self.bad_total += self.bad * (now - self.t)
        self.t = now

    def collect(self) -> Iterator[Any]:
        with self.lock:
            self._advance()
            good, bad = int(self.good_total), int(self.bad_total)
        if good + bad == 0:
            return
        for name, edges in ((vllm.METRIC_TTFT, vllm.TTFT_BUCKETS), (vllm.METRIC_ITL, vllm.ITL_BUCKETS)):
            family = HistogramMetricFamily(name, "synthetic", labels=list(POD_LABELS))
            # The lowest edge holds the good ones; only +Inf holds the bad ones.
            buckets = [(repr(float(e)), good) for e in edges] + [("+Inf", good + bad)]
            family.add_metric(list(POD_LABELS.values()), buckets, sum_value=0.0)
            yield family


class SyntheticBudget:
    """The budget recordings themselves, as the rules would write them; None drops a series."""

    def __init__(self) -> None:
        self.values: dict[str, float | None] = {"ttft": None, "itl": None}

    def collect(self) -> Iterator[Any]:
        for sli, value in self.values.items():
            if value is None:
                continue
            family = GaugeMetricFamily(rules.budget_remaining_record(sli), "synthetic",
                                       labels=["namespace", "inferenceservice"])
            family.add_metric([NS, NAME], value)
            yield family


@pytest.fixture
def exporter() -> Iterator[tuple[CollectorRegistry, int]]:
    """The registry over HTTP in Prometheus's text format, as vLLM's /metrics answers.  (prometheus_client's
    own server negotiates OpenMetrics with Prometheus, and its OpenMetrics output escapes the colons
    of vLLM's metric names to underscores in the version installed here.)"""
    registry = CollectorRegistry()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield registry, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _prometheus(port: int, rule_files: list[Path] = []) -> PrometheusServer:  # noqa: B006
    return PrometheusServer(
        rule_files=rule_files,
        # honor_labels: the series keep their namespace label, as the operator's monitors keep the pod's.
        scrape_configs=[{"job_name": "engine", "honor_labels": True,
                         "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
    )


def test_the_generated_budget_recordings_feed_the_gate_from_unknown_to_open_to_budget_low(
    exporter: tuple[CollectorRegistry, int], tmp_path: Path
) -> None:
    require_prometheus()
    registry, port = exporter
    engine = SyntheticEngine()
    registry.register(engine)
    rule_file = tmp_path / "slo.rules.yaml"
    rule_file.write_text(yaml.safe_dump(rules.rule_file_for(TARGET, rules.RuleOptions(budget_interval="1s"))))
    with _prometheus(port, [rule_file]) as prom:
        left = BudgetLeft(prom.url, NS, NAME)
        gate = PolicyGate(GatePolicy(min_remaining=0.5), left)
        # No traffic yet: no recording, so the gate does not guess.
        prom.wait_for('up{job="engine"} == 1')
        assert left() is None
        closed = gate.closed()
        assert closed is not None and closed.reason == BUDGET_UNKNOWN
        # Good traffic only: the whole budget is left.
        engine.set(good=50.0, bad=0.0)
        wait_for(lambda: left() == pytest.approx(1.0), timeout=60, interval=0.5, what="a full budget recorded")
        assert gate.closed() is None
        # Every request now misses both SLOs: the 5m error ratio rises past 1% and the budget drains.
        engine.set(good=0.0, bad=50.0)
        wait_for(lambda: (left() or 1.0) < 0.5, timeout=90, interval=0.5, what="the budget recorded as low")
        closed = gate.closed()
        assert closed is not None and closed.reason == BUDGET_LOW, closed
        # The recording is the rules' own: the same value Prometheus gives for its expression.
        (budget_group,) = [g for g in rules.rule_groups_for(TARGET) if g["name"].startswith("kvpilot-slo-budget")]
        assert {r["record"] for r in budget_group["rules"]} == {
            "kvpilot:slo_ttft_error_budget_remaining:ratio", "kvpilot:slo_itl_error_budget_remaining:ratio"}


def test_the_gate_pauses_and_resumes_on_the_worse_sli_as_prometheus_reports_it(
    exporter: tuple[CollectorRegistry, int]
) -> None:
    require_prometheus()
    registry, port = exporter
    budget = SyntheticBudget()
    registry.register(budget)
    with _prometheus(port) as prom:
        left = BudgetLeft(prom.url, NS, NAME)
        gate = PolicyGate(GatePolicy(min_remaining=0.5), left, now=lambda: dt.datetime(2026, 12, 2, tzinfo=dt.UTC))
        prom.wait_for('up{job="engine"} == 1')
        assert left() is None and getattr(gate.closed(), "reason", None) == BUDGET_UNKNOWN

        budget.values = {"ttft": 0.8, "itl": 0.3}  # ITL is the one that burned
        wait_for(lambda: left() == pytest.approx(0.3), timeout=30, interval=0.2, what="the worse SLI read")
        closed = gate.closed()
        assert closed is not None and closed.reason == BUDGET_LOW and "30.0%" in closed.message

        budget.values = {"ttft": 0.8, "itl": 0.9}  # the period rolled on: both recovered
        wait_for(lambda: gate.closed() is None, timeout=30, interval=0.2, what="the gate open again")
        assert left() == pytest.approx(0.8)

        budget.values = {"ttft": None, "itl": None}  # the rules unloaded: stale series, not a full budget
        wait_for(lambda: left() is None, timeout=30, interval=0.2, what="the series gone stale")
        assert getattr(gate.closed(), "reason", None) == BUDGET_UNKNOWN


def test_an_unreachable_prometheus_reads_as_an_unknown_budget() -> None:
    left = BudgetLeft(f"http://127.0.0.1:{free_port()}", NS, NAME, timeout_s=2.0)
    assert left() is None
    closed = PolicyGate(GatePolicy(min_remaining=0.1), left).closed()
    assert closed is not None and closed.reason == BUDGET_UNKNOWN
