"""Prometheus rules for one InferenceService: SLI recordings and the alerts SREs page on.

`rule_groups_for(isvc)` gives the rule groups (the `groups:` of a Prometheus rule file);
`prometheus_rule_for(isvc)` wraps them in a monitoring.coreos.com/v1 PrometheusRule the
operator emits next to the Deployment; `rule_file_for(isvc)` is the plain file promtool reads.

Recorded series are named `kvpilot:slo_<sli>_error_ratio:rate<window>` and labelled with
the target's `namespace` and `inferenceservice`, so every alert is a cheap comparison of
recordings and every InferenceService shares the same names.

Prometheus expands Go templates in alert labels and annotations.  A value that came from
the user (a name) is emitted through `template_literal`, so `{{` in it is printed, not run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.api import vocabulary
from kvpilot.slo import promql
from kvpilot.slo.objectives import (
    BURN_ALERTS,
    RECORDED_WINDOWS,
    SLI_SHORT,
    SLI_TITLES,
    SLIS,
    BurnAlert,
    Sli,
    SloTarget,
    target_for,
)

if TYPE_CHECKING:
    from kvpilot.api import InferenceService

RECORD_PREFIX = "kvpilot:slo_"
RECORD_OBJECTIVE = "kvpilot:slo_objective"
RECORD_THRESHOLD = "kvpilot:slo_{sli}_threshold_seconds"
RECORD_BUDGET_REMAINING = "kvpilot:slo_{sli}_error_budget_remaining:ratio"

ALERT_BURN = "InferenceService{sli}BudgetBurn"
ALERT_KV_SATURATED = "InferenceServiceKVCacheSaturated"
ALERT_PREEMPTION_STORM = "InferenceServicePreemptionStorm"
ALERT_METRICS_ABSENT = "InferenceServiceMetricsAbsent"


def error_ratio_record(sli: Sli, window: str) -> str:
    """Name of the recorded error ratio of an SLI over a window."""
    return f"{RECORD_PREFIX}{sli}_error_ratio:rate{promql.validate_duration(window)}"


def threshold_record(sli: Sli) -> str:
    return RECORD_THRESHOLD.format(sli=sli)


def budget_remaining_record(sli: Sli) -> str:
    """Share of the SLO period's error budget not yet spent (1: untouched, 0: spent, below 0: overspent)."""
    return RECORD_BUDGET_REMAINING.format(sli=sli)


def worst_budget_left(identity: promql.Selector) -> str:
    """The budget left of the worse SLI of the target `identity` selects (its recordings' labels): what
    the tuner's budget gate compares with minRemaining.  One selector over both names, because
    `a or b` would drop b's series, which carry a's labels."""
    names = "|".join(budget_remaining_record(sli) for sli in SLIS)
    return f"min({{__name__=~{promql.quote(names)},{identity.render()}}})"


@dataclass(frozen=True)
class RuleOptions:
    """Knobs for the non-SLO alerts, and where runbooks live."""

    kv_saturation: float = 0.95  # KV-cache usage (0..1) of the busiest replica
    kv_saturation_for: str = "15m"
    preemption_ratio: float = 0.1  # preemptions per finished request
    preemption_for: str = "10m"
    absent_for: str = "10m"
    runbook_base_url: str | None = None  # e.g. https://docs.example.com/kvpilot/runbooks
    # How often the error budget left over the whole period is recomputed: a 30-day subquery is
    # the one costly rule, and a budget moves slowly, so it runs in a group of its own this often.
    budget_interval: str = "5m"


def go_string(value: str) -> str:
    """A Go (text/template) double-quoted string literal holding `value`."""
    # PromQL strings are Go strings, so the same escaping holds.
    return promql.quote(value)


def template_literal(value: str) -> str:
    """`value` as text that Prometheus's template expansion prints unchanged.

    Plain text passes through Go templates as is, unless it contains the action delimiter
    `{{`; such a value is printed through a string constant action instead.
    """
    if "{{" in value or "}}" in value:
        return "{{ " + go_string(value) + " }}"
    return value


def _ident(target: SloTarget) -> str:
    """`namespace/name`, safe in templates."""
    return template_literal(f"{target.namespace}/{target.name}")


def _target_labels(target: SloTarget) -> dict[str, str]:
    return {k: template_literal(v) for k, v in target.identity.items()}


def _runbook(options: RuleOptions, anchor: str) -> dict[str, str]:
    if options.runbook_base_url:
        return {"runbook_url": f"{options.runbook_base_url.rstrip('/')}#{anchor}"}
    return {}


# --- recordings -------------------------------------------------------------------------


def recording_rules(target: SloTarget) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    labels = dict(target.identity)  # recording-rule labels are not templated
    for sli in SLIS:
        for window in RECORDED_WINDOWS:
            rules.append(
                {
                    "record": error_ratio_record(sli, window),
                    "expr": promql.error_ratio(sli, target.threshold(sli), target.pods, window),
                    "labels": dict(labels),
                }
            )
    # The SLO itself, as series: dashboards draw SLO lines and budgets from them for any service.
    rules.append({"record": RECORD_OBJECTIVE, "expr": f"vector({promql.num(target.objective)})", "labels": dict(labels)})
    for sli in SLIS:
        rules.append(
            {"record": threshold_record(sli), "expr": f"vector({promql.num(target.threshold(sli))})", "labels": dict(labels)}
        )
    return rules


