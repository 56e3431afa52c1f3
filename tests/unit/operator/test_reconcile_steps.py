"""The reconcile's steps run in order until one ends the pass; a child not ours ends it ApplyFailed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvpilot.operator.apply import NotOwned
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.reconcile import Runtime
from kvpilot.operator.reconcile.service import STEPS, Pass, run_steps, validate
from kvpilot.operator.settings import OperatorSettings
from tests.unit.operator.fixtures import isvc_dict

LOG = logging.getLogger("test")


def _pass(body: dict[str, Any], events: list[tuple[str, str, str]]) -> Pass:
    rt = Runtime(settings=OperatorSettings(), client=KubeClient())
    return Pass(rt, body, lambda *event: events.append(event), LOG)


def test_the_steps_start_with_validate_and_end_with_the_status() -> None:
    names = [step.__name__ for step in STEPS]
    assert names[0] == "validate" and names[-1] == "say_applied"
    assert names.index("check_image") < names.index("discover") < names.index("apply_children")


def test_an_invalid_spec_ends_the_pass_at_validate_with_no_api_call() -> None:
    events: list[tuple[str, str, str]] = []
    p = _pass(isvc_dict(replicas=-1), events)
    compute = asyncio.run(run_steps(p))  # a KubeClient without credentials: any API call would fail
    assert p.result == "invalid" and p.deployment is None and p.isvc is None
    (degraded,) = [c for c in compute({})["conditions"] if c["type"] == "Degraded"]
    assert degraded["reason"] == "InvalidSpec"
    assert [reason for _, reason, _ in events] == ["InvalidSpec"]


def test_a_step_that_ends_the_pass_stops_the_rest_and_a_child_not_ours_is_apply_failed() -> None:
    ran: list[str] = []

    async def ends(p: Pass) -> bool:
        ran.append("ends")
        return p.end(lambda fresh: {"ended": True}, "success")

    async def never(p: Pass) -> bool:
        ran.append("never")
        return True

    async def not_ours(p: Pass) -> bool:
        p.deployment = {"metadata": {"name": "x"}}
        raise NotOwned("Deployment llama is owned by someone else")

    events: list[tuple[str, str, str]] = []
    p = _pass(isvc_dict(), events)
    compute = asyncio.run(run_steps(p, (validate, ends, never)))
    assert ran == ["ends"] and p.result == "success" and compute({}) == {"ended": True}

    p = _pass(isvc_dict(), events)
    compute = asyncio.run(run_steps(p, (validate, not_ours, never)))
    assert ran == ["ends"] and p.result == "error" and p.deployment is None
    (degraded,) = compute({})["conditions"]
    assert degraded["reason"] == "ApplyFailed" and "owned by someone else" in degraded["message"]
    assert events[-1][1] == "ApplyFailed"
