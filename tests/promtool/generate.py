"""Generate the promtool rule tests checked in next to this file.

    python -m tests.promtool.generate          # rewrite the files in tests/promtool/
    promtool test rules tests/promtool/*.test.yaml

The rule files are the SLO rule generator's output for two example InferenceServices (a
plain one and one with hostile names).  The test files feed synthetic vLLM histograms that
burn the error budget at chosen multiples of each alert's threshold, and list exactly the
alerts that must be firing, computed here from an exact model of the error ratio over each
window (increase of the good-bucket counter over increase of the count, as `rate()` does
with samples on a 1-minute grid).  A scenario whose model value sits within 4% of a
threshold is refused, so no test depends on a rounding accident.

tests/unit/slo/test_promtool.py regenerates everything into a temporary directory, checks
it matches the checked-in files, and runs `promtool check rules` and `promtool test rules`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.api import vllm
from kvpilot.slo import promql, rules, yamltext
from kvpilot.slo.objectives import BURN_ALERTS, SLI_SHORT, BurnAlert, SloTarget

HERE = Path(__file__).resolve().parent
REQUESTS_PER_MIN = 120  # over both pods
MARGIN = 0.04

PLAIN = SloTarget(namespace="prod", name="llama", ttft_seconds=0.5, itl_seconds=0.05, objective=0.99, period="30d")
# Names no Kubernetes object could have, to prove quoting holds in PromQL and in templates.
HOSTILE = SloTarget(
    namespace='ns"} or vector(1) or {x="',
    name='we\\ird\n{{ printf "%s" "owned" }}}',
    ttft_seconds=1.0,
    itl_seconds=0.1,
    objective=0.999,
    period="30d",
)


def minutes(window: str) -> int:
    return int(promql.duration_seconds(window) // 60)


@dataclass
class Phase:
    minutes: int
    error_ratio: float  # share of requests slower than the SLO threshold in this phase


@dataclass
class Scenario:
    name: str
    sli: str
    phases: list[Phase]
    eval_minutes: int
    step: int = 1  # minutes between input samples (and between rule evaluations)
    legacy: bool = False

    def __post_init__(self) -> None:
        for m in [self.eval_minutes, *(ph.minutes for ph in self.phases)]:
            if m % self.step:
                raise ValueError(f"scenario {self.name}: {m}m is not a multiple of the {self.step}m step")

    def errors_per_step(self) -> list[float]:
        """Error ratio of the requests counted in each step, in order."""
        out: list[float] = []
        for ph in self.phases:
            out += [ph.error_ratio] * (ph.minutes // self.step)
        return out


def model_ratio(s: Scenario, window: str) -> float | None:
    """Error ratio over `window` at the evaluation time, as Prometheus computes it from the samples."""
    ratios = s.errors_per_step()
    t, w = s.eval_minutes // s.step, minutes(window)
    if w < s.step:
        return None  # fewer than two samples in the range: rate() returns nothing
    # Increment k goes from the sample at step k-1 to the one at step k; the range
    # [t-W, t] holds the samples of steps t-W..t, so the increments k in (t-W, t].
    ks = [k for k in range(max(1, t - w // s.step + 1), t + 1) if k - 1 < len(ratios)]
    if not ks:
        return None
    return sum(ratios[k - 1] for k in ks) / len(ks)


def expected_burns(target: SloTarget, s: Scenario) -> list[tuple[BurnAlert, float]]:
    """The burn alerts that fire at the evaluation time, with the long window's burn rate."""
    firing = []
    for alert in BURN_ALERTS:
        factor = alert.factor(target.period)
        burns = []
        for w in (alert.long_window, alert.short_window):
            r = model_ratio(s, w)
            burn = None if r is None else r / target.budget
            if burn is not None and abs(burn / factor - 1) < MARGIN:
                raise ValueError(f"scenario {s.name}: burn {burn:.3f} over {w} is too close to {factor}x")
            burns.append(burn)
        if all(b is not None and b > factor for b in burns):
            firing.append((alert, burns[0]))  # type: ignore[arg-type]
    return firing


