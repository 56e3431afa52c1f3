"""kvpilot's own alerts, as the chart renders them, run through Prometheus' promtool: the rules
parse, each alert fires on the series it is about and stays quiet on healthy ones, and every
metric they name is one the operator really exports.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from harness.chart import NAMESPACE, RELEASE, one, render

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')")

JOB = f"{RELEASE}-kvpilot-operator"


def _rule() -> dict[str, Any]:
    return one(render("monitoring"), "PrometheusRule")


def _alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in _rule()["spec"]["groups"] for r in g["rules"]}


@pytest.fixture
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run installs it)")
    return path


@pytest.fixture
def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvpilot-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": _rule()["spec"]["groups"]}, sort_keys=False))
    return path


def test_rules_pass_promtool_check(promtool: str, rules_file: Path) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 rules found" in result.stdout


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def test_alerts_fire_on_their_signal_and_not_before(promtool: str, rules_file: Path, tmp_path: Path) -> None:
    alerts = _alerts()
    target = {"job": JOB, "namespace": NAMESPACE}

    def expected(alert: str, annotations: dict[str, str] | None = None) -> list[dict[str, Any]]:
        rule = alerts[alert]
        return [{"exp_labels": rule["labels"], "exp_annotations": annotations or rule["annotations"]}]

    errors_description = alerts["KvpilotReconcileErrors"]["annotations"]["description"].replace(
        "{{ $value | humanizePercentage }}", "50%"
    )
    tests = [
        {  # The operator stops answering at minute 2; `for: 5m` -> firing from minute 7.
            "interval": "1m",
            "input_series": [_series("up", target, "1 1 0x15")],
            "alert_rule_test": [
                {"eval_time": "6m", "alertname": "KvpilotOperatorDown", "exp_alerts": []},
                {
                    "eval_time": "8m",
                    "alertname": "KvpilotOperatorDown",
                    "exp_alerts": expected("KvpilotOperatorDown"),
                },
            ],
        },
        {  # The target vanishes from discovery altogether: no `up` series at all.
            "interval": "1m",
            "input_series": [_series("up", {"job": "something-else", "namespace": NAMESPACE}, "1x15")],
            "alert_rule_test": [
                {
                    "eval_time": "8m",
                    "alertname": "KvpilotOperatorDown",
                    "exp_alerts": expected("KvpilotOperatorDown"),
                },
            ],
        },
        {  # Healthy: up, reconciles succeed, no rollbacks -> silence.
            "interval": "1m",
            "input_series": [
                _series("up", target, "1x30"),
                _series("kvpilot_reconciles_total", {**target, "result": "success"}, "0+60x30"),
                _series("kvpilot_reconciles_total", {**target, "result": "error"}, "0x30"),
                _series("kvpilot_rollbacks_total", target, "0x30"),
                _series("kvpilot_operator_leader", {**target, "pod": "a"}, "1x30"),
                _series("kvpilot_operator_leader", {**target, "pod": "b"}, "0x30"),
            ],
            "alert_rule_test": [
                {"eval_time": "25m", "alertname": name, "exp_alerts": []}
                for name in ("KvpilotOperatorDown", "KvpilotReconcileErrors", "KvpilotRollback",
                             "KvpilotOperatorNoLeader")
            ],
        },
        {  # The leader changes hands (a takeover within a scrape or two): silence.
            "interval": "1m",
            "input_series": [
                _series("kvpilot_operator_leader", {**target, "pod": "a"}, "1 1 1 0 0 0 0 0 0 0 0 0"),
                _series("kvpilot_operator_leader", {**target, "pod": "b"}, "0 0 0 0 1 1 1 1 1 1 1 1"),
            ],
            "alert_rule_test": [{"eval_time": "10m", "alertname": "KvpilotOperatorNoLeader", "exp_alerts": []}],
        },
        {  # Both replicas up from minute 3 on, neither leading: firing from minute 5 (`for: 2m`).
            "interval": "1m",
            "input_series": [
                _series("kvpilot_operator_leader", {**target, "pod": "a"}, "1 1 1 0x12"),
                _series("kvpilot_operator_leader", {**target, "pod": "b"}, "0x15"),
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "KvpilotOperatorNoLeader", "exp_alerts": []},
                {"eval_time": "6m", "alertname": "KvpilotOperatorNoLeader",
                 "exp_alerts": expected("KvpilotOperatorNoLeader")},
            ],
        },
        {  # Half the reconciles fail from the start; `for: 10m` after a 5m rate window fills.
            "interval": "1m",
            "input_series": [
                _series("up", target, "1x30"),
                _series("kvpilot_reconciles_total", {**target, "result": "success"}, "0+60x30"),
                _series("kvpilot_reconciles_total", {**target, "result": "error"}, "0+60x30"),
            ],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "KvpilotReconcileErrors", "exp_alerts": []},
                {
                    "eval_time": "20m",
                    "alertname": "KvpilotReconcileErrors",
                    "exp_alerts": expected(
                        "KvpilotReconcileErrors",
                        {
                            **alerts["KvpilotReconcileErrors"]["annotations"],
                            "description": errors_description,
                        },
                    ),
                },
            ],
        },
        {  # One rollback at minute 10: fires at once, clears once it leaves the 15m window.
            "interval": "1m",
            "input_series": [_series("kvpilot_rollbacks_total", target, "0x10 1x30")],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "KvpilotRollback", "exp_alerts": []},
                {
                    "eval_time": "12m",
                    "alertname": "KvpilotRollback",
                    "exp_alerts": expected("KvpilotRollback"),
                },
                {"eval_time": "30m", "alertname": "KvpilotRollback", "exp_alerts": []},
            ],
        },
    ]
    test_file = tmp_path / "kvpilot-rules.test.yaml"
    test_file.write_text(
        yaml.safe_dump(
            {"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": tests}, sort_keys=False
        )
    )
    result = subprocess.run(
        [promtool, "test", "rules", test_file.name], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_name_only_metrics_the_operator_exports() -> None:
    from prometheus_client import generate_latest

    from kvpilot.operator.metrics import OperatorMetrics

    exported = {
        m.group(1)
        for line in generate_latest(OperatorMetrics().registry).decode().splitlines()
        if (m := re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", line))
    }
    used = {
        name for rule in _alerts().values() for name in re.findall(r"\b(kvpilot_[a-z_]+)\b", rule["expr"])
    }
    assert used, "the alerts should be about kvpilot's own metrics"
    assert used <= exported, f"not exported by the operator: {sorted(used - exported)}"


def test_alerts_select_the_scraped_job() -> None:
    """The ServiceMonitor's target is the operator Service, so Prometheus labels it job=<Service name>."""
    service = one(render("monitoring"), "Service", "-operator")
    assert service["metadata"]["name"] == JOB
    for rule in _alerts().values():
        assert f'job="{JOB}"' in rule["expr"]


