"""status.conditions as Kubernetes writes them: one entry per type, lastTransitionTime moving only
when the status flips.  The operator owns Ready, Progressing and Degraded; the tuner owns Tuning;
each writer carries the others' entries over untouched."""

from __future__ import annotations

import datetime
from typing import Any

from kvpilot.api.vocabulary import ConditionType

_ORDER = {t.value: i for i, t in enumerate(ConditionType)}


def now_rfc3339() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    for cond in conditions or []:
        if cond.get("type") == type_:
            return cond
    return None


def set_condition(conditions: list[dict[str, Any]] | None, type_: str, status: str, reason: str,
                  message: str, generation: int | None, now: str) -> list[dict[str, Any]]:
    """Conditions with `type_` set; lastTransitionTime moves only when the status flips."""
    old = find_condition(conditions, type_)
    since = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    new = {"type": type_, "status": status, "reason": reason, "message": message,
           "lastTransitionTime": since}
    if generation is not None:
        new["observedGeneration"] = generation
    out = [c for c in conditions or [] if c.get("type") != type_]
    out.append(new)
    return sorted(out, key=lambda c: (_ORDER.get(c.get("type", ""), 9), c.get("type", "")))
