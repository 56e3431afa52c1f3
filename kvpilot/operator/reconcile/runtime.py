"""What the handlers share in one operator process (`Runtime`): the per-InferenceService locks, the
status basis, and the Deployment events to handle again; and the retries it asks kopf for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvpilot.operator.apply import MonitoringDiscovery
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.settings import OperatorSettings

Logger = logging.Logger | logging.LoggerAdapter[Any]

# emit(type, reason, message): an Event on the InferenceService being handled.
Emit = Callable[[str, str, str], None]
# emit_on(object, type, reason, message): an Event on the object given.
EmitOn = Callable[[dict[str, Any], str, str, str], None]


class HandleAgain(Exception):
    """Handling a Deployment event failed; it is to be handled again in `delay` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__(f"handle again in {delay:.1f}s")
        self.delay = delay


@dataclass
class Runtime:
    """Everything the handlers share in one operator process."""

    settings: OperatorSettings
    client: KubeClient
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    discovery: MonitoringDiscovery = field(init=False)
    # InferenceService uids already told that monitoring objects are skipped (the Event is sent once).
    skip_noted: set[str] = field(default_factory=set)
    # One lock per InferenceService (namespace/name): a reconcile and a Deployment event of the
    # same object never interleave (docs/architecture.md, "The reconcile and its status writes").
    # NOTE: kopf serialises the handlers of one object only; this lock spans the parent, its Deployments and pods.
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # namespace/name -> resourceVersion of the Deployment its status was last computed from: an
    # event for that same version (our own create or patch coming back) has nothing new to say.
    # NOTE: read inside the lock (a reconcile holding it sets it), so not a kopf `when=` filter, which runs before.
    status_basis: dict[str, str] = field(default_factory=dict)
    # namespace/name -> the pending second try of a Deployment event whose handling failed, and the
    # failed tries so far (the delay grows with them; a success resets them).
    # NOTE: kopf never runs an event handler again (errors ignored), and a change handler would annotate Deployments.
    event_retries: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    event_retry_attempts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.discovery = MonitoringDiscovery(self.client, ttl=self.settings.discovery_ttl_seconds)

    def retry_later(self, message: str, retry_after: float | None) -> kopf.TemporaryError:
        """A transient failure outlasted the client's retries: kopf runs the handler again after
        handler_retry_delay_seconds, or the API server's Retry-After where that is longer."""
        return kopf.TemporaryError(message, delay=max(self.settings.handler_retry_delay_seconds, retry_after or 0.0))

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault(f"{namespace}/{name}", asyncio.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The InferenceService (or its Deployment) is gone: drop what the process keeps for it.
        A lock in use stays; an unused one is made again when needed."""
        key = f"{namespace}/{name}"
        lock = self.locks.get(key)
        if lock is not None and not lock.locked():
            del self.locks[key]
        self.status_basis.pop(key, None)
        self.cancel_event_retry(key)
        self.event_retry_attempts.pop(key, None)
        self.metrics.forget_engine(namespace, name)

    def next_event_retry_delay(self, key: str, retry_after: float | None) -> float:
        """The delay before the next try of a failed Deployment event: handler_retry_delay_seconds,
        doubling per failed try up to event_retry_cap_seconds, with jitter; at least a Retry-After."""
        attempt = self.event_retry_attempts.get(key, 0)
        self.event_retry_attempts[key] = attempt + 1
        return self.client.backoff.escalating(attempt, self.client.rng, base=self.settings.handler_retry_delay_seconds,
                                              cap=self.settings.event_retry_cap_seconds, retry_after=retry_after)

    def handle_again(self, key: str, delay: float, job: Callable[[], Awaitable[None]], logger: Logger) -> None:
        """Run `job` in `delay` seconds, replacing a try already pending for `key`."""
        self.cancel_event_retry(key)

        async def later() -> None:
            await asyncio.sleep(delay)
            if self.event_retries.get(key) is asyncio.current_task():
                del self.event_retries[key]
            try:
                await job()
            except Exception:  # a bug, not the API: the log says so; nothing else would
                logger.exception("handling %s again failed", key)

        self.event_retries[key] = asyncio.create_task(later(), name=f"kvpilot handle-again {key}")

    def cancel_event_retry(self, key: str) -> None:
        task = self.event_retries.pop(key, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def close(self) -> None:
        """Stop the pending tries (at shutdown: a restarted operator lists every Deployment anew)."""
        tasks = list(self.event_retries.values())
        self.event_retries.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
