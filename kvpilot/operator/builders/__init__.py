"""Pure builders: an InferenceService in, Kubernetes manifests (plain dicts) out.

Nothing here talks to a cluster or imports kopf or the kubernetes client (an import-linter
contract keeps it so); `kvpilot render` and the operator print and apply the same dicts.
"""

from kvpilot.operator.builders.common import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_ENGINE,
    LABEL_INSTANCE,
    LABEL_ISVC,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    RenderOptions,
)
from kvpilot.operator.builders.deployment import build_deployment, config_hash
from kvpilot.operator.builders.engine import engine_args, engine_command
from kvpilot.operator.builders.render import render_manifests

__all__ = [
    "ANNOTATION_CONFIG_HASH",
    "ANNOTATION_ENGINE",
    "LABEL_INSTANCE",
    "LABEL_ISVC",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "MANAGED_BY",
    "RenderOptions",
    "build_deployment",
    "config_hash",
    "engine_args",
    "engine_command",
    "render_manifests",
]
