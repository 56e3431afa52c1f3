"""Every manifest the operator creates for one InferenceService, in apply order."""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.monitoring import build_prometheus_rule, build_service_monitor
from kvpilot.operator.builders.service import build_pdb, build_service, wants_pdb


def render_manifests(isvc: InferenceService, options: RenderOptions | None = None,
                     engine: EngineSpec | None = None) -> list[dict[str, Any]]:
    options = options or RenderOptions()
    manifests = [build_deployment(isvc, options, engine), build_service(isvc)]
    if wants_pdb(isvc):
        manifests.append(build_pdb(isvc))
    if options.service_monitors:
        manifests.append(build_service_monitor(isvc))
    if options.prometheus_rules:
        rule = build_prometheus_rule(isvc)
        if rule is not None:
            manifests.append(rule)
    return manifests
