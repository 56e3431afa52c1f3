"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Every operator replica serves the admission webhook, /healthz and /metrics; only the holder of the
Lease runs kopf's reconcile handlers, so two or more replicas never write the same children.

The rules are client-go's (k8s.io/client-go/tools/leaderelection), so a Lease written by kvpilot reads
as any Kubernetes controller's:

- A candidate takes the Lease when it does not exist, when its holderIdentity is empty (released), or
  when the record has not changed for leaseDurationSeconds as measured on the candidate's own
  monotonic clock since it last saw the record change (so clock skew between nodes does not matter).
- Taking it sets holderIdentity, acquireTime and renewTime and counts one more leaseTransitions;
  renewing moves renewTime only.  Every write carries the resourceVersion it was computed from, so
  of two candidates racing for the same record one gets 409 Conflict and stays a follower.
- The holder renews every retry period and steps down when it has not renewed within the renew
  deadline (shorter than the lease duration: the margin is the time it has to stop writing before a
  follower may take over), or at once when the Lease names another holder.
- On a clean shutdown the holder releases the Lease (holderIdentity "", leaseDurationSeconds 1) so a
  follower takes over within one retry period instead of a whole lease duration.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.api.rest import ApiError

logger = logging.getLogger("kvpilot.operator.leader")

# client-go's wait.JitterUntil factor: a candidate's retry period is stretched by up to this much, so
# candidates started together do not poll in lockstep.
JITTER_FACTOR = 1.2


class LeaseClient(Protocol):
    """What the elector calls (KubeClient has these)."""

    async def get_or_none(self, path: str) -> Any: ...

    async def create(self, path: str, body: dict[str, Any]) -> Any: ...

    async def merge_patch(self, path: str, body: dict[str, Any], *, retry_conflicts: bool = True) -> Any: ...


@dataclass(frozen=True, slots=True)
class LeaseTimings:
    """client-go's three durations; `problems` says what is wrong with a combination."""

    lease_duration_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0

    @property
    def stop_seconds(self) -> float:
        """How long a leader that lost the Lease may take to stop reconciling: the margin between its
        renew deadline and the earliest takeover (at least 1 s, for kopf to stop at all)."""
        return max(1.0, self.lease_duration_seconds - self.renew_deadline_seconds)

    def problems(self) -> list[str]:
        found = []
        if self.lease_duration_seconds < 1:
            found.append(f"--leader-elect-lease-duration must be at least 1 s (got {self.lease_duration_seconds})")
        if self.retry_period_seconds <= 0:
            found.append(f"--leader-elect-retry-period must be > 0 s (got {self.retry_period_seconds:g})")
        if not self.renew_deadline_seconds < self.lease_duration_seconds:
            found.append(f"--leader-elect-renew-deadline ({self.renew_deadline_seconds:g} s) must be shorter than "
                         f"--leader-elect-lease-duration ({self.lease_duration_seconds} s): the difference is "
                         "the time a leader that cannot renew has to stop before another takes over")
        if not self.renew_deadline_seconds > JITTER_FACTOR * self.retry_period_seconds:
            found.append(f"--leader-elect-renew-deadline ({self.renew_deadline_seconds:g} s) must be longer than "
                         f"{JITTER_FACTOR:g} x --leader-elect-retry-period ({self.retry_period_seconds:g} s): "
                         "a leader must get more than one try to renew")
        return found


def micro_time(moment: datetime.datetime) -> str:
    """A metav1.MicroTime as the API server writes it (RFC 3339, microseconds, UTC)."""
    return moment.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_path(namespace: str, name: str | None = None) -> str:
    path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return path if name is None else f"{path}/{name}"


