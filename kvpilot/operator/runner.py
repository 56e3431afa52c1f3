"""Run the operator in-process through kopf's API (the `kopf run --standalone` equivalent)."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import kopf

from kvpilot.api.vocabulary import WEBHOOK_PATH
from kvpilot.operator.handlers import build_registry, credentials
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.metrics import OperatorMetrics, start_http
from kvpilot.operator.reconcile import Runtime
from kvpilot.operator.reviews import Predictor, Reviewer
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.webhook import WebhookServer

logger = logging.getLogger("kvpilot.operator")


def configure_logging(settings: OperatorSettings) -> None:
    kopf.configure(
        verbose=settings.verbose,
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
        log_prefix=settings.log_format != "json",
    )


async def run_operator(settings: OperatorSettings, predictor: Predictor | None = None) -> None:
    """Run until SIGINT/SIGTERM.  Raises CredentialsError at once when there is no cluster to talk to.

    `predictor` is the start-up prediction the admission webhook runs on every valid engine (the CLI
    passes the twin's, `kvpilot.cli.twin_predictor`); without one the webhook only validates."""
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
    webhook = None
    if settings.webhook_port is not None:
        try:
            webhook = await start_webhook(settings, rt.metrics, predictor)
        except BaseException:
            await http.close()
            await client.close()
            raise
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
    if webhook is not None:
        logger.info("kvpilot admission webhook on https://%s:%d%s", settings.webhook_host,
                    webhook.bound_port, WEBHOOK_PATH)
    try:
        await operator
    finally:
        if webhook is not None:
            await webhook.stop()
        await http.close()
        await client.close()


async def start_webhook(settings: OperatorSettings, metrics: OperatorMetrics,
                        predictor: Predictor | None = None) -> WebhookServer:
    """The admission webhook's HTTPS server, serving; OSError or ssl.SSLError (bad files, taken port) if not."""
    if not settings.webhook_cert_file or not settings.webhook_key_file:
        raise OSError("the admission webhook needs --webhook-cert-file and --webhook-key-file")
    server = WebhookServer(
        Reviewer(predictor=predictor), cert_file=Path(settings.webhook_cert_file),
        key_file=Path(settings.webhook_key_file), host=settings.webhook_host,
        port=settings.webhook_port or 0, reload_seconds=settings.webhook_cert_reload_seconds,
        on_result=metrics.count_admission)
    await server.start()
    return server
