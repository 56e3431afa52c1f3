"""The PrometheusRule generator: shape, names, labels, annotations, template safety."""

from __future__ import annotations

import json

import yaml

from kvpilot.api import InferenceService
from kvpilot.slo import rules, yamltext
from kvpilot.slo.objectives import RECORDED_WINDOWS, SloTarget
from kvpilot.slo.rules import RuleOptions, prometheus_rule_for, rule_groups_for, template_literal


def isvc(**spec: object) -> InferenceService:
    return InferenceService.model_validate(
        {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "prod"},
            "spec": {"model": "meta/llama", **spec},
        }
    )


def alerts(groups: list[dict]) -> list[dict]:
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_prometheus_rule_metadata() -> None:
    obj = prometheus_rule_for(isvc(), extra_labels={"release": "prometheus"})
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "PrometheusRule"
    meta = obj["metadata"]
    assert meta["name"] == "llama-slo" and meta["namespace"] == "prod"
    assert "ownerReferences" not in meta
    assert meta["labels"]["kvpilot.dev/inferenceservice"] == "llama"
    assert meta["labels"]["release"] == "prometheus"
    assert obj["spec"]["groups"] == rule_groups_for(isvc())


def test_recordings_cover_both_slis_over_every_window() -> None:
    recs = [r for g in rule_groups_for(isvc()) for r in g["rules"] if "record" in r]
    names = {r["record"] for r in recs}
    for sli in ("ttft", "itl"):
        for w in RECORDED_WINDOWS:
            assert f"kvpilot:slo_{sli}_error_ratio:rate{w}" in names
    assert {"kvpilot:slo_objective", "kvpilot:slo_ttft_threshold_seconds", "kvpilot:slo_itl_threshold_seconds"} <= names
    for r in recs:
        assert r["labels"] == {"namespace": "prod", "inferenceservice": "llama"}


def test_recordings_come_before_the_alerts_that_read_them() -> None:
    group, _budget = rule_groups_for(isvc())  # the alerts' group is evaluated in order
    kinds = ["record" if "record" in r else "alert" for r in group["rules"]]
    assert kinds == sorted(kinds, key=lambda k: k != "record")


def test_the_budget_left_is_recorded_per_sli_over_the_slo_period_in_a_slower_group_of_its_own() -> None:
    _, budget = rule_groups_for(isvc(slo={"objective": 0.999, "period": "7d"}), RuleOptions(budget_interval="10m"))
    assert budget["name"] == "kvpilot-slo-budget.prod.llama" and budget["interval"] == "10m"
    by_name = {r["record"]: r for r in budget["rules"]}
    assert set(by_name) == {"kvpilot:slo_ttft_error_budget_remaining:ratio", "kvpilot:slo_itl_error_budget_remaining:ratio"}
    ttft = by_name["kvpilot:slo_ttft_error_budget_remaining:ratio"]
    # Windows with no requests (NaN) are left out, not counted as perfect; the period is the service's.
    assert ttft["expr"] == ('1 - avg_over_time((kvpilot:slo_ttft_error_ratio:rate5m{namespace="prod",'
                            'inferenceservice="llama"} >= 0)[7d:10m]) / 0.001')
    assert ttft["labels"] == {"namespace": "prod", "inferenceservice": "llama"}


def test_burn_alerts_windows_severities_and_thresholds() -> None:
    burn = [a for a in alerts(rule_groups_for(isvc(slo={"objective": 0.999}))) if a["alert"].endswith("BudgetBurn")]
    got = sorted((a["alert"], a["labels"]["severity"], a["labels"]["long_window"], a["labels"]["short_window"]) for a in burn)
    assert len(got) == 8
    for name in ("InferenceServiceTTFTBudgetBurn", "InferenceServiceITLBudgetBurn"):
        assert [g[1:] for g in got if g[0] == name] == sorted(
            [("page", "1h", "5m"), ("page", "6h", "30m"), ("ticket", "1d", "2h"), ("ticket", "3d", "6h")]
        )
    page = next(a for a in burn if a["labels"]["long_window"] == "1h" and a["labels"]["slo"] == "ttft")
    assert page["expr"].count("/ 0.001 > 14.4") == 2
    assert "kvpilot:slo_ttft_error_ratio:rate1h{" in page["expr"] and "kvpilot:slo_ttft_error_ratio:rate5m{" in page["expr"]


def test_every_alert_has_summary_description_runbook_and_the_service() -> None:
    opts = RuleOptions(runbook_base_url="https://runbooks.example/kvpilot/")
    all_alerts = alerts(rule_groups_for(isvc(), opts))
    assert {a["alert"] for a in all_alerts} >= {
        rules.ALERT_KV_SATURATED, rules.ALERT_PREEMPTION_STORM, rules.ALERT_METRICS_ABSENT,
    }
    for a in all_alerts:
        ann = a["annotations"]
        assert ann["summary"] and ann["runbook"]
        assert "prod/llama" in ann["description"]
        assert ann["runbook_url"].startswith("https://runbooks.example/kvpilot#")
        assert a["labels"]["severity"] in ("page", "ticket", "warning")
        assert a["labels"]["inferenceservice"] == "llama"
        if a["alert"] != rules.ALERT_METRICS_ABSENT:
            assert "$value" in ann["description"], a["alert"]


def test_no_absent_alert_when_scaled_to_zero() -> None:
    names = {a["alert"] for a in alerts(rule_groups_for(isvc(replicas=0)))}
    assert rules.ALERT_METRICS_ABSENT not in names


def test_template_literal_only_wraps_what_templates_would_run() -> None:
    assert template_literal("plain-name") == "plain-name"
    wrapped = template_literal('a{{ "x" }}b')
    assert wrapped.startswith("{{ ") and wrapped.endswith(" }}")
    assert json.loads(wrapped[3:-3]) == 'a{{ "x" }}b'


def test_hostile_names_stay_values_in_rules() -> None:
    t = SloTarget(namespace='n"}', name="{{ .Value }}\n")
    groups = rule_groups_for(t)
    for a in alerts(groups):
        assert a["labels"]["inferenceservice"].startswith('{{ "')
    # Recording-rule labels are not templated: kept verbatim.
    rec = next(r for g in groups for r in g["rules"] if "record" in r)
    assert rec["labels"] == {"namespace": 'n"}', "inferenceservice": "{{ .Value }}\n"}


def test_yaml_round_trips_exactly() -> None:
    t = SloTarget(namespace="ns", name="we\\ird\n\"name\"")
    obj = prometheus_rule_for(t)
    assert yaml.safe_load(yamltext.dump(obj)) == obj
    text = yamltext.dump(prometheus_rule_for(isvc()))
    assert "expr: |-\n" in text  # multi-line alert expressions read as blocks
