"""Every PromQL kvpilot generates is accepted by a real Prometheus, and hostile names cannot
change what a query selects.

One Prometheus (1 s scrape and evaluation) loads the generated rule files of a plain, a
hostile-named and an edge-case InferenceService, and scrapes an exporter (prometheus_client,
on 127.0.0.1) whose series carry hostile label values next to decoys.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest

from harness.prometheus import PrometheusServer
from kvpilot.api import vllm
from kvpilot.slo import promql, yamltext
from kvpilot.slo.dashboard import dashboard_all, dashboard_for, expressions, resolve
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.promql import Selector
from kvpilot.slo.rules import RuleOptions, all_expressions, rule_file_for, rule_groups_for
from kvpilot.slo.signals import NoData, PrometheusQueryError, PrometheusReader, read_signals, signal_queries

pytestmark = pytest.mark.integration

PLAIN = SloTarget(namespace="prod", name="llama")
HOSTILE_NS = 'ns"} or vector(1) or {x="'
HOSTILE_NAME = 'we\\ird\n{{ printf "%s" "owned" }}}\t\u00e9'
HOSTILE = SloTarget(namespace=HOSTILE_NS, name=HOSTILE_NAME, ttft_seconds=1.0, itl_seconds=0.1, objective=0.999)
EDGES = SloTarget(namespace="a", name="b", ttft_seconds=2560.0, itl_seconds=0.01, objective=0.9999, period="4w", replicas=0)
TARGETS = (PLAIN, HOSTILE, EDGES)

# Label values an injection would try to reach: a decoy per hostile field.
DECOYS = [("ns", HOSTILE_NAME), (HOSTILE_NS, "other"), ("x", "y")]


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    """Synthetic vLLM series: the hostile service and decoys, TTFT observations on each."""
    reg = CollectorRegistry()
    labels = ("namespace", promql.ISVC_POD_LABEL, "model_name")
    running = Gauge(vllm.METRIC_RUNNING, "running", labels, registry=reg)
    kv = Gauge(vllm.METRIC_KV_USAGE, "kv", labels, registry=reg)
    ttft = Histogram(vllm.METRIC_TTFT, "ttft", labels, buckets=vllm.TTFT_BUCKETS, registry=reg)
    running.labels(HOSTILE_NS, HOSTILE_NAME, "m").set(7)
    kv.labels(HOSTILE_NS, HOSTILE_NAME, "m").set(0.25)
    for i, (ns, name) in enumerate(DECOYS):
        running.labels(ns, name, "m").set(100 + i)
        kv.labels(ns, name, "m").set(0.9)
    h = ttft.labels(HOSTILE_NS, HOSTILE_NAME, "m")
    for v in (0.3, 0.3, 0.3, 2.0):
        h.observe(v)
    for ns, name in DECOYS:
        ttft.labels(ns, name, "m").observe(30.0)
    # The text format, names as declared, as vLLM's and the twin's GET /metrics serve it whatever the
    # Accept header.  (prometheus_client's own negotiating server, like the one vLLM mounts under
    # /metrics/, answers Prometheus 2.x with OpenMetrics, where release 0.26 writes `vllm:x` as `vllm_x`;
    # the monitors' metric relabelling renames them back: test_monitor_relabeling_prometheus.)
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(reg)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def prom(exporter: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    rules_dir = tmp_path_factory.mktemp("rules")
    files = []
    for i, target in enumerate(TARGETS):
        path = rules_dir / f"rules-{i}.yaml"
        # The budget group every second (5m in production), so every rule is evaluated within the test.
        path.write_text(yamltext.dump(rule_file_for(target, RuleOptions(budget_interval="1s"))))
        files.append(path)
    with PrometheusServer([exporter], job="synthetic", rule_files=files) as server:
        server.wait_for_targets_up(1)
        yield server


def _assert_accepted(prom: PrometheusServer, expr: str) -> None:
    body = prom.api("query", {"query": expr}, method="POST")
    assert body.get("status") == "success", f"{body.get('errorType')}: {body.get('error')}\n{expr}"


def test_rule_expressions_parse_and_evaluate(prom: PrometheusServer) -> None:
    exprs = [e for t in TARGETS for e in all_expressions(rule_groups_for(t))]
    assert len(exprs) > 60
    for expr in exprs:
        _assert_accepted(prom, expr)


def test_dashboard_expressions_parse(prom: PrometheusServer) -> None:
    exprs = expressions(dashboard_all()) + expressions(dashboard_for(PLAIN)) + expressions(dashboard_for(EDGES))
    for expr in exprs:
        _assert_accepted(prom, resolve(expr, "prod", "llama", "1m"))
    # Grafana variable values are not escaped by Grafana: the dashboard is safe for plain names only.


def test_signal_queries_parse(prom: PrometheusServer) -> None:
    for target in TARGETS:
        for window in ("5m", "600s", "1h30m"):
            for expr in signal_queries(target.pods, target, window).values():
                _assert_accepted(prom, expr)


def test_loaded_rule_files_are_healthy(prom: PrometheusServer) -> None:
    """Prometheus loaded every generated group; each rule evaluates without error."""
    deadline = time.monotonic() + 20
    while True:
        body = prom.api("rules")
        assert body["status"] == "success"
        rules = [r for g in body["data"]["groups"] for r in g["rules"]]
        evaluated = [r for r in rules if not r.get("lastEvaluation", "0001").startswith("0001")]
        if len(rules) == sum(len(g["rules"]) for t in TARGETS for g in rule_groups_for(t)) and len(evaluated) == len(rules):
            break
        assert time.monotonic() < deadline, f"rules not all evaluated: {len(evaluated)}/{len(rules)}"
        time.sleep(0.5)
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad


def test_hostile_selector_matches_exactly_its_own_series(prom: PrometheusServer) -> None:
    sel = Selector.for_inferenceservice(HOSTILE_NS, HOSTILE_NAME)
    result = prom.wait_for(promql.requests_running(sel))
    assert [float(r["value"][1]) for r in result] == [7.0]  # not 7 + decoys, and no injected vector(1)
    raw = prom.query(f"{vllm.METRIC_RUNNING}{sel}")
    assert len(raw) == 1
    assert raw[0]["metric"]["namespace"] == HOSTILE_NS
    assert raw[0]["metric"][promql.ISVC_POD_LABEL] == HOSTILE_NAME
    kv = prom.query(promql.kv_cache_usage(sel, "max"))
    assert [float(r["value"][1]) for r in kv] == [0.25]


def test_injection_attempts_select_nothing(prom: PrometheusServer) -> None:
    prom.wait_for(f'{vllm.METRIC_RUNNING}{{namespace="x"}}')
    for ns, name in [('x"} or vector(1) or {a="', "y"), ("x", 'y"}) or vector(1) #'), ("x\\", "y"), ("x\n", "y")]:
        sel = Selector.for_inferenceservice(ns, name)
        assert prom.query(promql.requests_running(sel)) == []
        assert prom.query(promql.quantile("ttft", 0.99, sel)) == []
        assert prom.query(promql.error_ratio("ttft", 0.5, sel)) == []


def test_hostile_recordings_carry_the_names_verbatim(prom: PrometheusServer) -> None:
    sel = Selector.of(namespace=HOSTILE_NS, inferenceservice=HOSTILE_NAME)
    result = prom.wait_for(f"kvpilot:slo_objective{sel}")
    assert float(result[0]["value"][1]) == 0.999
    assert result[0]["metric"]["inferenceservice"] == HOSTILE_NAME


def test_reader_against_real_prometheus(prom: PrometheusServer) -> None:
    sel = Selector.for_inferenceservice(HOSTILE_NS, HOSTILE_NAME)
    prom.wait_for(f"{vllm.METRIC_TTFT}_count{sel}")
    reader = PrometheusReader(prom.url, timeout=5)
    assert reader.scalar(promql.requests_running(sel)) == 7.0
    with pytest.raises(PrometheusQueryError, match="bad_data"):
        reader.query("sum(rate(x[5m])")
    # The exporter's counters never move after the first scrape: no requests in the window.
    with pytest.raises(NoData, match="no requests in the last 10s"):
        read_signals(sel, "10s", slo=HOSTILE, reader=reader)


def test_cli_signals_exit_codes(prom: PrometheusServer, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpilot.cli import main

    assert main(["slo", "signals", "--prometheus", prom.url, "--selector", "namespace=nowhere", "--window", "10s"]) == 3
    assert "no requests in the last 10s" in capsys.readouterr().err
