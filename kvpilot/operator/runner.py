"""The operator process: /healthz, /metrics and the admission webhook always; kopf's reconcile while
this process leads (always, without leader election; kvpilot.operator.leader, with it)."""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import kopf

from kvpilot.api.retry import Backoff
from kvpilot.api.vocabulary import WEBHOOK_PATH
from kvpilot.operator.handlers import CredentialsError, credentials
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.leader import LeaseElector
from kvpilot.operator.metrics import OperatorMetrics, start_http
from kvpilot.operator.reviews import Predictor, Reviewer
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.term import ReconcileTerm
from kvpilot.operator.webhook import WebhookServer

logger = logging.getLogger("kvpilot.operator")


def configure_logging(settings: OperatorSettings) -> None:
    kopf.configure(
        verbose=settings.verbose,
        log_format=kopf.LogFormat.JSON if settings.log_format == "json" else kopf.LogFormat.FULL,
        log_prefix=settings.log_format != "json",
    )


class OperatorStopped(Exception):
    """kopf ended while it should have been reconciling, or would not stop when leadership was lost."""


@dataclass
class Leadership:
    """What /healthz reads: a follower is healthy while it serves; a leader once kopf watches."""

    elector: LeaseElector | None = None
    term: ReconcileTerm | None = None

    def healthy(self) -> bool:
        if self.elector is not None and not self.elector.leading:
            return True
        return self.term is not None and self.term.ready.is_set() and self.term.running


async def run_operator(settings: OperatorSettings, predictor: Predictor | None = None) -> None:
    """Run until SIGINT/SIGTERM.  Raises CredentialsError at once when there is no cluster to talk to.

    `predictor` is the start-up prediction the admission webhook runs on every valid engine (the CLI
    passes the twin's, `kvpilot.cli.twin_predictor`); without one the webhook only validates.

    With leader election every replica serves the webhook, /healthz and /metrics, and only the Lease's
    holder runs kopf; without it, this process reconciles from the start."""
    info = credentials()  # fail fast and plainly; kopf would log the failure and wait for a signal
    metrics = OperatorMetrics()
    leadership = Leadership()
    # The HTTP endpoints first: a taken port fails the start before kopf touches the cluster.
    http = await start_http(metrics, settings.metrics_host, settings.metrics_port, healthy=leadership.healthy)
    webhook = None
    if settings.webhook_port is not None:
        try:
            webhook = await start_webhook(settings, metrics, predictor)
        except BaseException:
            await http.close()
            raise
    where = "all namespaces" if settings.all_namespaces else ", ".join(settings.watched_namespaces)
    logger.info("kvpilot operator watching %s; /healthz and /metrics on %s:%d",
                where, settings.metrics_host, settings.metrics_port)
    if webhook is not None:
        logger.info("kvpilot admission webhook on https://%s:%d%s", settings.webhook_host,
                    webhook.bound_port, WEBHOOK_PATH)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    election = settings.leader_election
    lease_client: KubeClient | None = None
    try:
        if not election.enabled:
            await _lead(settings, metrics, leadership, stopping)
        else:
            def relogin() -> None:
                try:
                    if lease_client is not None:
                        lease_client.set_credentials(credentials())
                except CredentialsError as exc:
                    logger.warning("cannot read the credentials again: %s", exc)

            lease_client = KubeClient(backoff=Backoff(retries=0), field_manager=settings.field_manager,
                                      timeout_s=election.timings.renew_deadline_seconds)
            lease_client.set_credentials(info)
            leadership.elector = LeaseElector(
                lease_client, namespace=election.lease_namespace or info.default_namespace or "default",
                name=election.lease_name, identity=election.identity or _identity(),
                timings=election.timings, rng=random.Random(settings.retry_seed),
                on_unauthorized=relogin)
            logger.info("contending for the lease %s/%s as %s", leadership.elector.namespace,
                        election.lease_name, leadership.elector.identity)
            await leadership.elector.run(
                lambda lost: _lead(settings, metrics, leadership, lost, stopping), stopping)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        if webhook is not None:
            await webhook.stop()
        await http.close()
        if lease_client is not None:
            await lease_client.close()


async def _lead(settings: OperatorSettings, metrics: OperatorMetrics, leadership: Leadership,
                lost: asyncio.Event, stopping: asyncio.Event | None = None) -> None:
    """Reconcile (one kopf term) until `lost` is set; then stop kopf and drop what it exported.
    Raises OperatorStopped when kopf ends by itself (its own error, if any, instead) or does not stop
    within one lease duration."""
    term = ReconcileTerm(settings, metrics)
    leadership.term = term
    metrics.leader.set(1)
    term.start()
    waits = [asyncio.create_task(term.finished.wait()), asyncio.create_task(lost.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        metrics.leader.set(0)
    if not term.finished.is_set():
        timeout = settings.leader_election.timings.stop_seconds
        if not await term.stop(timeout):
            raise OperatorStopped(f"kopf did not stop within {timeout:g}s of being asked to; exiting so that "
                                  "nothing more is written")
    metrics.clear_engines()  # the next leader exports them
    leadership.term = None
    if term.error is not None:
        raise term.error
    if not lost.is_set() and not (stopping is not None and stopping.is_set()):
        raise OperatorStopped("kopf stopped by itself")


def _identity() -> str:
    """client-go's choice: the host name (in a pod, the pod's name) made unique per process."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


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
