"""The Grafana dashboard for InferenceServices, generated (never hand-edited).

`dashboard_for(isvc)` is one service's dashboard, `dashboard_all()` every service's (it needs the
PrometheusRule the operator emits).  The kvpilot series it reads: docs/architecture.md, "The Grafana
dashboard".
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.api import vllm, vocabulary
from kvpilot.slo import promql
from kvpilot.slo.objectives import BURN_ALERTS, SLI_SHORT, SLIS, Sli, SloTarget, target_for
from kvpilot.slo.promql import Matcher, Selector
from kvpilot.slo.rules import RECORD_OBJECTIVE, budget_remaining_record, threshold_record, worst_budget_left

if TYPE_CHECKING:
    from kvpilot.api import InferenceService

ENGINE_INFO = vocabulary.METRIC_ENGINE_INFO
TUNING_TRIALS = vocabulary.METRIC_TUNING_TRIALS_TOTAL
TUNING_BEST = vocabulary.METRIC_TUNING_BEST_VALUE
TUNING_CURRENT = vocabulary.METRIC_TUNING_CURRENT_TRIAL
TUNING_PAUSED = vocabulary.METRIC_TUNING_PAUSED
TUNING_BY_STRATEGY = (
    (vocabulary.METRIC_TUNING_TRIALS_STARTED_TOTAL, "started"),
    (vocabulary.METRIC_TUNING_PROMOTIONS_TOTAL, "promoted"),
    (vocabulary.METRIC_TUNING_PRUNED_TOTAL, "pruned"),
    (vocabulary.METRIC_TUNING_ROLLBACKS_TOTAL, "rolled back"),
)
DESIRED_REPLICAS = vocabulary.METRIC_DESIRED_REPLICAS
AUTOSCALING_DECISION = vocabulary.METRIC_AUTOSCALING_DECISION
REPLICA_GPUS = vocabulary.METRIC_REPLICA_GPUS
KVPILOT_METRICS = (ENGINE_INFO, TUNING_TRIALS, TUNING_BEST, TUNING_CURRENT, TUNING_PAUSED,
                   *(m for m, _ in TUNING_BY_STRATEGY), DESIRED_REPLICAS, AUTOSCALING_DECISION, REPLICA_GPUS)

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NS_VAR, ISVC_VAR = "$namespace", "$inferenceservice"
UID_ALL = "kvpilot-inferenceservices"


@dataclass(frozen=True)
class _Source:
    """Where the dashboard's numbers come from: the variables, plus the SLO (literal or recorded)."""

    target: SloTarget | None  # None: every service, SLO read from recorded series

    @property
    def pods(self) -> Selector:
        return Selector.for_inferenceservice(NS_VAR, ISVC_VAR)

    @property
    def ident(self) -> Selector:
        return Selector.of(namespace=NS_VAR, inferenceservice=ISVC_VAR)

    @property
    def kvpilot(self) -> Selector:
        return Selector.of(namespace=NS_VAR, name=ISVC_VAR)

    def threshold(self, sli: Sli) -> str:
        if self.target is not None:
            return f"vector({promql.num(self.target.threshold(sli))})"
        return f"max({threshold_record(sli)}{self.ident})"

    def budget(self) -> str:
        if self.target is not None:
            return promql.num(self.target.budget)
        return f"(1 - max({RECORD_OBJECTIVE}{self.ident}))"

    def error_ratio(self, sli: Sli, window: str) -> str:
        if self.target is not None:
            return promql.error_ratio(sli, self.target.threshold(sli), self.pods, window)
        return f"max(kvpilot:slo_{sli}_error_ratio:rate{window}{self.ident})"

    def burn_rate(self, sli: Sli, window: str) -> str:
        return f"({self.error_ratio(sli, window)}) / {self.budget()}"

    def worst_budget_left(self) -> str:
        return worst_budget_left(self.ident)

    @property
    def period(self) -> str:
        return self.target.period if self.target is not None else "30d"

    @property
    def period_title(self) -> str:
        """The SLO period in titles: the service's own (the rules record each service over its own)."""
        return self.target.period if self.target is not None else "SLO period"

    def budget_left(self, sli: Sli) -> str:
        """Share of the period's error budget not yet spent (negative: overspent)."""
        if self.target is not None:
            ratio = promql.error_ratio(sli, self.target.threshold(sli), self.pods, self.period)
            return f"1 - ({ratio}) / {self.budget()}"
        # The rules' own recording over the service's period: the figure the tuner's budget gate reads.
        return f"min({budget_remaining_record(sli)}{self.ident})"


