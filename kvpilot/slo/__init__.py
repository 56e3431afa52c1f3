"""Latency SLOs for InferenceServices: PromQL, burn-rate rules, dashboards, and live signals.

    from kvpilot.slo import Selector, SloTarget, prometheus_rule_for, read_signals

* `promql`: safe selectors (`Selector`) and the queries (quantiles, error ratios, burn rates...);
* `objectives`: `SloTarget` (what an SLO needs to know) and the burn-rate alert windows;
* `rules`: `rule_groups_for`, `prometheus_rule_for`, `rule_file_for`;
* `dashboard`: `dashboard_for`, `dashboard_all` (Grafana JSON);
* `signals`: `read_signals` -> `SignalSnapshot`, with `PrometheusUnreachable`,
  `PrometheusQueryError` and `NoData`.

Nothing here imports kopf or the Kubernetes client; prometheus-api-client is imported only
when signals are read.
"""

from kvpilot.slo.dashboard import dashboard_all, dashboard_for
from kvpilot.slo.objectives import BURN_ALERTS, BurnAlert, SloTarget
from kvpilot.slo.promql import Matcher, Selector
from kvpilot.slo.rules import RuleOptions, prometheus_rule_for, rule_file_for, rule_groups_for
from kvpilot.slo.signals import (
    NoData,
    PrometheusQueryError,
    PrometheusReader,
    PrometheusUnreachable,
    SignalsError,
    SignalSnapshot,
    read_signals,
    signal_queries,
)

__all__ = [
    "BURN_ALERTS",
    "BurnAlert",
    "Matcher",
    "NoData",
    "PrometheusQueryError",
    "PrometheusReader",
    "PrometheusUnreachable",
    "RuleOptions",
    "Selector",
    "SignalSnapshot",
    "SignalsError",
    "SloTarget",
    "dashboard_all",
    "dashboard_for",
    "prometheus_rule_for",
    "read_signals",
    "rule_file_for",
    "rule_groups_for",
    "signal_queries",
]
