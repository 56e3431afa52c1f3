"""Desired vs live: does the live object already hold everything we own?

A live object carries fields the API server and other controllers add (defaults, status,
clusterIP); those are not ours and never count as drift.  Only keys present in the desired
manifest are compared, lists element by element, so a second reconcile of an unchanged
object writes nothing.
"""

from __future__ import annotations

from typing import Any


def _scalar_equal(desired: Any, live: Any) -> bool:
    # The API server returns quantities as strings ("1" for a GPU count written as 1).
    return bool(desired == live or (not isinstance(desired, bool) and not isinstance(live, bool)
                                    and isinstance(desired, int | float | str) and isinstance(live, int | float | str)
                                    and str(desired) == str(live)))


def drift(desired: Any, live: Any, path: str = "") -> list[str]:
    """Paths (dotted, [i] for list items) where `live` differs from `desired`; empty when in sync."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [path or "."]
        out: list[str] = []
        for key, value in desired.items():
            sub = f"{path}.{key}" if path else str(key)
            if key not in live:
                out.append(sub)
            else:
                out += drift(value, live[key], sub)
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [path or "."]
        out = []
        for i, (d, v) in enumerate(zip(desired, live, strict=True)):
            out += drift(d, v, f"{path}[{i}]")
        return out
    return [] if _scalar_equal(desired, live) else [path or "."]


def owned_fields(manifest: dict[str, Any]) -> dict[str, Any]:
    """The part of a manifest the operator owns and patches: labels, annotations, owners, spec (or data)."""
    meta = manifest.get("metadata", {})
    owned: dict[str, Any] = {"metadata": {k: meta[k] for k in ("labels", "annotations", "ownerReferences")
                                          if k in meta}}
    for key, value in manifest.items():
        if key not in ("apiVersion", "kind", "metadata", "status"):
            owned[key] = value
    return owned
