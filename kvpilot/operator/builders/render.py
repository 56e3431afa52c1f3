"""Every manifest the operator creates for one InferenceService, in apply order."""

from __future__ import annotations

from typing import Any

from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.vocabulary import MonitorKind
from kvpilot.operator.builders.common import RenderOptions
from kvpilot.operator.builders.deployment import build_deployment
from kvpilot.operator.builders.monitoring import MONITOR_PLURALS, build_monitor, build_prometheus_rule
from kvpilot.operator.builders.service import build_pdb, build_service, wants_pdb


def _served(options: RenderOptions) -> dict[MonitorKind, bool]:
    return {MonitorKind.SERVICE_MONITOR: options.service_monitors, MonitorKind.POD_MONITOR: options.pod_monitors}


def wanted_monitor(isvc: InferenceService) -> MonitorKind | None:
    """The monitor kind spec.observability.monitor asks for; None for `None`."""
    kind = MonitorKind(isvc.spec.observability.monitor)
    return kind if kind in MONITOR_PLURALS else None


def render_manifests(isvc: InferenceService, options: RenderOptions | None = None,
                     engine: EngineSpec | None = None) -> list[dict[str, Any]]:
    options = options or RenderOptions()
    manifests = [build_deployment(isvc, options, engine), build_service(isvc)]
    if wants_pdb(isvc):
        manifests.append(build_pdb(isvc))
    monitor = wanted_monitor(isvc)
    if monitor is not None and _served(options)[monitor]:
        manifests.append(_labelled(build_monitor(isvc, monitor), options))
    if options.prometheus_rules:
        rule = build_prometheus_rule(isvc)
        if rule is not None:
            manifests.append(_labelled(rule, options))
    return manifests


def _labelled(manifest: dict[str, Any], options: RenderOptions) -> dict[str, Any]:
    """The monitoring object with the operator's --monitor-label labels; its own labels win."""
    if options.monitor_labels:
        meta = manifest["metadata"]
        meta["labels"] = {**dict(options.monitor_labels), **(meta.get("labels") or {})}
    return manifest


def unwanted_monitors(isvc: InferenceService, options: RenderOptions | None = None) -> list[dict[str, Any]]:
    """The monitors of the kinds the spec does not ask for (that the cluster serves), to delete if
    they are ours: after a switch from ServiceMonitor to PodMonitor both would scrape the same pods,
    and every sum over the service's series would count each request twice."""
    options = options or RenderOptions()
    monitor = wanted_monitor(isvc)
    return [build_monitor(isvc, kind) for kind, served in _served(options).items() if served and kind != monitor]
