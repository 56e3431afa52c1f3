"""Run the operator in-process through kopf's API (the `kopf run --standalone` equivalent)."""

from __future__ import annotations

import asyncio
import logging
import random

import kopf

from kvpilot.operator.handlers import build_registry, credentials
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.metrics import OperatorMetrics, start_http
from kvpilot.operator.reconcile import Runtime
from kvpilot.operator.settings import OperatorSettings

logger = logging.getLogger("kvpilot.operator")


def configure_logging(settings: OperatorSettings) -> None:
    kopf.configure(
        verbose=settings.verbose,
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
        log_prefix=settings.log_format != "json",
    )


async def run_operator(settings: OperatorSettings) -> None:
    """Run until SIGINT/SIGTERM.  Raises CredentialsError at once when there is no cluster to talk to."""
    credentials()  # fail fast and plainly; kopf would log the failure and wait for a signal
    client = KubeClient(backoff=settings.api_backoff, field_manager=settings.field_manager,
                        timeout_s=settings.api_timeout_seconds, rng=random.Random(settings.retry_seed))
    rt = Runtime(settings=settings, client=client, metrics=OperatorMetrics())
    registry = build_registry(rt)
    ready = asyncio.Event()
    operator: asyncio.Task[None] | None = None
    # The HTTP endpoints first: a taken port fails the start before kopf touches the cluster.
    http = await start_http(rt.metrics, settings.metrics_host, settings.metrics_port,
                            healthy=lambda: ready.is_set() and operator is not None and not operator.done())
    operator = asyncio.create_task(kopf.operator(
        registry=registry,
        standalone=True,
        clusterwide=settings.all_namespaces,
        namespaces=settings.watched_namespaces,
        ready_flag=ready,
    ))
    where = "all namespaces" if settings.all_namespaces else ", ".join(settings.watched_namespaces)
    logger.info("kvpilot operator watching %s; /healthz and /metrics on %s:%d",
                where, settings.metrics_host, settings.metrics_port)
    try:
        await operator
    finally:
        await http.cleanup()
        await client.close()