def budget_rules(target: SloTarget, options: RuleOptions) -> list[dict[str, Any]]:
    """The error budget left over the SLO period, per SLI (what the tuner's budget gate and the
    dashboard read).  The period's error ratio is the average of the 5m recordings over the period,
    sampled every budget_interval (time-weighted, as Sloth and Pyrra record it); windows with no
    requests (a NaN ratio) are left out rather than counted as perfect.  No series at all until the
    service has had traffic: a budget nobody can read is not a full one."""
    sel = target.identity_selector
    step = promql.validate_duration(options.budget_interval)
    period = promql.validate_duration(target.period)
    labels = dict(target.identity)
    return [
        {
            "record": budget_remaining_record(sli),
            "expr": f"1 - avg_over_time(({error_ratio_record(sli, '5m')}{sel} >= 0)[{period}:{step}]) "
            f"/ {promql.num(target.budget)}",
            "labels": dict(labels),
        }
        for sli in SLIS
    ]


# --- alerts -----------------------------------------------------------------------------


def burn_alert_expr(target: SloTarget, sli: Sli, alert: BurnAlert) -> str:
    """Both windows burn faster than the alert's factor; the value is the long window's burn rate."""
    sel = target.identity_selector
    factor = alert.factor(target.period)
    budget = target.budget
    long_ = f"{error_ratio_record(sli, alert.long_window)}{sel} / {promql.num(budget)} > {promql.num(factor)}"
    short = f"{error_ratio_record(sli, alert.short_window)}{sel} / {promql.num(budget)} > {promql.num(factor)}"
    return f"{long_}\nand\n{short}"


def burn_alert_rule(target: SloTarget, sli: Sli, alert: BurnAlert, options: RuleOptions) -> dict[str, Any]:
    factor = alert.factor(target.period)
    short, title = SLI_SHORT[sli], SLI_TITLES[sli]
    events = "requests with time to first token" if sli == "ttft" else "inter-token gaps"
    slo_text = f"{target.objective * 100:g}% of {events} at or under {target.threshold(sli):g}s over {target.period}"
    spend = f"{alert.budget_fraction * 100:g}% of the {target.period} error budget in {alert.long_window}"
    description = (
        f"InferenceService {_ident(target)}: {title} burns its error budget {{{{ $value | printf \"%.2f\" }}}}x "
        f"faster than sustainable over {alert.long_window} (and still above {factor:g}x over the last "
        f"{alert.short_window}); at {factor:g}x it spends {spend}. SLO: {slo_text}."
    )
    runbook = (
        f"Check p99 {short} and queueing on the service's dashboard (kvpilot slo dashboard). "
        "Causes seen most: load above capacity (requests waiting, KV cache full, preemptions) -> add replicas "
        "or shed load; a recent engine change (tuner trial or rollout) -> compare status.engineArgs with "
        "status.lastGoodEngine and roll back; long prompts hogging the step budget -> lower "
        "maxNumBatchedTokens or set longPrefillTokenThreshold"
        + (" (TTFT)." if sli == "ttft" else "; a large maxNumBatchedTokens lengthens every decode step (ITL).")
    )
    return {
        "alert": ALERT_BURN.format(sli=short),
        "expr": burn_alert_expr(target, sli, alert),
        "labels": {
            "severity": alert.severity,
            "slo": sli,
            "long_window": alert.long_window,
            "short_window": alert.short_window,
            **_target_labels(target),
        },
        "annotations": {
            "summary": f"{short} error budget of {_ident(target)} burning at over {factor:g}x ({alert.severity})",
            "description": description,
            "runbook": runbook,
            **_runbook(options, f"{short.lower()}-budget-burn"),
        },
    }


def kv_saturation_rule(target: SloTarget, options: RuleOptions) -> dict[str, Any]:
    usage = promql.kv_cache_usage(target.pods, agg="max")
    return {
        "alert": ALERT_KV_SATURATED,
        "expr": f"({usage}) > {promql.num(options.kv_saturation)}",
        "for": options.kv_saturation_for,
        "labels": {"severity": "warning", **_target_labels(target)},
        "annotations": {
            "summary": f"KV cache of {_ident(target)} nearly full",
            "description": (
                f"InferenceService {_ident(target)}: the busiest replica's KV cache is "
                f"{{{{ $value | humanizePercentage }}}} used (alert above {options.kv_saturation:.0%} for "
                f"{options.kv_saturation_for}). New requests wait for blocks and running ones get preempted."
            ),
            "runbook": (
                "Raise gpuMemoryUtilization (or kvCacheMemoryBytes) if the GPU has room, lower maxNumSeqs or "
                "maxModelLen, use kvCacheDtype fp8, or add replicas. Watch requests waiting and preemptions."
            ),
            **_runbook(options, "kv-cache-saturated"),
        },
    }


