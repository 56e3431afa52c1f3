"""Create-or-patch of children, idempotent: an object already holding what we own is not written.

KMock (and any API server without server-side apply for our purposes) gets a JSON merge patch of
the fields we own: labels, annotations, ownerReferences and spec.  Lists inside spec (containers,
ports) are replaced whole by a merge patch, which is what we want: the operator owns them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from kvpilot.operator.builders.diff import drift, owned_fields
from kvpilot.operator.kube import ApiError, KubeClient, resource_path

PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}


class NotOwned(Exception):
    """A child's name is taken by an object another controller (or a person) owns."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    kind: str
    name: str
    action: Literal["created", "updated", "unchanged", "deleted"]
    live: dict[str, Any] | None
    changed: tuple[str, ...] = ()
    before: dict[str, Any] | None = None  # the live object a patch changed


def path_of(manifest: dict[str, Any], *, named: bool = True) -> str:
    meta = manifest["metadata"]
    return resource_path(manifest["apiVersion"], PLURALS[manifest["kind"]], meta.get("namespace"),
                         meta["name"] if named else None)


def _controller_uid(obj: dict[str, Any]) -> str | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


async def ensure(client: KubeClient, desired: dict[str, Any], *, likely_absent: bool = False) -> ApplyResult:
    """Create `desired`, or patch the live object where it drifted from what we own.

    `likely_absent` (a new InferenceService's children): create first and read only on 409
    AlreadyExists, one call instead of a read that answers 404 and then the create."""
    kind, name = desired["kind"], desired["metadata"]["name"]
    live = None if likely_absent else await client.get_or_none(path_of(desired))
    if live is None:
        try:
            created = await client.create(path_of(desired, named=False), desired)
            return ApplyResult(kind, name, "created", created)
        except ApiError as exc:
            if exc.status != 409:
                raise
            live = await client.get(path_of(desired))  # it exists: fall through to patching
    want_uid = _controller_uid(desired)
    have_uid = _controller_uid(live)
    if have_uid is not None and want_uid is not None and have_uid != want_uid:
        raise NotOwned(f"{kind} {name} exists and is controlled by another owner (uid {have_uid})")
    owned = owned_fields(desired)
    changed = drift(owned, live)
    if not changed:
        return ApplyResult(kind, name, "unchanged", live)
    patched = await client.merge_patch(path_of(desired), owned)
    return ApplyResult(kind, name, "updated", patched, tuple(changed), before=live)


async def ensure_absent(client: KubeClient, manifest: dict[str, Any]) -> ApplyResult | None:
    """Delete a child we no longer want (a PDB after scaling to one replica, the canary after its
    trial), if it is ours."""
    kind, name = manifest["kind"], manifest["metadata"]["name"]
    live = await client.get_or_none(path_of(manifest))
    if live is None:
        return None
    if _controller_uid(live) != _controller_uid(manifest):
        return None  # not ours to delete
    try:
        # Background, never Orphan: an orphaned canary ReplicaSet would match the stable Deployment's
        # selector (builders.canary); the garbage collector takes the dependents with their owner.
        await client.delete(path_of(manifest), params={"propagationPolicy": "Background"})
    except ApiError as exc:
        if not exc.not_found:
            raise
    return ApplyResult(kind, name, "deleted", None)


@dataclass
class MonitoringDiscovery:
    """Which of ServiceMonitor, PodMonitor and PrometheusRule the cluster serves, cached for `ttl` seconds."""

    client: KubeClient
    ttl: float = 300.0
    _checked_at: float = field(default=-1e18)
    _served: frozenset[str] = field(default=frozenset())

    async def served(self) -> frozenset[str]:
        if time.monotonic() - self._checked_at < self.ttl:
            return self._served
        try:
            listing = await self.client.get("/apis/monitoring.coreos.com/v1")
            names = frozenset(r.get("name", "") for r in listing.get("resources", []))
        except ApiError as exc:
            if not exc.not_found:
                raise
            names = frozenset()
        self._served = names & {"servicemonitors", "podmonitors", "prometheusrules"}
        self._checked_at = time.monotonic()
        return self._served
