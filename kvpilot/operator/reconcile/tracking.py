"""What a Deployment event (rollout.py) and an engine pod event (pods.py) share: the InferenceService
they are judged against (`Tracked`), what they decide (`Verdict`), and its status write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.validation import validate_object
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.status import Rollout, desired_status, engine_info, rollout_of
from kvpilot.operator.reconcile.common import image_refusal, render_options
from kvpilot.operator.reconcile.runtime import EmitOn, Logger, Runtime
from kvpilot.operator.reconcile.status import update_status


@dataclass
class Tracked:
    """An InferenceService as a Deployment or pod event finds it: the parent as last read, its status
    then, the generation its reconcile last rendered, its Deployment and that Deployment's rollout."""

    rt: Runtime
    namespace: str
    name: str
    parent: dict[str, Any]
    previous: dict[str, Any]
    generation: int
    deployment: dict[str, Any]
    rollout: Rollout
    last_good: dict[str, Any] | None
    emit_on: EmitOn
    logger: Logger

    def warn(self, reason: str, message: str) -> None:
        """A Warning Event on the InferenceService."""
        self.emit_on(self.parent, "Warning", reason, message)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the status is to say: from this Deployment, Degraded (reason, message) if any, lastFailure."""

    deployment: dict[str, Any]
    degraded: tuple[str, str] | None = None
    last_failure: dict[str, Any] | None = None


def owns(parent: dict[str, Any], child: dict[str, Any]) -> bool:
    """`parent` is the controller among `child`'s owners."""
    owners = {ref.get("uid") for ref in child.get("metadata", {}).get("ownerReferences") or [] if ref.get("controller")}
    return parent.get("metadata", {}).get("uid") in owners


def judged_generation(parent: dict[str, Any]) -> int | None:
    """The generation the service handler last reconciled (an event must never claim a newer spec is in
    force before that handler has rendered it); None while there is none, or the spec is invalid."""
    generation: int | None = (parent.get("status") or {}).get("observedGeneration")
    if generation is None or validate_object({k: v for k, v in parent.items() if k != "status"}):
        return None
    return generation


def last_good_refusal(rt: Runtime, last_good: dict[str, Any] | None) -> str | None:
    """Why lastGoodEngine may not be put back (the allowlist changed since it ran), or None."""
    if not last_good:
        return None
    return image_refusal(rt, EngineSpec.model_validate(last_good), "status.lastGoodEngine.image")


async def render_last_good(rt: Runtime, parent: dict[str, Any], last_good: dict[str, Any]) -> dict[str, Any]:
    """The Deployment of `parent` on the engine `last_good`."""
    isvc = InferenceService.model_validate({k: v for k, v in parent.items() if k != "status"})
    options = render_options(rt.settings, await rt.discovery.served())
    return build_deployment(isvc, options, EngineSpec.model_validate(last_good))


async def write_verdict(t: Tracked, verdict: Verdict) -> None:
    """The engine in force in the metrics, the status as the verdict says (raises ApiError when the
    API keeps failing), and the Deployment it was computed from as the status basis."""
    deployment, generation = verdict.deployment, t.generation
    t.rt.metrics.set_engine(t.namespace, t.name, engine_info(rollout_of(deployment)))

    def compute(fresh: dict[str, Any]) -> dict[str, Any]:
        return desired_status(generation=generation, previous=fresh, deployment=deployment,
                              degraded=verdict.degraded, last_failure=verdict.last_failure)

    await update_status(t.rt, t.namespace, t.name, compute, parent=t.parent)
    version = (deployment.get("metadata") or {}).get("resourceVersion")
    if version is not None:
        t.rt.status_basis[f"{t.namespace}/{t.name}"] = str(version)
