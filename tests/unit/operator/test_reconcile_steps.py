"""The reconcile's steps run in order until one ends the pass; a child not ours ends it ApplyFailed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvpilot.operator.apply import NotOwned
from kvpilot.operator.images import ImageAllowlist
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.reconcile import Runtime
from kvpilot.operator.reconcile.service import STEPS, Pass, check_image, keep_last_good, run_steps, validate
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


# A generation rolled back: its engine (gpuMemoryUtilization 0.5) failed, lastGoodEngine (0.9) runs.
FAILED = {"image": "registry.example.com/vllm/vllm-openai:v2", "gpuMemoryUtilization": 0.5}
LAST_GOOD = {"image": "registry.example.com/vllm/vllm-openai:v1", "gpuMemoryUtilization": 0.9}
ROLLED_BACK = {"type": "Degraded", "status": "True", "reason": "RolledBack", "observedGeneration": 2,
               "message": "rollout of configHash abc did not progress; put lastGoodEngine back",
               "lastTransitionTime": "2026-12-07T00:00:00Z"}


def _rolled_back(events: list[tuple[str, str, str]], settings: OperatorSettings | None = None) -> Pass:
    body = isvc_dict(engine=FAILED)
    body["metadata"]["generation"] = 2
    body["status"] = {"observedGeneration": 2, "conditions": [ROLLED_BACK], "lastGoodEngine": LAST_GOOD}
    rt = Runtime(settings=settings or OperatorSettings(), client=KubeClient())
    return Pass(rt, body, lambda *event: events.append(event), LOG)


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_a_child_not_ours_in_a_rolled_back_generation_keeps_rolled_back_and_the_last_good_engine() -> None:
    """ApplyFailed must not replace Degraded RolledBack: the next reconcile of the generation would
    otherwise render the failed engine again (keep_last_good reads that condition)."""
    async def not_ours(p: Pass) -> bool:
        raise NotOwned("Deployment llama is owned by someone else")

    events: list[tuple[str, str, str]] = []
    p = _rolled_back(events)
    compute = asyncio.run(run_steps(p, (validate, keep_last_good, not_ours)))
    assert p.result == "error" and p.engine is not None
    written = {**p.previous, **compute(p.previous)}
    conditions = _conditions(written)
    assert conditions["Degraded"] == ROLLED_BACK
    assert conditions["Progressing"]["reason"] == "ApplyFailed" and conditions["Progressing"]["status"] == "False"
    assert "owned by someone else" in conditions["Progressing"]["message"]
    assert events[-1][1] == "ApplyFailed"

    # The next reconcile of the same generation still renders lastGoodEngine.
    again = _rolled_back(events)
    again.body["status"] = written
    again.previous = written
    asyncio.run(run_steps(again, (validate, keep_last_good, not_ours)))
    assert again.engine is not None and again.engine.gpu_memory_utilization == 0.9


def test_a_refused_last_good_image_in_a_rolled_back_generation_keeps_rolled_back_and_says_it_once() -> None:
    """The allowlist changed since lastGoodEngine ran: ImageNotAllowed on Ready and Progressing, while
    Degraded RolledBack stays (replaced, a later reconcile would render the failed engine, whose image
    is allowed); its Event is posted once, not at every reconcile."""
    settings = OperatorSettings(allowed_images=ImageAllowlist(("registry.example.com/vllm/vllm-openai:v2",)))
    events: list[tuple[str, str, str]] = []
    p = _rolled_back(events, settings)
    compute = asyncio.run(run_steps(p, (validate, keep_last_good, check_image)))
    assert p.result == "invalid"
    written = {**p.previous, **compute(p.previous)}
    conditions = _conditions(written)
    assert conditions["Degraded"] == ROLLED_BACK
    assert conditions["Ready"]["reason"] == conditions["Progressing"]["reason"] == "ImageNotAllowed"
    assert "status.lastGoodEngine.image" in conditions["Ready"]["message"]
    assert [reason for _, reason, _ in events] == ["ImageNotAllowed"]

    again = _rolled_back(events, settings)
    again.body["status"] = written
    again.previous = written
    asyncio.run(run_steps(again, (validate, keep_last_good, check_image)))
    assert again.result == "invalid" and again.engine is not None and again.engine.gpu_memory_utilization == 0.9
    assert [reason for _, reason, _ in events] == ["ImageNotAllowed"]  # not posted again