def test_the_service_monitor_keeps_the_inferenceservice_namespace_label() -> None:
    """kvpilot_engine_info{namespace,name} names the InferenceService's namespace; the scrape must
    not overwrite it with the operator pod's (the dashboard selects on it)."""
    from kvpilot.api.vocabulary import ENGINE_INFO_LABELS

    assert "namespace" in ENGINE_INFO_LABELS
    monitor = one(render("monitoring"), "ServiceMonitor")
    assert [e.get("honorLabels") for e in monitor["spec"]["endpoints"]] == [True]


def _kvpilot_series(registry: Any, target: dict[str, str], monitor: dict[str, Any]) -> dict[str, list[dict[str, str]]]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support import prometheus_operator as po

    out: dict[str, list[dict[str, str]]] = {"up": [target]}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            labels = po.series_labels(target, sample.labels, honor=po.honor_labels(monitor))
            out.setdefault(sample.name, []).append(labels)
    return out


def test_the_chart_monitor_gives_kvpilot_series_every_label_the_alerts_and_dashboard_select_on() -> None:
    """The chart's ServiceMonitor scrapes the operator and the tuner; the Prometheus Operator's rules
    (tests/support/prometheus_operator.py) say what labels their series get.  Every selector on a
    kvpilot_ series or `up` in the chart's alerts and in the dashboard finds a series: the labels it
    matches are there, with the values it asks for (the InferenceService's namespace, not the operator's)."""
    from prometheus_client import CollectorRegistry

    from kvpilot.operator.metrics import OperatorMetrics
    from kvpilot.slo import dashboard as dash
    from kvpilot.tuner.observe import TunerMetrics
    from tests.support import prometheus_operator as po
    from tests.support import promql_labels

    objects = render("monitoring")
    monitor = one(objects, "ServiceMonitor")
    operator = OperatorMetrics()
    operator.set_engine("team-a", "chat", {k: "1" for k in ("max_num_batched_tokens", "gpu_memory_utilization",
                                                            "max_num_seqs", "config_hash")})
    tuner_registry = CollectorRegistry()
    tuner_metrics = TunerMetrics(tuner_registry)
    tuner_metrics.publish_scaling("team-a", "chat", 3, "LoadRising", 2)  # the planner's, for spec.autoscaling
    tuner = tuner_metrics.observer("team-a", "chat")
    tuner.trial_started(0, None, "current")  # type: ignore[arg-type]
    tuner.trial_finished(0, None, "COMPLETE", None)  # type: ignore[arg-type]
    tuner.best_changed(SimpleNamespace(value=0.5))  # type: ignore[arg-type]
    scraped: dict[str, list[dict[str, str]]] = {}
    for component, registry in (("operator", operator.registry), ("tuner", tuner_registry)):
        pod = po.pod_from_template(one(objects, "Deployment", f"-{component}"), f"kvpilot-{component}-7c9-abcde")
        targets = po.monitor_targets(monitor, one(objects, "Service", f"-{component}"), pod)
        assert len(targets) == 1, f"the chart's ServiceMonitor makes {len(targets)} targets of the {component}"
        for name, series in _kvpilot_series(registry, targets[0], monitor).items():
            scraped.setdefault(name, []).extend(series)

    def kvpilot(name: str) -> bool:
        return name.startswith("kvpilot_") or name == "up"

    board = dash.dashboard_all()
    reads = [(r["expr"], set()) for r in _alerts().values()]
    reads += [(dash.resolve(t["expr"], "team-a", "chat"), set())
              for p in board["panels"] for t in p.get("targets", [])]
    assert promql_labels.count_checked(reads, kvpilot) >= 5
    found = promql_labels.problems(scraped, reads, checked=kvpilot)
    assert found == [], "\n".join(found)
