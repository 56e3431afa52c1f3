"""`kvpilot slo ...`: print SLO rules, dashboards and PromQL; read live signals from Prometheus.

Heavy imports stay inside the handlers so `kvpilot --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXAMPLES = """\
examples:
  kvpilot slo rules -f isvc.yaml                     # PrometheusRule (monitoring.coreos.com/v1)
  kvpilot slo rules -f isvc.yaml --format rulefile > rules.yaml && promtool check rules rules.yaml
  kvpilot slo dashboard --all > kvpilot.json         # Grafana dashboard for every InferenceService
  kvpilot slo query -f isvc.yaml --window 10m        # the PromQL behind each signal
  kvpilot slo signals --prometheus http://127.0.0.1:9090 --selector job=twin --window 600s
"""


def register(subparsers: Any) -> None:
    slo = subparsers.add_parser(
        "slo",
        help="SLO rules, dashboards and PromQL for InferenceServices; read live signals",
        description=(
            "Latency SLOs of InferenceServices, the way SREs page on them: multi-window "
            "multi-burn-rate PrometheusRules, a Grafana dashboard, the PromQL behind every "
            "signal, and a one-shot reader of those signals from a Prometheus."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = slo.add_subparsers(dest="slo_command", metavar="SUBCOMMAND", required=True)

    rules = sub.add_parser(
        "rules",
        help="print the SLO recording and alerting rules of an InferenceService (YAML)",
        description=(
            "Print recording rules for the TTFT and ITL error ratios over 5m..3d, burn-rate alerts "
            "(page 14.4x 1h&5m, 6x 6h&30m; ticket 3x 1d&2h, 1x 3d&6h for a 30d period), and KV-cache "
            "saturation, preemption-storm and metrics-absent alerts."
        ),
    )
    _add_file(rules)
    rules.add_argument(
        "--format",
        choices=("prometheusrule", "rulefile"),
        default="prometheusrule",
        help="prometheusrule: a monitoring.coreos.com/v1 PrometheusRule per service (default); "
        "rulefile: a plain Prometheus rule file (promtool check rules)",
    )
    rules.add_argument("--runbook-url", metavar="URL", help="base URL of the runbooks (adds runbook_url annotations)")
    rules.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra PrometheusRule metadata label, e.g. release=prometheus (repeatable)",
    )
    rules.set_defaults(handler=_rules)

    dash = sub.add_parser(
        "dashboard",
        help="print the Grafana dashboard JSON (one service, or every service)",
        description=(
            "Print a Grafana dashboard: p99 TTFT and ITL against their SLO lines, burn rates, error "
            "budget left, KV-cache usage, running/waiting, preemptions, tokens/s, the engine config "
            "in force and tuning trials.  With -f, for that InferenceService; with --all, for any "
            "(chosen by variables; reads the SLO series the rules record)."
        ),
    )
    which = dash.add_mutually_exclusive_group(required=True)
    which.add_argument("-f", "--filename", metavar="FILE", help="InferenceService YAML ('-' for stdin)")
    which.add_argument("--all", action="store_true", help="one dashboard for every InferenceService")
    dash.add_argument("-o", "--output", default="json", metavar="FORMAT",
                      help="json (the default: the dashboard model Grafana imports); write a file with > FILE. "
                           "A file name here (the older -o FILE) still writes it, with a warning")
    dash.set_defaults(handler=_dashboard)

    query = sub.add_parser(
        "query",
        help="print the PromQL for an InferenceService's signals",
        description="Print, by name, the PromQL kvpilot reads for an InferenceService (or a selector).",
    )
    _add_target(query, file_required=False)
    query.add_argument("--window", default="5m", help="range of rates and quantiles (default %(default)s)")
    query.add_argument("-o", "--output", choices=("text", "json"), default="text",
                       help="text (default) or json: one JSON object")
    query.add_argument("--json", dest="output", action="store_const", const="json",
                       help=argparse.SUPPRESS)  # the older spelling of -o json
    query.set_defaults(handler=_query)

    signals = sub.add_parser(
        "signals",
        help="read one snapshot of the signals from a Prometheus",
        description=(
            "Query a Prometheus once and print p99 TTFT and ITL, burn rates, rates, KV usage and "
            "preemptions over a window.  Exit 3 when the window holds no requests, 2 when Prometheus "
            "is unreachable or refuses a query."
        ),
    )
    _add_target(signals, file_required=False)
    signals.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus base URL, e.g. http://127.0.0.1:9090")
    signals.add_argument("--window", default="5m", help="range of rates and quantiles (default %(default)s)")
    signals.add_argument("--at", type=float, metavar="UNIX_SECONDS", help="evaluation time (default: now)")
    signals.add_argument("--timeout", type=float, default=10.0, help="seconds per query (default %(default)s)")
    signals.add_argument("-o", "--output", choices=("text", "json"), default="text",
                       help="text (default) or json: one JSON object")
    signals.add_argument("--json", dest="output", action="store_const", const="json",
                       help=argparse.SUPPRESS)  # the older spelling of -o json
    signals.set_defaults(handler=_signals)


def _add_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", required=True, metavar="FILE", help="InferenceService YAML ('-' for stdin)")


def _add_target(p: argparse.ArgumentParser, file_required: bool) -> None:
    p.add_argument("-f", "--filename", metavar="FILE", help="InferenceService YAML ('-' for stdin)")
    p.add_argument(
        "--selector",
        action="append",
        default=[],
        metavar="LABEL=VALUE",
        help="select series by label instead of the service's pods, e.g. job=twin (repeatable)",
    )
    p.add_argument("--ttft", type=float, help="TTFT SLO in seconds (default: the file's, else 0.5)")
    p.add_argument("--itl", type=float, help="ITL SLO in seconds (default: the file's, else 0.05)")
    p.add_argument("--objective", type=float, help="SLO objective (default: the file's, else 0.99)")


class UsageError(Exception):
    """Bad input: printed as `error: ...`, exit 2."""


def load_services(path: str) -> list[Any]:
    """Every InferenceService in a YAML file, validated; UsageError lists the problems by field.

    Other kinds in the same file (a Secret, a Namespace...) are skipped, as `kubectl apply -f`
    bundles often hold them.
    """
    from kvpilot.api import KIND, validate_object
    from kvpilot.api.documents import DocumentError, load_documents, read_source
    from kvpilot.api.validation import strict_validate

    try:
        docs = list(load_documents(read_source(path)))
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    except DocumentError as exc:
        where = f"document {exc.document + 1}: " if exc.document is not None else ""
        raise UsageError(f"{path}: {where}{exc}") from None
    services = [(i, d) for i, d in enumerate(docs) if not isinstance(d, dict) or d.get("kind", KIND) == KIND]
    if not services:
        raise UsageError(f"{path}: no InferenceService found ({len(docs)} document(s) of other kinds)")
    problems = [f"{path}: document {i + 1}: {issue}" for i, d in services for issue in validate_object(d)]
    if problems:
        raise UsageError("invalid InferenceService:\n  " + "\n  ".join(problems))
    return [strict_validate(d) for _, d in services]


def _target(args: argparse.Namespace) -> tuple[Any, Any]:
    """(SloTarget, Selector) from -f and/or --selector and SLO overrides."""
    from kvpilot.slo.objectives import SloTarget
    from kvpilot.slo.promql import Selector

    labels: dict[str, str] = {}
    for item in args.selector:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--selector {item!r}: expected LABEL=VALUE, e.g. job=twin")
        labels[key] = value
    overrides = {k: v for k, v in (("ttft_seconds", args.ttft), ("itl_seconds", args.itl), ("objective", args.objective)) if v is not None}
    if args.filename:
        services = load_services(args.filename)
        if len(services) != 1:
            raise UsageError(f"{args.filename}: expected one InferenceService, found {len(services)}")
        base = SloTarget.from_isvc(services[0])
        fields = {f: getattr(base, f) for f in ("namespace", "name", "ttft_seconds", "itl_seconds", "objective", "period", "replicas")}
    elif labels:
        fields = {"namespace": "local", "name": "local"}
    else:
        raise UsageError("give an InferenceService with -f FILE, or series labels with --selector LABEL=VALUE")
    try:
        selector = Selector.of(labels) if labels else None
        target = SloTarget(**{**fields, **overrides, "selector": selector})
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    return target, target.pods


def _error(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _rules(args: argparse.Namespace) -> int:
    from kvpilot.slo import yamltext
    from kvpilot.slo.rules import RuleOptions, prometheus_rule_for, rule_file_for

    try:
        services = load_services(args.filename)
        extra: dict[str, str] = {}
        for item in args.label:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise UsageError(f"--label {item!r}: expected KEY=VALUE")
            extra[key] = value
        options = RuleOptions(runbook_base_url=args.runbook_url)
        # One service at a time, as `kvpilot render` does: the rules of a thousand are 21 MB of YAML,
        # never all in memory at once.  The first is made before anything is written, so a bad option
        # prints nothing but its error.
        for i, isvc in enumerate(services):
            if args.format == "rulefile":
                # The groups of every service under one `groups:` key, the same text as one dump of them all.
                text = ("groups:\n" if i == 0 else "") + yamltext.dump(rule_file_for(isvc, options)["groups"])
            else:
                text = ("---\n" if i else "") + yamltext.dump(prometheus_rule_for(isvc, options, extra))
            sys.stdout.write(text)
    except (UsageError, ValueError) as exc:
        return _error(str(exc))
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from kvpilot.slo.dashboard import dashboard_all, dashboard_for

    try:
        if args.all:
            board = dashboard_all()
        else:
            services = load_services(args.filename)
            if len(services) != 1:
                raise UsageError(f"{args.filename}: expected one InferenceService, found {len(services)}")
            board = dashboard_for(services[0])
    except (UsageError, ValueError) as exc:
        return _error(str(exc))
    text = json.dumps(board, indent=2) + "\n"
    if args.output != "json":
        # -o is the output format, as in kubectl and the other commands; a path was the older spelling.
        print(f"Warning: kvpilot slo dashboard: -o {args.output}: -o takes the output format (json); "
              f"write the file with `kvpilot slo dashboard ... > {args.output}`", file=sys.stderr)
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as exc:
            return _error(f"cannot write {args.output}: {exc.strerror or exc}")
    else:
        sys.stdout.write(text)
    return 0


def _query(args: argparse.Namespace) -> int:
    from kvpilot.slo import promql
    from kvpilot.slo.signals import signal_queries

    try:
        target, selector = _target(args)
        queries = signal_queries(selector, target, args.window)
        for hist in ("ttft", "itl", "e2e"):
            for q in (0.5, 0.9):
                queries[f"{hist}_p{round(q * 100)}_seconds"] = promql.quantile(hist, q, selector, args.window)
        queries["e2e_p99_seconds"] = promql.quantile("e2e", 0.99, selector, args.window)
        queries["requests_running"] = promql.requests_running(selector)
        queries["requests_waiting"] = promql.requests_waiting(selector)
    except (UsageError, ValueError) as exc:
        return _error(str(exc))
    if args.output == "json":
        print(json.dumps(queries, indent=2))
    else:
        for name, expr in queries.items():
            print(f"# {name}\n{expr}\n")
    return 0


def _signals(args: argparse.Namespace) -> int:
    from kvpilot.slo.signals import NoData, SignalsError, read_signals

    try:
        target, selector = _target(args)
        snap = read_signals(selector, args.window, slo=target, prometheus_url=args.prometheus,
                            at=args.at, timeout=args.timeout)
    except NoData as exc:
        return _error(str(exc), 3)
    except (SignalsError, UsageError, ValueError) as exc:
        return _error(str(exc))
    data = snap.to_dict()
    if args.output == "json":
        print(json.dumps(data, indent=2))
    else:
        width = max(len(k) for k in data)
        for key, value in data.items():
            shown = "n/a (no observations)" if value is None else (f"{value:.6g}" if isinstance(value, float) else value)
            print(f"{key:<{width}}  {shown}")
    return 0