class LeaseElector:
    """Contends for one Lease; `run` leads (calls `lead`) whenever it holds it."""

    def __init__(self, client: LeaseClient, *, namespace: str, name: str, identity: str,
                 timings: LeaseTimings, rng: random.Random | None = None,
                 on_unauthorized: Callable[[], None] | None = None,
                 monotonic: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)) -> None:
        self.client = client
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timings = timings
        self.rng = rng or random.Random()
        self._monotonic, self._now = monotonic, now
        # Called on 401: a service-account token rotates, and the client needs the new one.
        self._on_unauthorized = on_unauthorized
        # The last record seen and when (our monotonic clock) it was first seen as it is.
        self._observed: dict[str, Any] | None = None
        self._observed_at = 0.0
        self.leading = False
        # When the last successful try began (our monotonic clock).
        self.renewed_at = 0.0

    @property
    def path(self) -> str:
        return lease_path(self.namespace, self.name)

    def _observe(self, spec: dict[str, Any]) -> None:
        if spec != self._observed:
            self._observed, self._observed_at = dict(spec), self._monotonic()

    async def try_acquire_or_renew(self) -> bool:
        """One try: True when this candidate holds the Lease afterwards.  API errors propagate."""
        now = micro_time(self._now())
        lease = await self.client.get_or_none(self.path)
        if lease is None:
            first: dict[str, Any] = {
                "holderIdentity": self.identity, "leaseDurationSeconds": self.timings.lease_duration_seconds,
                "acquireTime": now, "renewTime": now, "leaseTransitions": 0}
            try:
                await self.client.create(lease_path(self.namespace), {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": first})
            except ApiError as exc:
                if exc.status == 409:  # another candidate created it first
                    return False
                raise
            self._observe(first)
            return True
        spec: dict[str, Any] = dict(lease.get("spec") or {})
        self._observe(spec)
        holder = spec.get("holderIdentity") or ""
        duration = spec.get("leaseDurationSeconds") or self.timings.lease_duration_seconds
        if holder and holder != self.identity and self._monotonic() < self._observed_at + duration:
            return False
        ours = holder == self.identity
        new = {"holderIdentity": self.identity, "leaseDurationSeconds": self.timings.lease_duration_seconds,
               "acquireTime": spec.get("acquireTime", now) if ours else now, "renewTime": now,
               "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)}
        body = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": new}
        try:
            await self.client.merge_patch(self.path, body, retry_conflicts=False)
        except ApiError as exc:
            if exc.status == 409:  # the record moved on under us: someone else wrote it
                return False
            raise
        self._observe(new)
        return True

    def holder_is_other(self) -> bool:
        holder = (self._observed or {}).get("holderIdentity") or ""
        return bool(holder) and holder != self.identity

    async def release(self) -> None:
        """Hand the Lease back (if still ours) so a follower need not wait out the lease duration."""
        try:
            lease = await self.client.get_or_none(self.path)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            now = micro_time(self._now())
            spec = lease.get("spec") or {}
            await self.client.merge_patch(self.path, {
                "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "acquireTime": now, "renewTime": now,
                         "leaseTransitions": int(spec.get("leaseTransitions") or 0)}}, retry_conflicts=False)
            logger.info("released the lease %s/%s", self.namespace, self.name)
        except ApiError as exc:  # it expires by itself after the lease duration
            logger.warning("could not release the lease %s/%s: %s", self.namespace, self.name, exc)

    async def _try(self, budget: float) -> bool:
        """One try within `budget` seconds; a failed call counts as not holding it."""
        started = self._monotonic()
        try:
            async with asyncio.timeout(budget):
                held = await self.try_acquire_or_renew()
            # The renew deadline runs from when the try began, not from its answer: the write landed
            # in between, and a follower's wait starts once it sees it, so a slow answer must not
            # stretch this replica's idea of how long it still leads.
            if held:
                self.renewed_at = started
            return held
        except (ApiError, TimeoutError) as exc:
            if isinstance(exc, ApiError) and exc.status == 401 and self._on_unauthorized is not None:
                self._on_unauthorized()
            logger.info("lease %s/%s: %s", self.namespace, self.name,
                        exc if isinstance(exc, ApiError) else f"no answer within {budget:g}s")
            return False

    def _period(self) -> float:
        return self.timings.retry_period_seconds * (1 + (JITTER_FACTOR - 1) * self.rng.random())

    async def acquire(self, stopping: asyncio.Event) -> bool:
        """Try every retry period until this candidate holds the Lease (True) or `stopping` is set."""
        while not stopping.is_set():
            if await self._try(self.timings.renew_deadline_seconds):
                return True
            await _wait(stopping, self._period())
        return False

    async def renew(self, stopping: asyncio.Event) -> str:
        """Renew every retry period while leading; return why it stopped: "stopping", or the reason
        leadership was lost (not renewed within the renew deadline, or another holder)."""
        while True:
            await _wait(stopping, self.timings.retry_period_seconds)
            if stopping.is_set():
                return "stopping"
            left = self.renewed_at + self.timings.renew_deadline_seconds - self._monotonic()
            if left > 0 and await self._try(left):
                continue
            if self.holder_is_other():
                return f"the lease is held by {self._observed_holder()}"
            if self._monotonic() >= self.renewed_at + self.timings.renew_deadline_seconds:
                return f"not renewed within the renew deadline ({self.timings.renew_deadline_seconds:g}s)"

    async def _renew_until_lost(self, lost: asyncio.Event, stopping: asyncio.Event) -> None:
        why = await self.renew(stopping)
        if why != "stopping":
            logger.warning("stepping down: %s (lease %s/%s)", why, self.namespace, self.name)
        lost.set()

    def _observed_holder(self) -> str:
        return str((self._observed or {}).get("holderIdentity") or "")

    async def run(self, lead: Callable[[asyncio.Event], Awaitable[None]], stopping: asyncio.Event) -> None:
        """Contend until `stopping` is set.  While holding the Lease, `lead(lost)` runs; it must return
        soon after `lost` is set (leadership lost, or stopping).  An exception from `lead` ends the
        run, after the Lease is released."""
        while not stopping.is_set():
            if not await self.acquire(stopping):
                break
            self.leading = True
            logger.info("became the leader (lease %s/%s, identity %s)", self.namespace, self.name, self.identity)
            lost = asyncio.Event()
            renewer = asyncio.create_task(self._renew_until_lost(lost, stopping), name="lease renewer")
            failed = True
            try:
                await lead(lost)
                failed = False
            finally:
                renewer.cancel()  # first: a renewal must not follow the release
                await asyncio.gather(renewer, return_exceptions=True)
                self.leading = False
                if failed:
                    await self.release()
        await self.release()


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less when `event` is set."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        pass