def preemption_storm_rule(target: SloTarget, options: RuleOptions) -> dict[str, Any]:
    preempt = promql.preemption_rate(target.pods, "5m")
    finished = promql.request_rate(target.pods, "5m")
    # Preemptions per finished request: scale-free, and +Inf (firing) when nothing finishes at all.
    return {
        "alert": ALERT_PREEMPTION_STORM,
        "expr": f"({preempt}) / ({finished}) > {promql.num(options.preemption_ratio)}",
        "for": options.preemption_for,
        "labels": {"severity": "warning", **_target_labels(target)},
        "annotations": {
            "summary": f"Preemption storm on {_ident(target)}",
            "description": (
                f"InferenceService {_ident(target)}: {{{{ $value | printf \"%.2f\" }}}} preemptions per finished "
                f"request over 5m (alert above {options.preemption_ratio:g} for {options.preemption_for}). "
                "Preempted requests recompute their prefill, so TTFT and throughput suffer."
            ),
            "runbook": (
                "The KV cache is too small for the running batch: lower maxNumSeqs, raise gpuMemoryUtilization, "
                "lower maxNumBatchedTokens (its profiling peak takes KV memory), or add replicas."
            ),
            **_runbook(options, "preemption-storm"),
        },
    }


def metrics_absent_rule(target: SloTarget, options: RuleOptions) -> dict[str, Any]:
    return {
        "alert": ALERT_METRICS_ABSENT,
        "expr": f"absent({promql.metrics_present(target.pods)})",
        "for": options.absent_for,
        "labels": {"severity": "page", **_target_labels(target)},
        "annotations": {
            "summary": f"No vLLM metrics from {_ident(target)}",
            "description": (
                f"InferenceService {_ident(target)} has {target.replicas} replica(s) in its spec but Prometheus "
                f"has scraped no vLLM metrics from it for {options.absent_for}: the SLO cannot be measured and "
                "burn-rate alerts cannot fire."
            ),
            "runbook": (
                f"Check the pods (kubectl get pods -l {vocabulary.LABEL_INFERENCESERVICE}=NAME), their readiness "
                "and logs; then the monitor (spec.observability.monitor: the ServiceMonitor or PodMonitor of the "
                "same name; with None, your own scrape config) and Prometheus's targets page: the series must "
                f"carry the pod label {vocabulary.LABEL_INFERENCESERVICE} as {vocabulary.SERIES_LABEL_INFERENCESERVICE} "
                "(the monitor's podTargetLabels)."
            ),
            **_runbook(options, "metrics-absent"),
        },
    }


def alerting_rules(target: SloTarget, options: RuleOptions) -> list[dict[str, Any]]:
    rules = [burn_alert_rule(target, sli, alert, options) for sli in SLIS for alert in BURN_ALERTS]
    rules.append(kv_saturation_rule(target, options))
    rules.append(preemption_storm_rule(target, options))
    if target.replicas > 0:  # scaled to zero: no metrics is expected
        rules.append(metrics_absent_rule(target, options))
    return rules


def rule_groups_for(
    isvc: InferenceService | SloTarget, options: RuleOptions | None = None
) -> list[dict[str, Any]]:
    """The rule groups for one InferenceService (recordings first: alerts read them)."""
    target = target_for(isvc)
    options = options or RuleOptions()
    # One group: Prometheus evaluates the rules of a group in order, so every alert reads the
    # recordings of the same evaluation (separate groups run concurrently and lag by a cycle).
    return [
        {
            "name": f"kvpilot-slo.{target.namespace}.{target.name}",
            "rules": recording_rules(target) + alerting_rules(target, options),
        },
        {
            "name": f"kvpilot-slo-budget.{target.namespace}.{target.name}",
            "interval": options.budget_interval,
            "rules": budget_rules(target, options),
        },
    ]


def rule_file_for(isvc: InferenceService | SloTarget, options: RuleOptions | None = None) -> dict[str, Any]:
    """A plain Prometheus rule file (`promtool check rules` reads it)."""
    return {"groups": rule_groups_for(isvc, options)}


def prometheus_rule_for(
    isvc: InferenceService | SloTarget,
    options: RuleOptions | None = None,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A monitoring.coreos.com/v1 PrometheusRule named `<isvc>-slo` (no ownerReferences: the operator adds them).

    `extra_labels` is for the label a Prometheus's ruleSelector wants (e.g. `release: prometheus`).
    """
    target = target_for(isvc)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": f"{target.name}-slo",
            "namespace": target.namespace,
            "labels": {
                vocabulary.LABEL_NAME: "kvpilot",
                vocabulary.LABEL_COMPONENT: "slo",
                vocabulary.LABEL_MANAGED_BY: vocabulary.MANAGED_BY,
                vocabulary.LABEL_INSTANCE: target.name,
                vocabulary.LABEL_INFERENCESERVICE: target.name,
                **(extra_labels or {}),
            },
        },
        "spec": {"groups": rule_groups_for(target, options)},
    }


def all_expressions(groups: list[dict[str, Any]]) -> list[str]:
    """Every PromQL expression in some rule groups (for checking them against a real Prometheus)."""
    return [rule["expr"] for group in groups for rule in group["rules"]]