def render(text: str, value: float | None) -> str:
    """Expand the few template actions the rule generator emits, as Prometheus would."""
    out: list[str] = []
    i = 0
    decoder = json.JSONDecoder()
    while True:
        j = text.find("{{", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = j + 2
        while text[k] == " ":
            k += 1
        if text[k] == '"':
            # A string constant: our Go escapes are a subset of JSON's.
            literal, k = decoder.raw_decode(text, k)
            out.append(literal)
            end = text.index("}}", k)
            assert text[k:end].strip() == "", text
        else:
            end = text.index("}}", k)
            out.append(_format_value(text[k:end].strip(), value))
        i = end + 2


def _format_value(action: str, value: float | None) -> str:
    assert value is not None, action
    if action == '$value | printf "%.2f"':
        if abs((value * 100) % 1 - 0.5) < 0.01:
            raise ValueError(f"{value} rounds ambiguously to two decimals")
        return f"{value:.2f}"
    if action == "$value | humanizePercentage":
        return f"{value * 100:.4g}%"
    raise ValueError(f"unexpected template action {action!r}")


def _labels(d: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}={promql.quote(v)}" for k, v in d.items()) + "}"


def _counter_values(per_min: list[float]) -> str:
    """promtool's expanding notation for a counter growing by per_min[i] in minute i+1."""
    parts: list[str] = []
    value = 0.0
    i = 0
    first = True
    while i < len(per_min):
        j = i
        while j < len(per_min) and per_min[j] == per_min[i]:
            j += 1
        step, n = per_min[i], j - i
        if first:
            parts.append(f"{promql.num(value)}+{promql.num(step)}x{n}")
            first = False
        else:
            parts.append(f"{promql.num(round(value + step, 6))}+{promql.num(step)}x{n - 1}")
        value = round(value + step * n, 6)
        i = j
    return " ".join(parts)


def histogram_series(target: SloTarget, s: Scenario) -> list[dict[str, str]]:
    if s.sli == "ttft":
        metric, edge = vllm.METRIC_TTFT, target.ttft_seconds
    else:
        metric, edge = (vllm.METRIC_ITL_LEGACY if s.legacy else vllm.METRIC_ITL), target.itl_seconds
    ratios = s.errors_per_step()
    out = []
    for pod in ("a", "b"):  # two replicas: the queries must pool them
        base = {"namespace": target.namespace, promql.ISVC_POD_LABEL: target.name, "model_name": "m", "pod": pod}
        per_pod = REQUESTS_PER_MIN / 2
        count = [per_pod] * len(ratios)
        good = [round(per_pod * (1 - r), 6) for r in ratios]
        out.append({"series": f"{metric}_count{_labels(base)}", "values": _counter_values(count)})
        out.append({"series": f"{metric}_bucket{_labels({**base, 'le': repr(float(edge))})}", "values": _counter_values(good)})
        # The +Inf bucket, as every real histogram has.
        out.append({"series": f"{metric}_bucket{_labels({**base, 'le': '+Inf'})}", "values": _counter_values(count)})
    return out


def _rule(groups: list[dict[str, Any]], alertname: str, **labels: str) -> dict[str, Any]:
    for g in groups:
        for r in g["rules"]:
            if r.get("alert") == alertname and all(r["labels"].get(k) == v for k, v in labels.items()):
                return r
    raise KeyError(alertname)


def exp_alert(rule: dict[str, Any], value: float | None, series_labels: dict[str, str]) -> dict[str, Any]:
    labels = {**series_labels, **{k: render(v, value) for k, v in rule["labels"].items()}}
    return {
        "exp_labels": labels,
        "exp_annotations": {k: render(v, value) for k, v in rule["annotations"].items()},
    }


def burn_test(target: SloTarget, groups: list[dict[str, Any]], s: Scenario) -> dict[str, Any]:
    short = SLI_SHORT[s.sli]
    alertname = rules.ALERT_BURN.format(sli=short)
    exp = []
    for alert, value in expected_burns(target, s):
        rule = _rule(groups, alertname, long_window=alert.long_window)
        exp.append(exp_alert(rule, value, dict(target.identity)))
    return {
        "name": s.name,
        "interval": f"{s.step}m",
        "input_series": histogram_series(target, s),
        "alert_rule_test": [{"eval_time": f"{s.eval_minutes}m", "alertname": alertname, "exp_alerts": exp}],
    }


