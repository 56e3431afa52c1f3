"""Why the replica count changed: who wrote spec.replicas, read from the object's managedFields, and the
`Scaled` Event's words.  Pure functions over the objects as read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Writer:
    """The field manager that last wrote spec.replicas: `kubectl`, `kube-controller-manager` (an HPA, or
    KEDA's HPA), `kubectl-client-side-apply`, a GitOps tool's name; and the subresource it wrote through
    (`scale`, or None for the object itself)."""

    manager: str
    subresource: str | None = None

    def __str__(self) -> str:
        through = f" through the {self.subresource} subresource" if self.subresource else ""
        return f"{self.manager}{through}"


def replicas_writer(metadata: dict[str, Any]) -> Writer | None:
    """The manager whose managedFields entry holds spec.replicas, the latest by its time where several
    share it (an Apply and an Update of the same value); None where the object does not tell (an API
    server without managedFields, or a field no manager claims)."""
    found: list[tuple[str, Writer]] = []
    for entry in metadata.get("managedFields") or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("manager"), str):
            continue
        fields = entry.get("fieldsV1") or {}
        spec = fields.get("f:spec") if isinstance(fields, dict) else None
        if isinstance(spec, dict) and "f:replicas" in spec:
            subresource = entry.get("subresource") or None
            found.append((str(entry.get("time") or ""), Writer(entry["manager"], subresource)))
    if not found:
        return None
    # RFC 3339 times with a Z sort as strings; the entry last in the list wins a tie.
    return max(enumerate(found), key=lambda item: (item[1][0], item[0]))[1][1]


def scaled_message(before: int, after: int, writer: Writer | None) -> str:
    by = f" (spec.replicas written by {writer})" if writer is not None else ""
    return f"Scaled from {before} to {after} replicas{by}"


def deployment_replicas(deployment: dict[str, Any] | None) -> int | None:
    if not deployment:
        return None
    replicas = (deployment.get("spec") or {}).get("replicas")
    return replicas if isinstance(replicas, int) else None
