"""The operator's own /healthz and Prometheus /metrics, served by aiohttp next to kopf."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvpilot.api.vocabulary import (
    ENGINE_INFO_LABELS,
    METRIC_ADMISSION_REVIEWS_TOTAL,
    METRIC_ENGINE_INFO,
    METRIC_OPERATOR_LEADER,
    METRIC_RECONCILE_DURATION,
    METRIC_RECONCILES_TOTAL,
    METRIC_ROLLBACKS_TOTAL,
)
from kvpilot.operator.listener import BoundedListener

RESULTS = ("success", "invalid", "error", "retry")
# The admission webhook's results (kvpilot.operator.reviews.RESULTS; restated so this module
# stays free of the review code, and a test checks both say the same).
ADMISSION_RESULTS = ("allowed", "warned", "invalid", "predicted_failure", "bad_review")


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.reconciles = Counter(
            METRIC_RECONCILES_TOTAL, "InferenceService reconciles, by result "
            "(success, invalid: InvalidSpec or ImageNotAllowed, error: permanent failure, retry: transient failure).",
            ["result"], registry=self.registry)
        for result in RESULTS:
            self.reconciles.labels(result=result)  # export zeros so rate() works from the start
        self.duration = Histogram(
            METRIC_RECONCILE_DURATION, "Time to reconcile one InferenceService.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry)
        self.rollbacks = Counter(
            METRIC_ROLLBACKS_TOTAL, "Rollouts that passed their progress deadline and were put back to lastGoodEngine.",
            registry=self.registry)
        self.engine_info = Gauge(
            METRIC_ENGINE_INFO, "The engine config in force for an InferenceService (its Deployment's pod "
            "template): one series per InferenceService, value 1.",
            list(ENGINE_INFO_LABELS), registry=self.registry)
        self.admission_reviews = Counter(
            METRIC_ADMISSION_REVIEWS_TOTAL, "AdmissionReviews the validating webhook answered, by result "
            "(allowed, warned: allowed with warnings, invalid: a field refused, predicted_failure: vLLM "
            "would not start, bad_review: a malformed review answered 400-class).",
            ["result"], registry=self.registry)
        self._admission = {r: self.admission_reviews.labels(result=r) for r in ADMISSION_RESULTS}
        self.leader = Gauge(
            METRIC_OPERATOR_LEADER, "1 while this replica runs the reconcile (it holds the leader Lease, or "
            "runs without leader election), else 0; every replica serves the admission webhook.",
            registry=self.registry)
        # (namespace, name) -> the label values of its one engine_info series.
        self._engine_series: dict[tuple[str, str], tuple[str, ...]] = {}

    def set_engine(self, namespace: str, name: str, engine: dict[str, str] | None) -> None:
        """Export `engine` (the non-key labels of ENGINE_INFO_LABELS) as the service's only series;
        None removes it.  A changed engine replaces the old series instead of adding one."""
        key = (namespace, name)
        values = None if engine is None else (namespace, name, *(engine[k] for k in ENGINE_INFO_LABELS[2:]))
        old = self._engine_series.get(key)
        if old == values:
            return
        if old is not None:
            self.engine_info.remove(*old)
            del self._engine_series[key]
        if values is not None:
            self.engine_info.labels(*values).set(1)
            self._engine_series[key] = values

    def count_admission(self, result: str) -> None:
        self._admission[result].inc()

    def forget_engine(self, namespace: str, name: str) -> None:
        self.set_engine(namespace, name, None)

    def clear_engines(self) -> None:
        """Drop every engine_info series: a replica that stops leading no longer knows the engines,
        and two replicas exporting them would count each engine twice."""
        for namespace, name in list(self._engine_series):
            self.set_engine(namespace, name, None)


# The metrics port's bounds: kubelet's probes and a Prometheus or two are its clients.  aiohttp's
# own default keeps an idle or half-sent connection for an hour, and accepts without limit.
HTTP_IDLE_TIMEOUT_SECONDS = 30.0
HTTP_MAX_CONNECTIONS = 64


async def start_http(metrics: OperatorMetrics, host: str, port: int, healthy: Callable[[], bool], *,
                     idle_timeout_seconds: float = HTTP_IDLE_TIMEOUT_SECONDS,
                     max_connections: int = HTTP_MAX_CONNECTIONS) -> BoundedListener:
    """Serve /healthz (200 while `healthy()`: kopf watching, or a follower ready to take over; 503
    otherwise) and /metrics (GET or HEAD); `close()` the listener returned to stop.  A connection idle, or without a whole request head,
    for idle_timeout_seconds is closed; at most max_connections are open at once."""

    async def handle(request: web.BaseRequest) -> web.Response:
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="GET only\n", headers={"Allow": "GET, HEAD"})
        if request.path == "/healthz":
            ok = healthy()
            return web.Response(status=200 if ok else 503, text="ok\n" if ok else "not ready\n")
        if request.path == "/metrics":
            body = await asyncio.to_thread(generate_latest, metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
        return web.Response(status=404, text="not found: /healthz and /metrics are served\n")

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    try:
        listener = BoundedListener(handle, sock, max_connections=max_connections,
                                   idle_timeout_seconds=idle_timeout_seconds, access_log=None)
    except BaseException:
        sock.close()
        raise
    listener.start()
    return listener
