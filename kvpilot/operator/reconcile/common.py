"""What the reconcile and the event handlers both judge by: the render options, the image allowlist,
status.lastGoodEngine, what the status already says of an engine failure, and a dead engine's log."""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import EngineSpec
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.deployment import CONTAINER_NAME
from kvpilot.operator.builders.pods import EngineFailure
from kvpilot.operator.builders.status import DEGRADED, ENGINE_FAILURE_REASONS, find_condition, rolled_back_at
from kvpilot.operator.kube import ApiError, resource_path
from kvpilot.operator.reconcile.runtime import Logger, Runtime
from kvpilot.operator.settings import OperatorSettings

# How much of a dead engine's log to read when its termination message names no root cause: vLLM V1's
# API-server traceback after the engine core's root cause is a few KiB (builders.pods).
LOG_TAIL_LINES = 400
LOG_LIMIT_BYTES = 256 * 1024


def render_options(settings: OperatorSettings, served: frozenset[str]) -> RenderOptions:
    """What the builders need from the settings and from discovery (the monitoring kinds served)."""
    return RenderOptions(twin_image=settings.twin_image, service_monitors="servicemonitors" in served,
                         pod_monitors="podmonitors" in served, prometheus_rules="prometheusrules" in served,
                         engine_run_as_user=settings.engine_run_as_user, monitor_labels=settings.monitor_labels)


def usable_last_good(previous: dict[str, Any], logger: Logger) -> dict[str, Any] | None:
    """status.lastGoodEngine if this operator can still render it (one stored by an older operator may
    carry an extraArgs entry refused since): else None, nothing to roll back to."""
    last_good = previous.get("lastGoodEngine")
    if not last_good:
        return None
    try:
        EngineSpec.model_validate(last_good)
    except ValueError as exc:  # pydantic's ValidationError
        logger.warning("status.lastGoodEngine is no longer a valid engine, not rolled back to: %s", exc)
        return None
    return dict(last_good)


def refused_in_force(rt: Runtime, parent: dict[str, Any], previous: dict[str, Any], generation: int) -> bool:
    """The engine a reconcile of this generation renders (lastGoodEngine once rolled back, else
    spec.engine) is outside the image allowlist: the reconcile refused it (Degraded/ImageNotAllowed)
    and a Deployment or pod event must not write over that with the Deployment it left running."""
    if not rt.settings.allowed_images.enforced:
        return False  # the common case: every Deployment event passes here, so no validation
    engine = parent.get("spec", {}).get("engine") or {}
    if rolled_back_at(previous, generation) and previous.get("lastGoodEngine"):
        engine = previous["lastGoodEngine"]
    try:
        return image_refusal(rt, EngineSpec.model_validate(engine)) is not None
    except ValueError:
        return False


def image_refusal(rt: Runtime, engine: EngineSpec, field: str = "spec.engine.image") -> str | None:
    """Why the operator will not run this engine's image (the allowlist's message), or None.  Only
    vLLM images are the tenant's choice; the twin runs the operator's own --twin-image."""
    if engine.kind != "vllm" or rt.settings.allowed_images.allows(engine.image):
        return None
    return rt.settings.allowed_images.refusal(engine.image, field)


def engine_failure_said(previous: dict[str, Any], generation: int) -> bool:
    """Degraded already says, for this generation, why its engine cannot run (in the engine's words,
    which a later progress deadline would only replace with less)."""
    cond = find_condition(previous.get("conditions"), DEGRADED) or {}
    return (cond.get("status") == "True" and cond.get("reason") in ENGINE_FAILURE_REASONS
            and cond.get("observedGeneration") == generation)


async def with_log(rt: Runtime, namespace: str, failure: EngineFailure, logger: Logger) -> EngineFailure:
    """The failure with its root cause read from the dead instance's log (as `kubectl logs [--previous]`)."""
    params = {"container": CONTAINER_NAME, "tailLines": str(LOG_TAIL_LINES), "limitBytes": str(LOG_LIMIT_BYTES)}
    if failure.previous:
        params["previous"] = "true"
    try:
        log = await rt.client.get_text(resource_path("v1", "pods", namespace, failure.pod, "log"), params)
    except ApiError as exc:  # the message's own line still says that it could not start
        logger.info("log of pod %s/%s not read: %s", namespace, failure.pod, exc)
        return failure
    return failure.with_log(log)
