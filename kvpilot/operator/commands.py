"""`kvpilot operator` (run the operator) and `kvpilot render` (print what it would create)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from kvpilot.api.vocabulary import (
    ENV_ALLOWED_IMAGES,
    ENV_WEBHOOK_CERT_FILE,
    ENV_WEBHOOK_KEY_FILE,
    ENV_WEBHOOK_PORT,
    WEBHOOK_PATH,
)
from kvpilot.operator.builders.common import DEFAULT_TWIN_IMAGE
from kvpilot.operator.settings import LEASE_NAME


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535 (got {text!r})") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1-65535 (got {port})")
    return port


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum} (got {text!r})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum} (got {value})")
        return value

    return parse


_positive = _whole(1)
_count = _whole(0)


def _seconds(text: str) -> float:
    try:
        value = float(text.strip().removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text!r})") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 (got {text})")
    return value


def _whole_seconds(text: str) -> int:
    """Whole seconds, as a Lease's leaseDurationSeconds is; "15" or "15s"."""
    digits = text.strip().removesuffix("s")
    try:
        value = int(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 1 (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 1 (got {text!r})")
    return value


def _uid(text: str) -> int:
    try:
        uid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a numeric user id 1-2147483647 (got {text!r})") from None
    if not 1 <= uid <= 2147483647:
        raise argparse.ArgumentTypeError(f"must be a non-root numeric user id 1-2147483647 (got {uid})")
    return uid


def _label(text: str) -> tuple[str, str]:
    from kvpilot.api.kube import label_key_problem, label_value_problem

    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, e.g. release=kube-prometheus-stack (got {text!r})")
    problem = label_key_problem(key) or label_value_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return key, value


MONITOR_LABEL_HELP = ("a label for every ServiceMonitor, PodMonitor and PrometheusRule the operator creates "
                      "(repeatable), for a Prometheus that selects them by label: kube-prometheus-stack "
                      "selects release=<its release name> unless told to select all; kvpilot's own labels "
                      "win over these")


def register(subparsers: argparse._SubParsersAction) -> None:
    op = subparsers.add_parser(
        "operator",
        help="run the InferenceService operator (kopf, standalone)",
        description="Reconcile InferenceServices into vLLM (or engine twin) Deployments, Services, "
        "PodDisruptionBudgets, ServiceMonitors and PrometheusRules, with zero-downtime rollouts and "
        "rollback to the last good engine. Credentials: the in-cluster service account, else $KUBECONFIG "
        "or ~/.kube/config. Serves /healthz and Prometheus /metrics on --metrics-port.",
    )
    scope = op.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; glob patterns allowed); default: 'default'")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    op.add_argument("--twin-image", default=DEFAULT_TWIN_IMAGE, metavar="IMG",
                    help="kvpilot image for engine.kind twin (default: %(default)s)")
    op.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST",
                    help="address for /healthz and /metrics (default: %(default)s)")
    op.add_argument("--metrics-port", type=_port, default=8080, metavar="P",
                    help="port for /healthz and /metrics (default: %(default)s)")
    op.add_argument("--log-format", choices=("text", "json"), default="text",
                    help="log lines as text or as JSON objects (default: %(default)s)")
    op.add_argument("--max-workers", type=_positive, default=128, metavar="N",
                    help="objects reconciled at once; a burst beyond that waits its turn, bounding memory "
                    "(default: %(default)s)")
    op.add_argument("--api-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                    help="longest one Kubernetes API call may take before it counts as failed "
                    "(default: %(default)s)")
    op.add_argument("--api-retries", type=_count, default=5, metavar="N",
                    help="retries of one API call on 409, 429, 5xx, timeouts and dropped connections, with "
                    "exponential backoff and jitter, never sooner than a Retry-After (default: %(default)s)")
    op.add_argument("--retry-delay", type=_seconds, default=30.0, metavar="SECONDS",
                    help="wait before a reconcile or a rollback that failed after those retries runs again "
                    "(a rollback's wait then doubles up to 300 s; a longer Retry-After wins; "
                    "default: %(default)s)")
    op.add_argument("--retry-seed", type=int, default=None, metavar="N",
                    help="seed of the retries' jitter, for a reproducible run (default: from the OS)")
    op.add_argument("--crash-loop-restarts", type=_positive, default=3, metavar="N",
                    help="roll a new revision back at once when a pod's engine has restarted N times; vLLM's own "
                    "start-up failure text rolls it back at the first exit (default: %(default)s)")
    op.add_argument("--allowed-image", action="append", default=[], metavar="PATTERN",
                    help=f"a vLLM image tenants may run (repeatable; also ${ENV_ALLOWED_IMAGES}, comma-separated): a glob "
                    "over the full reference starting with the registry, e.g. docker.io/vllm/vllm-openai:* "
                    "or registry.example.com/*; others are refused with condition Degraded/ImageNotAllowed. "
                    "Default: any image")
    op.add_argument("--monitor-label", type=_label, action="append", default=[], metavar="KEY=VALUE",
                    help=MONITOR_LABEL_HELP)
    op.add_argument("--engine-run-as-user", type=_uid, default=None, metavar="UID",
                    help="run vLLM containers as this non-root uid, with HOME and /tmp on emptyDirs and a "
                    "read-only root (what the restricted Pod Security Standard needs); default: the "
                    "image's own user, with every capability dropped")
    hook = op.add_argument_group(
        "admission webhook",
        "Serve a validating admission webhook for InferenceServices (AdmissionReview admission.k8s.io/v1 "
        f"over HTTPS at {WEBHOOK_PATH}): the checks of `kvpilot validate`, vLLM's start-up predicted as by "
        "`kvpilot validate --predict` (an engine it would refuse is refused), and AdmissionReview warnings for "
        "risky settings. Off unless --webhook-port is given. The certificate files are read again when "
        "they change (a renewed certificate needs no restart). See docs/webhook.md.")
    hook.add_argument("--webhook-port", type=_port, default=None, metavar="P",
                      help=f"HTTPS port of the webhook (also ${ENV_WEBHOOK_PORT}); default: no webhook")
    hook.add_argument("--webhook-host", default="0.0.0.0", metavar="HOST",
                      help="address the webhook listens on (default: %(default)s)")
    hook.add_argument("--webhook-cert-file", default=None, metavar="FILE",
                      help=f"PEM serving certificate, chain included (also ${ENV_WEBHOOK_CERT_FILE}); "
                      "required with --webhook-port")
    hook.add_argument("--webhook-key-file", default=None, metavar="FILE",
                      help=f"PEM private key of that certificate (also ${ENV_WEBHOOK_KEY_FILE}); "
                      "required with --webhook-port")
    elect = op.add_argument_group(
        "leader election",
        "Run several replicas: every one serves the webhook, /healthz and /metrics, and only the holder of a "
        "coordination.k8s.io/v1 Lease reconciles, with client-go's rules (a leader that cannot renew within "
        "the renew deadline stops reconciling; a follower takes over once the lease duration has passed "
        "without a renewal, or at once when the leader shuts down cleanly). Off: this process reconciles.")
    elect.add_argument("--leader-elect", action="store_true",
                       help="reconcile only while holding the Lease (needs get, create and patch on leases)")
    elect.add_argument("--leader-elect-lease-duration", type=_whole_seconds, default=15, metavar="SECONDS",
                       help="how long followers wait after the last renewal before taking over "
                       "(default: %(default)s)")
    elect.add_argument("--leader-elect-renew-deadline", type=_seconds, default=10.0, metavar="SECONDS",
                       help="how long the leader keeps trying to renew before it stops reconciling; shorter than "
                       "the lease duration (default: %(default)s)")
    elect.add_argument("--leader-elect-retry-period", type=_seconds, default=2.0, metavar="SECONDS",
                       help="how often the leader renews and followers try to take over (default: %(default)s)")
    elect.add_argument("--leader-elect-resource-name", default=LEASE_NAME, metavar="NAME",
                       help="name of the Lease (default: %(default)s)")
    elect.add_argument("--leader-elect-resource-namespace", default="", metavar="NS",
                       help="namespace of the Lease (default: the operator's own, from its service account "
                       "or kubeconfig context, else 'default')")
    op.add_argument("-v", "--verbose", action="store_true", help="log more")
    # `predictor`: a factory of the webhook's start-up prediction, set by the CLI layer (kvpilot.cli), which
    # may import the twin; the operator does not.
    op.set_defaults(handler=_operator, predictor=None)

    render = subparsers.add_parser(
        "render",
        help="print the manifests the operator would create for an InferenceService",
        description="Render the Deployment, Service, PodDisruptionBudget, ServiceMonitor (or PodMonitor, "
        "per spec.observability.monitor) and PrometheusRule "
        "the operator creates for each InferenceService in FILE, as multi-document YAML, without a cluster. "
        "ownerReferences carry the object's metadata.uid when the file has one (the API server assigns it).",
    )
    render.add_argument("-f", "--filename", required=True, metavar="FILE", help="a YAML file, or - for stdin")
    render.add_argument("--twin-image", default=DEFAULT_TWIN_IMAGE, metavar="IMG",
                        help="kvpilot image for engine.kind twin (default: %(default)s)")
    render.add_argument("--monitor-label", type=_label, action="append", default=[], metavar="KEY=VALUE",
                        help="as `kvpilot operator --monitor-label`")
    render.add_argument("--engine-run-as-user", type=_uid, default=None, metavar="UID",
                        help="as `kvpilot operator --engine-run-as-user`")
    render.add_argument("--no-monitoring", action="store_true",
                        help="leave out ServiceMonitor, PodMonitor and PrometheusRule, as on a cluster without the "
                        "Prometheus Operator CRDs")
    render.set_defaults(handler=_render)

    check = subparsers.add_parser(
        "check",
        help="check an installed kvpilot: the operator answers /healthz, the InferenceService CRD is served",
        description="What the chart's `helm test` hook runs: GET OPERATOR-URL/healthz must answer 200, and the API "
        "server's discovery of kvpilot.dev/v1alpha1 must list inferenceservices (credentials: the in-cluster "
        "service account, else $KUBECONFIG or ~/.kube/config; discovery needs no RBAC). One line per check; "
        "exit 0 when both pass, 1 when one fails.",
    )
    check.add_argument("--operator-url", required=True, metavar="URL", type=_http_url,
                       help="the operator's /healthz and /metrics base URL, e.g. http://kvpilot-operator.kvpilot-system.svc:8080")
    check.add_argument("--timeout", type=_seconds, default=10.0, metavar="SECONDS",
                       help="longest each check may take (default: %(default)s)")
    check.set_defaults(handler=_check)