def burn_scenarios(
    target: SloTarget, alerts: tuple[BurnAlert, ...], step: int, pad: int, legacy: bool = True
) -> list[Scenario]:
    """Scenarios per SLI and alert; `pad` (a multiple of the evaluation interval) spaces the phases."""
    out: list[Scenario] = []
    for sli in ("ttft", "itl"):
        for alert in alerts:
            f, b = alert.factor(target.period), target.budget
            long_m, short_m = minutes(alert.long_window), minutes(alert.short_window)
            tag = f"{sli} {alert.severity} {promql.num(f)}x over {alert.long_window} and {alert.short_window}"
            # Burning steadily just above / just below the threshold for the whole long window.
            out.append(Scenario(f"{tag}: fires at 1.05x threshold", sli, [Phase(long_m + pad, 1.05 * f * b)], long_m + pad, step))
            out.append(Scenario(f"{tag}: quiet at 0.95x threshold", sli, [Phase(long_m + pad, 0.95 * f * b)], long_m + pad, step))
            # A burn that stopped: the long window is still over, the short window has recovered.
            out.append(
                Scenario(
                    f"{tag}: quiet once the short window recovers",
                    sli,
                    [Phase(long_m, 2 * f * b), Phase(short_m + pad, 0.0)],
                    long_m + short_m + pad,
                    step,
                )
            )
            # Just above, but only since less than the long window: not yet.
            if alert.severity == "page":
                grace = long_m // 4
                out.append(
                    Scenario(
                        f"{tag}: not before the long window has burned",
                        sli,
                        [Phase(long_m, 0.0), Phase(grace, 1.3 * f * b)],
                        long_m + grace,
                        step,
                    )
                )
    if not legacy:
        return out
    # Pre-0.11 vLLM: the ITL SLI reads vllm:time_per_output_token_seconds.
    first = alerts[0]
    f, b, long_m = first.factor(target.period), target.budget, minutes(first.long_window)
    out.append(
        Scenario(
            f"itl on pre-0.11 metric names: {first.severity} {promql.num(f)}x fires",
            "itl",
            [Phase(long_m + pad, 1.05 * f * b)],
            long_m + pad,
            step,
            legacy=True,
        )
    )
    return out


def gauge_tests(target: SloTarget, groups: list[dict[str, Any]], options: rules.RuleOptions) -> list[dict[str, Any]]:
    base = {"namespace": target.namespace, promql.ISVC_POD_LABEL: target.name, "model_name": "m"}
    ident = dict(target.identity)
    tests = []
    kv = _rule(groups, rules.ALERT_KV_SATURATED)
    sat_min = minutes(options.kv_saturation_for)
    for metric in (vllm.METRIC_KV_USAGE, vllm.METRIC_KV_USAGE_LEGACY):
        hi = round(options.kv_saturation + 0.02, 4)
        lo = round(options.kv_saturation - 0.05, 4)
        tests.append(
            {
                "name": f"KV cache saturation on {metric}",
                "interval": "1m",
                "input_series": [
                    {"series": f"{metric}{_labels({**base, 'pod': 'a'})}", "values": f"{hi}x{sat_min + 10}"},
                    {"series": f"{metric}{_labels({**base, 'pod': 'b'})}", "values": f"{lo}x{sat_min + 10}"},
                    {"series": f"{vllm.METRIC_RUNNING}{_labels({**base, 'pod': 'a'})}", "values": f"1x{sat_min + 10}"},
                ],
                "alert_rule_test": [
                    # pending, not firing, before `for` has passed
                    {"eval_time": f"{sat_min - 5}m", "alertname": rules.ALERT_KV_SATURATED, "exp_alerts": []},
                    {"eval_time": f"{sat_min + 5}m", "alertname": rules.ALERT_KV_SATURATED, "exp_alerts": [exp_alert(kv, hi, ident)]},
                ],
            }
        )
    tests.append(
        {
            "name": "KV cache below saturation stays quiet",
            "interval": "1m",
            "input_series": [
                {"series": f"{vllm.METRIC_KV_USAGE}{_labels({**base, 'pod': 'a'})}", "values": f"{round(options.kv_saturation - 0.01, 4)}x{sat_min + 10}"},
            ],
            "alert_rule_test": [{"eval_time": f"{sat_min + 5}m", "alertname": rules.ALERT_KV_SATURATED, "exp_alerts": []}],
        }
    )
    storm = _rule(groups, rules.ALERT_PREEMPTION_STORM)
    storm_min = minutes(options.preemption_for)
    for ratio, fires in ((options.preemption_ratio * 2, True), (options.preemption_ratio / 2, False)):
        per_min_success = 60
        tests.append(
            {
                "name": f"preemption storm at {ratio:g} preemptions per request {'fires' if fires else 'stays quiet'}",
                "interval": "1m",
                "input_series": [
                    {"series": f"{vllm.METRIC_PREEMPTIONS}{_labels({**base, 'pod': 'a'})}", "values": f"0+{promql.num(per_min_success * ratio)}x{storm_min + 20}"},
                    {"series": f"{vllm.METRIC_REQUEST_SUCCESS}{_labels({**base, 'pod': 'a', 'finished_reason': 'stop'})}", "values": f"0+{per_min_success}x{storm_min + 20}"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": f"{storm_min + 10}m",
                        "alertname": rules.ALERT_PREEMPTION_STORM,
                        "exp_alerts": [exp_alert(storm, ratio, ident)] if fires else [],
                    }
                ],
            }
        )
    absent = _rule(groups, rules.ALERT_METRICS_ABSENT)
    absent_min = minutes(options.absent_for)
    absent_labels = {"namespace": target.namespace, promql.ISVC_POD_LABEL: target.name}
    tests.append(
        {
            "name": "metrics absent fires when nothing is scraped, quiet when the engine reports",
            "interval": "1m",
            "input_series": [
                # Another service's engine: must not count as this one's.
                {"series": f"{vllm.METRIC_RUNNING}{_labels({'namespace': 'other', promql.ISVC_POD_LABEL: target.name})}", "values": f"1x{absent_min + 10}"},
            ],
            "alert_rule_test": [
                {"eval_time": f"{absent_min + 5}m", "alertname": rules.ALERT_METRICS_ABSENT, "exp_alerts": [exp_alert(absent, 1.0, absent_labels)]},
            ],
        }
    )
    tests.append(
        {
            "name": "metrics present: no absent alert",
            "interval": "1m",
            "input_series": [
                {"series": f"{vllm.METRIC_RUNNING}{_labels({**base, 'pod': 'a'})}", "values": f"3x{absent_min + 10}"},
            ],
            "alert_rule_test": [{"eval_time": f"{absent_min + 5}m", "alertname": rules.ALERT_METRICS_ABSENT, "exp_alerts": []}],
        }
    )
    return tests


