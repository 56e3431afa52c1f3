"""The operator's settings: one typed object, filled from the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvpilot.api.retry import Backoff
from kvpilot.operator.builders.common import DEFAULT_TWIN_IMAGE
from kvpilot.operator.images import ImageAllowlist
from kvpilot.operator.leader import LeaseTimings

FIELD_MANAGER = "kvpilot-operator"
LEASE_NAME = "kvpilot-operator"


@dataclass(frozen=True, slots=True)
class LeaderElection:
    """Leader election on a Lease (kvpilot.operator.leader): off, the process reconciles from the start,
    as one replica must; on, only the Lease's holder does, and every replica serves the webhook."""

    enabled: bool = False
    lease_name: str = LEASE_NAME
    # "": the namespace of the operator's credentials (its pod's service account), else "default".
    lease_namespace: str = ""
    # "": the host name (a pod's name) and a random suffix, so a restarted pod is a new candidate.
    identity: str = ""
    timings: LeaseTimings = field(default_factory=LeaseTimings)

    def __post_init__(self) -> None:
        problems = self.timings.problems()
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()  # empty with all_namespaces=False means the "default" namespace
    all_namespaces: bool = False
    twin_image: str = DEFAULT_TWIN_IMAGE
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8080
    log_format: Literal["text", "json"] = "text"
    verbose: bool = False
    field_manager: str = FIELD_MANAGER
    # Prometheus Operator CRDs come and go rarely; rediscover them this often.
    discovery_ttl_seconds: float = 300.0
    # One API call of the operator's own (kopf's calls have kopf's settings): how long it may take,
    # and its retries on 409, 429, 5xx, timeouts and dropped connections (kvpilot.api.retry).
    api_timeout_seconds: float = 30.0
    api_backoff: Backoff = field(default_factory=Backoff)
    # Seed of the retries' jitter (reproducible runs); None draws one from the OS.
    retry_seed: int | None = None
    # Objects handled at once (kopf's per-object workers, per watched resource).  Beyond a few dozen
    # a burst only queues inside the operator: memory grows with every in-flight reconcile while the
    # API server (and this process's CPU) are the bottleneck anyway.
    max_workers: int = 128
    # kopf's delay before it runs a handler again after a transient failure (a longer Retry-After
    # from the API server wins).  Also the first delay before a Deployment event whose handling
    # failed (a rollback patch, a status write) is handled again from a fresh read; that delay
    # doubles, up to event_retry_cap_seconds, until it succeeds: a rollback is never dropped.
    handler_retry_delay_seconds: float = 30.0
    event_retry_cap_seconds: float = 300.0
    # A pod of a new revision whose engine restarted this often is crash-looping: roll back at once
    # rather than at the progress deadline.  vLLM's own start-up failure text needs no restarts at
    # all (builders.pods); this catches the rest (a crash without vLLM's words, an OOM kill).  Three:
    # the kubelet's back-off has then spent about 70 s (10 + 20 + 40), long past a flaky first start.
    crash_loop_restarts: int = 3
    # The vLLM images tenants may run (engine.kind vllm); empty allows any.  The twin's image is
    # twin_image above, the admin's own choice, and is not checked.
    allowed_images: ImageAllowlist = field(default_factory=ImageAllowlist)
    # Run vLLM engine containers as this numeric uid (runAsNonRoot, caches on emptyDirs), so they are
    # admitted where the "restricted" Pod Security Standard is enforced; None keeps the image's own
    # user (root in vllm/vllm-openai).  See builders/deployment.py for what each choice costs.
    engine_run_as_user: int | None = None
    # Labels put on every ServiceMonitor, PodMonitor and PrometheusRule the operator creates (--monitor-label),
    # for a Prometheus whose selectors ask for them (kube-prometheus-stack's release label).
    monitor_labels: tuple[tuple[str, str], ...] = ()
    # The validating admission webhook (kvpilot.operator.webhook): AdmissionReviews over HTTPS on
    # webhook_port; None serves none.  The PEM certificate (with its chain) and key are read again
    # whenever they change, checked every webhook_cert_reload_seconds.
    webhook_port: int | None = None
    webhook_host: str = "0.0.0.0"
    webhook_cert_file: str | None = None
    webhook_key_file: str | None = None
    webhook_cert_reload_seconds: float = 60.0
    leader_election: LeaderElection = field(default_factory=LeaderElection)

    @property
    def watched_namespaces(self) -> tuple[str, ...]:
        return () if self.all_namespaces else (self.namespaces or ("default",))

    @property
    def exact_namespaces(self) -> bool:
        """Watching namespaces named exactly (no kopf globs, negations or lists): nothing to discover."""
        return not self.all_namespaces and all(is_exact_namespace(ns) for ns in self.watched_namespaces)


def is_exact_namespace(pattern: str) -> bool:
    """Whether kopf takes `pattern` as one namespace's name rather than a pattern to match
    (kopf's own test: `*` and `?` globs, `!` negations and `,` lists make a pattern)."""
    return not set(pattern) & set("*?!,")
