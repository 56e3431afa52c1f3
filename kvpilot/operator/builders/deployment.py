"""The engine Deployment: zero-downtime rollouts of vLLM (or the twin) pods.

`build_deployment` renders it and `pod_template` its pods (the canary track uses the same template).  Why
each setting and security context is what it is: docs/architecture.md, "The engine Deployment".
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from kvpilot.api import tracing as otel
from kvpilot.api.gpus import product_label
from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.api.vocabulary import LABEL_GPU_PRODUCT, LABEL_TRACK, TRACK_STABLE
from kvpilot.operator.builders.common import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_ENGINE,
    HTTP_PORT,
    HTTP_PORT_NAME,
    RenderOptions,
    canonical_json,
    common_labels,
    object_meta,
    selector_labels,
)
from kvpilot.operator.builders.engine import MODEL_CONFIG_DIR, engine_args, engine_command

CONTAINER_NAME = "engine"
HEALTH_PATH = "/health"
STARTUP_PERIOD_SECONDS = 10
READINESS_PERIOD_SECONDS = 5
LIVENESS_PERIOD_SECONDS = 30
LIVENESS_FAILURE_THRESHOLD = 5  # 2.5 minutes of a silent engine before a restart
PROBE_TIMEOUT_SECONDS = 5
# SIGTERM to exit after draining: Python teardown, CUDA context release.
GRACE_MARGIN_SECONDS = 5
REVISION_HISTORY_LIMIT = 5
# The kvpilot image's numeric USER (Dockerfile; the distroless "nonroot" id): runAsNonRoot can
# only be proven for a numeric id.
TWIN_UID = 65532
TWIN_TMP_SIZE = "64Mi"
TERMINATION_MESSAGE_POLICY = "FallbackToLogsOnError"


# vLLM run as a non-root uid: HOME (every cache under ~/.cache and ~/.config) and /tmp on emptyDirs.
# No size limit: the model download lands in HOME and a limit would evict the pod mid-download;
# the node's ephemeral storage bounds it, as it bounds the image's writable layer otherwise.
VLLM_HOME = "/home/vllm"
VLLM_USER = "vllm"

_SECCOMP = {"type": "RuntimeDefault"}


def _non_root(uid: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts for a numeric non-root uid: the "restricted" standard."""
    pod = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
           "seccompProfile": dict(_SECCOMP)}
    container = {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                 "allowPrivilegeEscalation": False, "privileged": False, "readOnlyRootFilesystem": True,
                 "capabilities": {"drop": ["ALL"]}, "seccompProfile": dict(_SECCOMP)}
    return pod, container


def twin_security_contexts() -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts for twin pods, fit for the "restricted" Pod Security
    Standard, so the twin runs in namespaces that enforce it."""
    pod, container = _non_root(TWIN_UID)
    del pod["fsGroup"]  # the twin writes only to its /tmp emptyDir, which needs no group
    return pod, container


def vllm_security_contexts(run_as_user: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod, container) security contexts for vLLM pods (why: docs/architecture.md, "The engine
    Deployment")."""
    if run_as_user is not None:
        return _non_root(run_as_user)
    pod = {"seccompProfile": dict(_SECCOMP)}
    container = {"allowPrivilegeEscalation": False, "privileged": False, "capabilities": {"drop": ["ALL"]},
                 "seccompProfile": dict(_SECCOMP)}
    return pod, container


def rolling_update(isvc: InferenceService) -> dict[str, Any]:
    surge = isvc.spec.rollout.max_surge
    return {
        "type": "RollingUpdate",
        # NOTE: maxSurge 0 leaves no way forward but taking one pod down first.
        "rollingUpdate": {"maxSurge": surge, "maxUnavailable": 0 if surge > 0 else 1},
    }


def termination_grace_period(isvc: InferenceService) -> int:
    rollout = isvc.spec.rollout
    return rollout.pre_stop_seconds + rollout.shutdown_timeout_seconds + GRACE_MARGIN_SECONDS