def _http_url(text: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL with a host (got {text!r})")
    return text


def _check(args: argparse.Namespace) -> int:
    import kopf

    from kvpilot.operator.check import EXIT_FAILED, EXIT_OK, api_discovery, check_crd_served, check_healthz

    healthz = check_healthz(args.operator_url, args.timeout)
    print(healthz.line(), flush=True)
    try:
        served = check_crd_served(api_discovery(args.timeout))
    except (OSError, ValueError, KeyError, TypeError, kopf.LoginError) as exc:
        print(f"kvpilot check: cannot read Kubernetes credentials: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(served.line())
    return EXIT_OK if healthz.ok and served.ok else EXIT_FAILED


def _operator(args: argparse.Namespace) -> int:
    import asyncio

    from kvpilot.api.retry import Backoff
    from kvpilot.operator.handlers import CredentialsError
    from kvpilot.operator.images import AllowlistError, ImageAllowlist
    from kvpilot.operator.leader import LeaseTimings
    from kvpilot.operator.runner import OperatorStopped, configure_logging, run_operator
    from kvpilot.operator.settings import LeaderElection, OperatorSettings

    try:
        allowed = ImageAllowlist.parse([os.environ.get(ENV_ALLOWED_IMAGES, ""), *args.allowed_image])
    except AllowlistError as exc:
        print(f"kvpilot operator: {exc}", file=sys.stderr)
        return 2
    try:
        webhook = _webhook_options(args)
    except ValueError as exc:
        print(f"kvpilot operator: {exc}", file=sys.stderr)
        return 2
    try:
        election = LeaderElection(
            enabled=args.leader_elect, lease_name=args.leader_elect_resource_name,
            lease_namespace=args.leader_elect_resource_namespace,
            timings=LeaseTimings(lease_duration_seconds=args.leader_elect_lease_duration,
                                 renew_deadline_seconds=args.leader_elect_renew_deadline,
                                 retry_period_seconds=args.leader_elect_retry_period))
    except ValueError as exc:
        print(f"kvpilot operator: {exc}", file=sys.stderr)
        return 2
    settings = OperatorSettings(
        **webhook, leader_election=election,
        namespaces=tuple(args.namespace), all_namespaces=args.all_namespaces, twin_image=args.twin_image,
        metrics_host=args.metrics_host, metrics_port=args.metrics_port, log_format=args.log_format,
        verbose=args.verbose, max_workers=args.max_workers, api_timeout_seconds=args.api_timeout,
        api_backoff=Backoff(retries=args.api_retries), retry_seed=args.retry_seed,
        handler_retry_delay_seconds=args.retry_delay,
        crash_loop_restarts=args.crash_loop_restarts,
        allowed_images=allowed, engine_run_as_user=args.engine_run_as_user,
        monitor_labels=tuple(args.monitor_label),
    )
    configure_logging(settings)
    try:
        asyncio.run(run_operator(settings, args.predictor() if args.predictor else None))
    except (OSError, CredentialsError, OperatorStopped) as exc:  # no credentials; a taken port; kopf ended
        print(f"kvpilot operator: {exc}", file=sys.stderr)
        return 1
    return 0


def _webhook_options(args: argparse.Namespace) -> dict[str, Any]:
    """The webhook's settings from the flags, each flag falling back to its environment variable."""
    port = args.webhook_port
    if port is None and os.environ.get(ENV_WEBHOOK_PORT, "").strip():
        try:
            port = _port(os.environ[ENV_WEBHOOK_PORT].strip())
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"${ENV_WEBHOOK_PORT} {exc}") from None
    cert = args.webhook_cert_file or os.environ.get(ENV_WEBHOOK_CERT_FILE) or None
    key = args.webhook_key_file or os.environ.get(ENV_WEBHOOK_KEY_FILE) or None
    if port is not None and not (cert and key):
        missing = [flag for flag, value in (("--webhook-cert-file", cert), ("--webhook-key-file", key))
                   if not value]
        raise ValueError(f"--webhook-port needs {' and '.join(missing)} (a PEM serving certificate and its key)")
    return {"webhook_port": port, "webhook_host": args.webhook_host,
            "webhook_cert_file": cert, "webhook_key_file": key}


def _render(args: argparse.Namespace) -> int:
    from kvpilot.api import yamlout
    from kvpilot.api.documents import DocumentError, read_source
    from kvpilot.api.validation import parse_text, strict_validate
    from kvpilot.operator.builders import RenderOptions, render_manifests

    try:
        data = read_source(args.filename)
    except OSError as exc:
        print(f"kvpilot render: cannot read {args.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except DocumentError as exc:
        print(f"{args.filename}: {exc}", file=sys.stderr)
        return 1
    parsed = parse_text(data)
    bad = [p.result for p in parsed if not p.result.valid]
    if bad:
        for result in bad:
            for issue in result.issues:
                print(f"{args.filename}: {result.label}: {issue}", file=sys.stderr)
        return 1
    options = RenderOptions(twin_image=args.twin_image, service_monitors=not args.no_monitoring,
                            pod_monitors=not args.no_monitoring, prometheus_rules=not args.no_monitoring,
                            engine_run_as_user=args.engine_run_as_user, monitor_labels=tuple(args.monitor_label))
    # One service at a time: a bundle of a thousand is 27 MB of YAML, never all in memory at once.
    first = True
    for p in parsed:
        text = yamlout.dump_all(render_manifests(strict_validate(p.obj), options))
        sys.stdout.write(text if first else "---\n" + text)
        first = False
    return 0