def _target(expr: str, legend: str, ref: str, *, instant: bool = False, fmt: str = "time_series") -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
    if instant:
        t.update({"instant": True, "range": False})
    if fmt != "time_series":
        t["format"] = fmt
    return t


class _Layout:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def add(self, panel: dict[str, Any], w: int, h: int) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel["id"] = self.next_id
        self.next_id += 1
        panel["gridPos"] = {"x": self.x, "y": self.y, "w": w, "h": h}
        panel.setdefault("datasource", DATASOURCE)
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.panels.append(
            {"type": "row", "title": title, "id": self.next_id, "collapsed": False, "panels": [],
             "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}}
        )
        self.next_id += 1
        self.y += 1


def _timeseries(title: str, targets: list[dict[str, Any]], unit: str, description: str = "",
                overrides: list[dict[str, Any]] | None = None, **defaults: Any) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": overrides or []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi"}},
    }


def _dashed_red(name: str) -> dict[str, Any]:
    """Draw a series (an SLO line) as a dashed red line."""
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [
            {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "custom.fillOpacity", "value": 0},
        ],
    }


def _stat(title: str, expr: str, unit: str, thresholds: list[tuple[str, float | None]], description: str = "") -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "targets": [_target(expr, title, "A", instant=True)],
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "thresholds": {"mode": "absolute",
                               "steps": [{"color": c, "value": v} for c, v in thresholds]},
            },
            "overrides": [],
        },
        "options": {"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
    }


def _panels(src: _Source) -> list[dict[str, Any]]:
    lay = _Layout()
    _service_level_panels(lay, src)
    _engine_panels(lay, src)
    _fleet_panels(lay, src)
    _tuning_panels(lay, src)
    return lay.panels


def _service_level_panels(lay: _Layout, src: _Source) -> None:
    """The SLIs' p99s, error budgets and burn rates."""
    rate = "$__rate_interval"
    pods = src.pods
    lay.row("Service level")
    for sli in SLIS:
        short = SLI_SHORT[sli]
        lay.add(_stat(f"p99 {short} (5m)", promql.quantile(sli, 0.99, pods, "5m"), "s",
                      [("green", None)]), 4, 4)
    for sli in SLIS:
        short = SLI_SHORT[sli]
        lay.add(_stat(f"{short} error budget left ({src.period_title})", src.budget_left(sli), "percentunit",
                      [("red", None), ("orange", 0.25), ("green", 0.5)],
                      description="Share of the period's error budget not yet spent."), 4, 4)
    lay.add(_stat("Requests/s", promql.request_rate(pods, "5m"), "reqps", [("blue", None)]), 4, 4)
    lay.add(_stat("KV cache (max)", promql.kv_cache_usage(pods, "max"), "percentunit",
                  [("green", None), ("orange", 0.85), ("red", 0.95)]), 4, 4)

    for sli in SLIS:
        short = SLI_SHORT[sli]
        targets = [
            _target(promql.quantile(sli, q, pods, rate), f"p{round(q * 100)}", chr(ord("A") + i))
            for i, q in enumerate((0.5, 0.9, 0.99))
        ]
        targets.append(_target(src.threshold(sli), "SLO", "D"))
        lay.add(_timeseries(f"{short} p50 / p90 / p99 vs SLO", targets, "s",
                            f"{short} quantiles from vLLM's histogram; the dashed line is the SLO threshold.",
                            [_dashed_red("SLO")]), 12, 8)

    for sli in SLIS:
        short = SLI_SHORT[sli]
        targets = [_target(src.burn_rate(sli, w), f"{w} burn", chr(ord("A") + i))
                   for i, w in enumerate(("5m", "1h", "6h"))]
        targets.append(_target(f"vector({promql.num(BURN_ALERTS[0].factor(src.period))})", "page (1h)", "D"))
        targets.append(_target(f"vector({promql.num(BURN_ALERTS[1].factor(src.period))})", "page (6h)", "E"))
        lay.add(_timeseries(f"{short} burn rate", targets, "x",
                            "Error ratio / (1 - objective). 1 spends the budget exactly over the period; "
                            "the dashed lines are the page thresholds.",
                            [_dashed_red("page (1h)"), _dashed_red("page (6h)")]), 12, 8)


