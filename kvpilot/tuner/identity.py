"""A study's identity: every input that changes the answer, recorded in the study and checked on resume.

A rerun resumes its study from storage, so the study must not be found again by a run that asks a
different question: another SLO, tensor parallelism, max model length, rate, workload or seed gives
other measurements, and trials measured under the old question would be reported as answers to the
new one.  So the derived study name carries a digest of all of them, and the inputs themselves are
kept in the study's user attrs: a run that names a study explicitly (`--study-name`) and asks a
different question is refused with what differs, rather than silently given the old answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import optuna

# The study user attr that holds the inputs.
STUDY_INPUTS = "inputs"


class StudyMismatch(ValueError):
    """An existing study was made for other inputs than this run's."""


def canonical(value: Any) -> Any:
    """JSON-ready, order-independent form of an input (dataclasses as dicts, tuples as lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 1.0 and 1 are one question
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def identity(**inputs: Any) -> dict[str, Any]:
    """The inputs of a study, canonical; None values (inputs that do not apply) are left out."""
    return {k: canonical(v) for k, v in sorted(inputs.items()) if v is not None}


def digest(inputs: Mapping[str, Any]) -> str:
    """A short digest of the inputs, for the study name."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def differences(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """`key: recorded -> wanted` for every input that differs."""
    out = []
    for key in sorted(set(recorded) | set(wanted)):
        a, b = recorded.get(key), wanted.get(key)
        if a != b:
            out.append(f"{key}: {_show(a)} -> {_show(b)}")
    return out


def _show(value: Any) -> str:
    return "(not set)" if value is None else json.dumps(value, sort_keys=True)


def bind(study: optuna.Study, inputs: Mapping[str, Any]) -> None:
    """Record the inputs in a new study; refuse an existing study made for other inputs.

    A study without recorded inputs that already has trials was made by an older kvpilot: its
    question is unknown, so it is refused too rather than trusted."""
    wanted = dict(inputs)
    recorded = study.user_attrs.get(STUDY_INPUTS)
    if recorded is None:
        if study.get_trials(deepcopy=False):
            raise StudyMismatch(
                f"study {study.study_name!r} has trials but no record of the inputs it was made for; "
                "start a new study (another --study-name or --storage)")
        study.set_user_attr(STUDY_INPUTS, wanted)
        return
    diff = differences(recorded, wanted)
    if diff:
        raise StudyMismatch(
            f"study {study.study_name!r} was made for other inputs, so its trials do not answer this run: "
            + "; ".join(diff)
            + ". Use another --study-name (or leave it out: the default name follows the inputs)")
