"""The Grafana dashboard generator."""

from __future__ import annotations

import json

from kvpilot.api import vllm
from kvpilot.slo.dashboard import KVPILOT_METRICS, dashboard_all, dashboard_for, expressions, resolve
from kvpilot.slo.objectives import SloTarget

TARGET = SloTarget(namespace="prod", name="llama", ttft_seconds=1.0, itl_seconds=0.1, objective=0.995)


def test_variables_and_datasource() -> None:
    board = dashboard_for(TARGET)
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "namespace", "inferenceservice"]
    ds = board["templating"]["list"][0]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert board["templating"]["list"][1]["current"]["value"] == "prod"
    assert board["templating"]["list"][2]["current"]["value"] == "llama"
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert len(board["uid"]) <= 40 and board["uid"] != dashboard_all()["uid"]


def test_panels_cover_what_sres_and_the_tuner_look_at() -> None:
    board = dashboard_for(TARGET)
    titles = " | ".join(p["title"] for p in board["panels"])
    for want in ("TTFT p50 / p90 / p99 vs SLO", "ITL p50 / p90 / p99 vs SLO", "TTFT burn rate", "ITL burn rate",
                 "error budget left", "KV cache usage", "Requests running / waiting", "Preemptions/s",
                 "Tokens/s", "Engine config in force", "Tuning trials", "GPUs against load", "Planner decisions"):
        assert want in titles, want
    exprs = "\n".join(expressions(board))
    assert "vector(1)" in exprs and "vector(0.1)" in exprs  # the SLO lines of this service
    assert vllm.METRIC_CACHE_CONFIG in exprs
    for metric in KVPILOT_METRICS:
        assert metric in exprs, metric


def test_all_services_board_reads_the_recorded_slo() -> None:
    exprs = "\n".join(expressions(dashboard_all()))
    assert "kvpilot:slo_ttft_threshold_seconds" in exprs and "kvpilot:slo_objective" in exprs
    assert 'namespace="$namespace"' in exprs and 'kvpilot_dev_inferenceservice="$inferenceservice"' in exprs


def test_layout_is_valid_and_ids_unique() -> None:
    board = dashboard_all()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
    json.dumps(board)  # serialisable


def test_resolve_fills_grafana_variables() -> None:
    expr = 'rate(x{namespace="$namespace",a="$inferenceservice"}[$__rate_interval])'
    assert resolve(expr, "ns", "n", "2m") == 'rate(x{namespace="ns",a="n"}[2m])'


def test_canary_panels_draw_each_track() -> None:
    board = dashboard_for(TARGET)
    titles = [p["title"] for p in board["panels"]]
    assert "Canary against stable: p99 TTFT / ITL" in titles and "Trials by strategy" in titles
    assert "Canary against stable: burn rate (5m)" in titles
    exprs = "\n".join(expressions(board))
    assert 'kvpilot_dev_track="canary"' in exprs and 'kvpilot_dev_track="stable"' in exprs
    assert "Canary against stable: burn rate (5m)" not in [p["title"] for p in dashboard_all()["panels"]]