def _http_probe(period: int, failure_threshold: int, timeout: int = PROBE_TIMEOUT_SECONDS) -> dict[str, Any]:
    return {
        "httpGet": {"path": HEALTH_PATH, "port": HTTP_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "successThreshold": 1,
        "failureThreshold": failure_threshold,
    }


def probes(isvc: InferenceService) -> dict[str, dict[str, Any]]:
    startup_failures = max(1, math.ceil(isvc.spec.rollout.startup_timeout_seconds / STARTUP_PERIOD_SECONDS))
    return {
        "startupProbe": _http_probe(STARTUP_PERIOD_SECONDS, startup_failures),
        "readinessProbe": _http_probe(READINESS_PERIOD_SECONDS, 3),
        "livenessProbe": _http_probe(LIVENESS_PERIOD_SECONDS, LIVENESS_FAILURE_THRESHOLD, timeout=10),
    }


def _resources(isvc: InferenceService) -> dict[str, Any]:
    res = isvc.spec.resources
    amounts: dict[str, Any] = {"memory": res.memory}
    if res.cpu is not None:
        amounts["cpu"] = res.cpu
    if res.gpus > 0:
        amounts[res.gpu_resource] = res.gpus
    # Requests equal limits: GPUs must, and memory over-commit on an inference node ends in OOM kills.
    return {"requests": dict(amounts), "limits": dict(amounts)}


def tracing_env(isvc: InferenceService) -> list[dict[str, Any]]:
    """The OpenTelemetry SDK's environment for spec.observability.tracing (empty without it): the
    protocol always (vLLM falls back to grpc when it is unset), the sampler when a ratio is set, and
    the service name and namespace the spans are filed under."""
    t = isvc.spec.observability.tracing
    if t is None:
        return []
    pairs = [
        (otel.ENV_PROTOCOL, t.otlp_traces_protocol),
        *otel.sampler_env(t.sampling_ratio, t.parent_based),
        (otel.ENV_SERVICE_NAME, isvc.metadata.name),
        (otel.ENV_RESOURCE_ATTRIBUTES, f"service.namespace={isvc.metadata.namespace},"
                                       f"k8s.namespace.name={isvc.metadata.namespace}"),
    ]
    return [{"name": name, "value": value} for name, value in pairs]


def _env(isvc: InferenceService) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    secret = isvc.spec.hf_token_secret
    if secret is not None:
        env.append({"name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}})
    env += tracing_env(isvc)
    return env


def pod_template(isvc: InferenceService, options: RenderOptions, engine: EngineSpec | None = None,
                 track: str = TRACK_STABLE) -> dict[str, Any]:
    """The pod template without the config-hash annotation; its pods labelled with their `track`."""
    engine = engine or isvc.spec.engine
    image = engine.image if engine.kind == "vllm" else options.twin_image
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": engine_command(engine),
        "args": engine_args(isvc, engine),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "resources": _resources(isvc),
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        # vLLM writes no termination-log file: with this the kubelet keeps the tail of its log (2048
        # bytes or 80 lines) as the terminated container's message, where the operator reads vLLM's
        # start-up error and rolls back at once (builders.pods) instead of at the progress deadline.
        "terminationMessagePolicy": TERMINATION_MESSAGE_POLICY,
        **probes(isvc),
    }
    env = _env(isvc)
    if env:
        container["env"] = env
    if isvc.spec.rollout.pre_stop_seconds > 0:
        container["lifecycle"] = {
            "preStop": {"exec": {"command": ["sleep", str(isvc.spec.rollout.pre_stop_seconds)]}}
        }
    # NCCL and PyTorch workers share tensors through /dev/shm; the container default is 64 MiB.
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                                   "sizeLimit": isvc.spec.resources.shm_size}}]
    pod_spec: dict[str, Any] = {"terminationGracePeriodSeconds": termination_grace_period(isvc),
                                "automountServiceAccountToken": False}
    if engine.kind == "twin":
        pod_spec["securityContext"], container["securityContext"] = twin_security_contexts()
        # The root filesystem is read-only; HOME is /tmp in the image, so whatever a library
        # caches there (and Python's tempfile) lands in a small writable emptyDir.
        container["volumeMounts"].append({"name": "tmp", "mountPath": "/tmp"})
        volumes.append({"name": "tmp", "emptyDir": {"sizeLimit": TWIN_TMP_SIZE}})
        ref = isvc.spec.model_config_ref
        if ref is not None:
            container["volumeMounts"].append({"name": "model-config", "mountPath": MODEL_CONFIG_DIR, "readOnly": True})
            volumes.append({"name": "model-config", "configMap": {
                "name": ref.config_map_ref.name, "items": [{"key": ref.config_map_ref.key, "path": "config.json"}]}})
    else:
        pod_spec["securityContext"], container["securityContext"] = vllm_security_contexts(options.engine_run_as_user)
        if options.engine_run_as_user is not None:
            container["volumeMounts"] += [{"name": "home", "mountPath": VLLM_HOME}, {"name": "tmp", "mountPath": "/tmp"}]
            volumes += [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
            container["env"] = [{"name": "HOME", "value": VLLM_HOME}, {"name": "USER", "value": VLLM_USER},
                                *container.get("env", [])]
    gpu_type = isvc.spec.resources.gpu_type
    if gpu_type is not None:
        pod_spec["nodeSelector"] = {LABEL_GPU_PRODUCT: product_label(gpu_type)}
    labels = common_labels(isvc)
    labels["app.kubernetes.io/name"] = "vllm" if engine.kind == "vllm" else "kvpilot-twin"
    # On the template only, never in the stable Deployment's selector (selectors are immutable, and
    # the Service selects both tracks): see builders.canary for why the tracks never adopt each other.
    labels[LABEL_TRACK] = track
    return {
        "metadata": {"labels": labels},
        "spec": {**pod_spec, "containers": [container], "volumes": volumes},
    }


def config_hash(template: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(template).encode()).hexdigest()[:16]


def build_deployment(isvc: InferenceService, options: RenderOptions | None = None,
                     engine: EngineSpec | None = None) -> dict[str, Any]:
    """The Deployment for `isvc`, running `engine` (spec.engine unless given, e.g. lastGoodEngine)."""
    options = options or RenderOptions()
    engine = engine or isvc.spec.engine
    template = pod_template(isvc, options, engine)
    digest = config_hash(template)
    template["metadata"]["annotations"] = {ANNOTATION_CONFIG_HASH: digest}
    meta = object_meta(isvc, annotations={
        ANNOTATION_CONFIG_HASH: digest,
        ANNOTATION_ENGINE: canonical_json(engine.to_wire()),
    })
    meta["labels"] = dict(template["metadata"]["labels"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": isvc.spec.replicas,
            "selector": {"matchLabels": selector_labels(isvc)},
            "strategy": rolling_update(isvc),
            "progressDeadlineSeconds": isvc.spec.rollout.progress_deadline_seconds,
            "revisionHistoryLimit": REVISION_HISTORY_LIMIT,
            "template": template,
        },
    }