def _engine_panels(lay: _Layout, src: _Source) -> None:
    """vLLM's own gauges and rates, per replica."""
    rate = "$__rate_interval"
    pods = src.pods
    lay.row("Engine")
    lay.add(_timeseries("KV cache usage", [
        _target(f"{vllm.METRIC_KV_USAGE}{{{pods.render()}}} or {vllm.METRIC_KV_USAGE_LEGACY}{{{pods.render()}}}",
                "{{pod}}", "A")], "percentunit", "Per replica.", min=0, max=1), 8, 8)
    lay.add(_timeseries("Requests running / waiting", [
        _target(promql.requests_running(pods), "running", "A"),
        _target(promql.requests_waiting(pods), "waiting", "B")], "short"), 8, 8)
    lay.add(_timeseries("Preemptions/s", [_target(promql.preemption_rate(pods, rate), "preemptions", "A")],
                        "ops", "Requests evicted from the KV cache to be recomputed."), 8, 8)
    lay.add(_timeseries("Tokens/s", [
        _target(promql.prompt_token_rate(pods, rate), "prompt", "A"),
        _target(promql.generation_token_rate(pods, rate), "generation", "B")], "short"), 12, 8)
    lay.add(_timeseries("End-to-end latency", [
        _target(promql.quantile("e2e", q, pods, rate), f"p{round(q * 100)}", chr(ord("A") + i))
        for i, q in enumerate((0.5, 0.9, 0.99))], "s"), 12, 8)


def _fleet_panels(lay: _Layout, src: _Source) -> None:
    """The fleet against its load, and why the planner asked for the count it did (spec.autoscaling)."""
    pods = src.pods
    scaling = src.ident.render()  # the planner's series: namespace, inferenceservice
    serving = f"count({vllm.METRIC_RUNNING}{{{pods.render()}}})"
    gpus = f"max({REPLICA_GPUS}{{{scaling}}})"
    lay.row("Fleet")
    rate_axis = [{"matcher": {"id": "byName", "options": "requests/s"},
                  "properties": [{"id": "custom.axisPlacement", "value": "right"}, {"id": "unit", "value": "reqps"}]}]
    lay.add(_timeseries("GPUs against load", [
        _target(f"{serving} * {gpus}", "GPUs serving", "A"),
        _target(f"max({DESIRED_REPLICAS}{{{scaling}}}) * {gpus}", "GPUs the planner asks for", "B"),
        _target(promql.request_rate(pods, "$__rate_interval"), "requests/s", "C")], "short",
        "GPUs of the replicas serving (engines Prometheus scrapes, times kvpilot_replica_gpus) and of the count "
        "kvpilot's planner asks for, against the request rate (right axis). A service without spec.autoscaling "
        "has no planner series: only the rate shows.", rate_axis, min=0), 12, 8)
    lay.add(_timeseries("Planner decisions", [
        _target(f"max by (reason) ({AUTOSCALING_DECISION}{{{scaling}}}) > 0", "{{reason}}", "A"),
        _target(f"max({DESIRED_REPLICAS}{{{scaling}}})", "desired replicas", "B"),
        _target(serving, "serving replicas", "C")], "short",
        "The reason of the planner's last decision (LoadRising, FastBurn, LoadFell, ScaleDownStabilizing, "
        "BudgetLow, NoDemandData, ...: a line at 1 while it holds), with the replicas it asks for and those "
        "serving. The Scaling condition and the Events on the InferenceService carry the same reasons with "
        "their messages.", min=0), 12, 8)