def build(target: SloTarget, stem: str, full: bool = True) -> dict[str, str]:
    """File name -> YAML text, for one target."""
    options = rules.RuleOptions()
    groups = rules.rule_groups_for(target, options)
    rule_file = f"{stem}.rules.yaml"
    header = "# Generated by `python -m tests.promtool.generate` from kvpilot.slo.rules; do not edit.\n"
    files = {rule_file: header + yamltext.dump(rules.rule_file_for(target, options))}
    by_window = {a.long_window: a for a in BURN_ALERTS}

    def test_file(alerts: list[str], step: int, every: int, gauges: bool = False, legacy: bool = False) -> str:
        scenarios = burn_scenarios(target, tuple(by_window[w] for w in alerts), step, every, legacy)
        for sc in scenarios:
            if sc.eval_minutes % every:
                raise ValueError(f"scenario {sc.name}: evaluated at {sc.eval_minutes}m, off the {every}m grid")
        tests = [burn_test(target, groups, s) for s in scenarios]
        if gauges:
            tests += gauge_tests(target, groups, options)
        doc = {"rule_files": [rule_file], "evaluation_interval": f"{every}m", "tests": tests}
        return header + yamltext.dump(doc)

    # promtool's cost is one evaluation of every rule per evaluation interval, so samples and
    # evaluations are as sparse as each window allows: burn alerts have no `for`, and their
    # recordings read the raw series, so evaluating less often changes no value.
    files[f"{stem}.page-1h.test.yaml"] = test_file(["1h"], step=1, every=5, gauges=True, legacy=True)
    if full:
        files[f"{stem}.page-6h.test.yaml"] = test_file(["6h"], step=5, every=30)
        files[f"{stem}.ticket.test.yaml"] = test_file(["1d", "3d"], step=10, every=60)
    return files


def build_all() -> dict[str, str]:
    # Hostile names need proving once per kind of rule, not for every window.
    return {**build(PLAIN, "slo"), **build(HOSTILE, "hostile", full=False)}


def write(directory: Path) -> list[Path]:
    paths = []
    for name, text in build_all().items():
        path = directory / name
        path.write_text(text)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in write(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(p)