def _tuning_panels(lay: _Layout, src: _Source) -> None:
    """The engine config in force, the tuning trials and the canary's tracks."""
    rate = "$__rate_interval"
    pods = src.pods
    lay.row("Configuration and tuning")
    lay.add({
        "type": "table",
        "title": "Engine config in force",
        "description": f"{ENGINE_INFO} (kvpilot operator) and {vllm.METRIC_CACHE_CONFIG} (vLLM), one row per series.",
        "targets": [
            _target(f"{ENGINE_INFO}{{{src.kvpilot.render()}}}", "", "A", instant=True, fmt="table"),
            _target(promql.cache_config(pods), "", "B", instant=True, fmt="table"),
        ],
        "transformations": [{"id": "merge", "options": {}},
                            {"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}}}],
        "fieldConfig": {"defaults": {}, "overrides": []},
    }, 24, 6)
    kv = src.kvpilot.render()
    lay.add(_timeseries("Tuning trials", [
        _target(f"sum by (state) ({TUNING_TRIALS}{{{kv}}})", "{{state}}", "A"),
        _target(f"max({TUNING_CURRENT}{{{kv}}})", "current trial", "B")], "short",
        "Finished trials by state, and the trial in progress."), 8, 8)
    lay.add(_timeseries("Best tuning value", [_target(f"max({TUNING_BEST}{{{kv}}})", "best", "A")], "short"), 8, 8)
    lay.add(_timeseries("Tuning held back", [
        _target(f"max by (reason) ({TUNING_PAUSED}{{{kv}}})", "{{reason}}", "A"),
        _target(src.worst_budget_left(), "budget left", "B")], "short",
        "1 while spec.tuning.budgetGate holds trials back (BudgetLow, BudgetUnknown, OutsideWindow); the best "
        "engine stays in force meanwhile. 'budget left' is the error budget left over the SLO period.",
        min=0), 8, 8)

    tracks = [(t, pods.with_matchers((Matcher(vocabulary.SERIES_LABEL_TRACK, t.value),))) for t in vocabulary.Track]
    refs = iter("ABCDEFGH")
    lay.add(_timeseries("Canary against stable: p99 TTFT / ITL", [
        _target(promql.quantile(sli, 0.99, sel, rate), f"{SLI_SHORT[sli]} {track.value}", next(refs))
        for sli in SLIS for track, sel in tracks], "s",
        "Each track's p99 during canary trials (series labelled kvpilot_dev_track): the trial engine on the "
        "canary track against the incumbent on the stable track, under the same load."), 8, 8)
    if src.target is not None:
        refs = iter("ABCDEFGH")
        lay.add(_timeseries("Canary against stable: burn rate (5m)", [
            _target(promql.burn_rate(sli, src.target.threshold(sli), src.target.objective, sel, "5m"),
                    f"{SLI_SHORT[sli]} {track.value}", next(refs))
            for sli in SLIS for track, sel in tracks], "x",
            "Each track's 5m burn rate; a canary at the fast-burn threshold (14.4x) is removed at once."), 8, 8)
    refs = iter("ABCDEFGH")
    lay.add(_timeseries("Trials by strategy", [
        _target(f"sum by (strategy) (increase({metric}{{{kv}}}[1h]))", f"{{{{strategy}}}} {what}", next(refs))
        for metric, what in TUNING_BY_STRATEGY], "short",
        "Trials started, promoted, pruned (fast burn) and rolled back per hour, by trial strategy."), 8, 8)


def _variables(target: SloTarget | None) -> list[dict[str, Any]]:
    def current(value: str | None) -> dict[str, Any]:
        return {"text": value, "value": value} if value is not None else {}

    running = vllm.METRIC_RUNNING
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        {"name": "namespace", "label": "Namespace", "type": "query", "datasource": DATASOURCE,
         "query": {"query": f"label_values({running}, namespace)", "refId": "ns"},
         "definition": f"label_values({running}, namespace)", "refresh": 2, "sort": 1,
         "current": current(target.namespace if target else None)},
        {"name": "inferenceservice", "label": "InferenceService", "type": "query", "datasource": DATASOURCE,
         "query": {"query": f'label_values({running}{{namespace="$namespace"}}, {promql.ISVC_POD_LABEL})',
                   "refId": "isvc"},
         "definition": f'label_values({running}{{namespace="$namespace"}}, {promql.ISVC_POD_LABEL})',
         "refresh": 2, "sort": 1, "current": current(target.name if target else None)},
    ]


def _dashboard(target: SloTarget | None) -> dict[str, Any]:
    src = _Source(target)
    if target is None:
        title, uid = "kvpilot / InferenceServices", UID_ALL
    else:
        title = f"kvpilot / {target.namespace} / {target.name}"
        # Grafana uids are at most 40 characters: a stable digest of namespace/name.
        uid = "kvpilot-" + hashlib.sha256(f"{target.namespace}/{target.name}".encode()).hexdigest()[:24]
    return {
        "uid": uid,
        "title": title,
        "tags": ["kvpilot", "vllm", "slo"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": _variables(target)},
        "annotations": {"list": []},
        "panels": _panels(src),
    }


def dashboard_for(isvc: InferenceService | SloTarget) -> dict[str, Any]:
    """One InferenceService's dashboard (its SLO from its spec)."""
    return _dashboard(target_for(isvc))


def dashboard_all() -> dict[str, Any]:
    """The dashboard for every InferenceService (SLO lines from the recorded SLO series)."""
    return _dashboard(None)


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of a dashboard's panels (variables left in, see `resolve`)."""
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def resolve(expr: str, namespace: str, name: str, rate_interval: str = "1m") -> str:
    """An expression with Grafana's variables filled in, as Grafana would send it to Prometheus."""
    return (
        expr.replace("$__rate_interval", rate_interval)
        .replace(NS_VAR, namespace)
        .replace(ISVC_VAR, name)
    )
