from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvpilot.api.vocabulary import MonitorKind
from kvpilot.operator.builders import (
    ANNOTATION_CONFIG_HASH,
    ANNOTATION_ENGINE,
    RenderOptions,
    build_deployment,
    render_manifests,
)
from kvpilot.operator.builders.deployment import STARTUP_PERIOD_SECONDS
from kvpilot.operator.builders.monitoring import build_monitor
from kvpilot.operator.builders.render import unwanted_monitors
from tests.unit.operator.fixtures import isvc
from tests.unit.ship.pss import restricted_violations


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def test_startup_probe_covers_the_whole_model_load() -> None:
    dep = build_deployment(isvc(rollout={"startupTimeoutSeconds": 1805}))
    probe = container(dep)["startupProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": "http"}
    assert probe["periodSeconds"] == STARTUP_PERIOD_SECONDS
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1805
    assert probe["periodSeconds"] * (probe["failureThreshold"] - 1) < 1805


def test_readiness_on_health_and_liveness_cannot_kill_a_loading_model() -> None:
    c = container(build_deployment(isvc()))
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    live = c["livenessProbe"]
    # Kubernetes runs liveness only after the startup probe succeeded; no initial delay is needed,
    # and a busy engine gets minutes, not seconds, before it is restarted.
    assert "startupProbe" in c
    assert live["httpGet"]["path"] == "/health"
    assert live["periodSeconds"] * live["failureThreshold"] >= 120
    assert live["timeoutSeconds"] >= 5


@pytest.mark.parametrize(("pre_stop", "shutdown"), [(10, 30), (0, 0), (60, 600)])
def test_grace_period_covers_pre_stop_and_drain(pre_stop: int, shutdown: int) -> None:
    dep = build_deployment(isvc(rollout={"preStopSeconds": pre_stop, "shutdownTimeoutSeconds": shutdown}))
    pod = dep["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + shutdown
    args = container(dep)["args"]
    assert args[args.index("--shutdown-timeout") + 1] == str(shutdown)
    if pre_stop:
        assert container(dep)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
    else:
        assert "lifecycle" not in container(dep)


@pytest.mark.parametrize(("replicas", "surge", "expected"), [
    (2, 1, {"maxSurge": 1, "maxUnavailable": 0}),
    (1, 2, {"maxSurge": 2, "maxUnavailable": 0}),
    (3, 0, {"maxSurge": 0, "maxUnavailable": 1}),
])
def test_rolling_update_never_drops_below_ready_unless_no_surge(replicas: int, surge: int,
                                                                 expected: dict[str, int]) -> None:
    dep = build_deployment(isvc(replicas=replicas, rollout={"maxSurge": surge}))
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": expected}


def test_progress_deadline_and_replicas_from_spec() -> None:
    dep = build_deployment(isvc(replicas=3, rollout={"progressDeadlineSeconds": 900, "startupTimeoutSeconds": 600}))
    assert dep["spec"]["progressDeadlineSeconds"] == 900
    assert dep["spec"]["replicas"] == 3


def test_gpus_shm_and_hf_token() -> None:
    dep = build_deployment(isvc(resources={"gpus": 2, "gpuResource": "amd.com/gpu", "cpu": "8",
                                           "memory": "64Gi", "shmSize": "16Gi"},
                                engine={"tensorParallelSize": 2},
                                hfTokenSecret={"name": "hf", "key": "token"}))
    c = container(dep)
    assert c["resources"]["limits"] == {"amd.com/gpu": 2, "cpu": "8", "memory": "64Gi"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert c["env"] == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert dep["spec"]["template"]["spec"]["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]


def test_twin_uses_the_operator_image_and_requests_no_gpu() -> None:
    dep = build_deployment(isvc(engine={"kind": "twin"}, resources={"gpus": 0}),
                           RenderOptions(twin_image="registry.local/kvpilot:1.2"))
    c = container(dep)
    assert c["image"] == "registry.local/kvpilot:1.2"
    assert c["command"] == ["kvpilot", "twin", "serve"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert dep["metadata"]["labels"]["app.kubernetes.io/name"] == "kvpilot-twin"


def test_every_child_has_labels_and_a_controller_owner_reference() -> None:
    svc = isvc()
    for manifest in render_manifests(svc):
        meta = manifest["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [{
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "name": "llama",
            "uid": svc.metadata.uid, "controller": True, "blockOwnerDeletion": True}]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/instance"] == "llama"
        assert labels["app.kubernetes.io/managed-by"] == "kvpilot"
        assert labels["kvpilot.dev/inferenceservice"] == "llama"
        assert "app.kubernetes.io/name" in labels


def test_selector_matches_the_pod_template() -> None:
    dep = build_deployment(isvc())
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_children_by_replicas_and_monitoring() -> None:
    kinds = [m["kind"] for m in render_manifests(isvc(replicas=1))]
    assert kinds == ["Deployment", "Service", "ServiceMonitor", "PrometheusRule"]
    kinds = [m["kind"] for m in render_manifests(isvc(replicas=2), RenderOptions(service_monitors=False,
                                                                                prometheus_rules=False))]
    assert kinds == ["Deployment", "Service", "PodDisruptionBudget"]
    pdb = render_manifests(isvc(replicas=2))[2]
    assert pdb["spec"]["maxUnavailable"] == 1
    service = render_manifests(isvc())[1]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


@pytest.mark.parametrize(("monitor", "kinds", "unwanted"), [
    ("ServiceMonitor", ["ServiceMonitor"], ["PodMonitor"]),
    ("PodMonitor", ["PodMonitor"], ["ServiceMonitor"]),
    ("None", [], ["ServiceMonitor", "PodMonitor"]),
])
def test_spec_observability_monitor_picks_the_monitor(monitor: str, kinds: list[str], unwanted: list[str]) -> None:
    svc = isvc(replicas=1, observability={"monitor": monitor})
    rendered = [m["kind"] for m in render_manifests(svc)]
    assert rendered == ["Deployment", "Service", *kinds, "PrometheusRule"]
    assert [m["kind"] for m in unwanted_monitors(svc)] == unwanted
    # A cluster that serves only ServiceMonitors: a PodMonitor is left out, not created in vain.
    only_sm = RenderOptions(pod_monitors=False)
    assert [m["kind"] for m in render_manifests(svc, only_sm)][2:-1] == [k for k in kinds if k == "ServiceMonitor"]
    assert "PodMonitor" not in [m["kind"] for m in unwanted_monitors(svc, only_sm)]


def test_both_monitors_copy_the_inferenceservice_and_track_pod_labels_and_scrape_the_named_port() -> None:
    svc = isvc(replicas=1)
    sm, pm = build_monitor(svc, MonitorKind.SERVICE_MONITOR), build_monitor(svc, MonitorKind.POD_MONITOR)
    dep = build_deployment(svc)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in container(dep)["ports"]}
    for monitor, endpoints in ((sm, sm["spec"]["endpoints"]), (pm, pm["spec"]["podMetricsEndpoints"])):
        assert monitor["spec"]["podTargetLabels"] == ["kvpilot.dev/inferenceservice", "kvpilot.dev/track"]
        assert set(monitor["spec"]["podTargetLabels"]) <= pod_labels.keys()
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert [e["port"] for e in endpoints] == ["http"] and "http" in ports
    with pytest.raises(ValueError, match="None"):
        build_monitor(svc, MonitorKind.NONE)


def _hash(dep: dict[str, Any]) -> str:
    value = dep["spec"]["template"]["metadata"]["annotations"][ANNOTATION_CONFIG_HASH]
    assert dep["metadata"]["annotations"][ANNOTATION_CONFIG_HASH] == value
    return str(value)


def test_config_hash_is_stable_and_ignores_slo_and_tuning() -> None:
    base = build_deployment(isvc())
    assert _hash(base) == _hash(build_deployment(isvc()))
    retargeted = build_deployment(isvc(slo={"ttftSeconds": 1.0, "itlSeconds": 0.1, "objective": 0.999},
                                       tuning={"enabled": True, "maxTrials": 5}))
    assert retargeted["spec"]["template"] == base["spec"]["template"]
    # Scaling changes the Deployment, not the pods.
    assert _hash(build_deployment(isvc(replicas=5))) == _hash(base)


@pytest.mark.parametrize("change", [
    {"engine": {"maxNumBatchedTokens": 4096}},
    {"engine": {"gpuMemoryUtilization": 0.8}},
    {"engine": {"extraArgs": ["--enable-prefix-caching"]}},
    {"resources": {"memory": "48Gi"}},
    {"rollout": {"preStopSeconds": 20}},
    {"model": "Qwen/Qwen2.5-7B-Instruct"},
])
def test_config_hash_changes_with_what_the_pod_runs(change: dict[str, Any]) -> None:
    assert _hash(build_deployment(isvc(**change))) != _hash(build_deployment(isvc()))


def test_engine_annotation_records_the_engine_and_an_override_wins() -> None:
    import json

    from kvpilot.api.models import EngineSpec

    svc = isvc(engine={"maxNumBatchedTokens": 8192})
    good = EngineSpec.model_validate({"maxNumBatchedTokens": 2048})
    dep = build_deployment(svc, engine=good)
    assert json.loads(dep["metadata"]["annotations"][ANNOTATION_ENGINE])["maxNumBatchedTokens"] == 2048
    args = container(dep)["args"]
    assert args[args.index("--max-num-batched-tokens") + 1] == "2048"
    assert _hash(dep) == _hash(build_deployment(isvc(engine={"maxNumBatchedTokens": 2048})))


def test_twin_pods_fit_the_restricted_pod_security_standard() -> None:
    pod = build_deployment(isvc(engine={"kind": "twin"}))["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    # The image's USER: the twin pods run the kvpilot image.
    user = re.findall(r"^USER (\d+)", (Path(__file__).resolve().parents[3] / "Dockerfile").read_text(), re.M)
    assert pod["securityContext"]["runAsUser"] == int(user[-1])
    # The read-only root filesystem leaves /tmp (the image's HOME) and /dev/shm writable.
    mounts = {m["mountPath"]: m["name"] for m in container({"spec": {"template": {"spec": pod}}})["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == {"/tmp", "/dev/shm"}
    assert all("emptyDir" in volumes[name] for name in mounts.values())


# What "restricted" asks beyond "baseline" that a root vLLM container does not give (plus the
# read-only root, which pss.py asks for too): everything else of the standard it meets.
ROOT_ONLY = ("runAsNonRoot is not true", "runAsUser None is not a numeric non-root id",
             "readOnlyRootFilesystem is not true")


def test_vllm_pods_drop_every_capability_and_keep_the_images_user_by_default() -> None:
    """vllm/vllm-openai runs as root and caches under /root/.cache: its own user, nothing more."""
    pod = build_deployment(isvc())["spec"]["template"]["spec"]
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "runAsUser" not in sc and "runAsUser" not in pod["securityContext"]
    assert restricted_violations(pod) == [f"engine: {problem}" for problem in ROOT_ONLY]


def test_vllm_pods_run_as_the_operators_uid_fit_restricted_with_their_caches_on_empty_dirs() -> None:
    svc = isvc(hfTokenSecret={"name": "hf", "key": "token"})
    pod = build_deployment(svc, RenderOptions(engine_run_as_user=1001))["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["securityContext"]["runAsUser"] == 1001 and pod["securityContext"]["fsGroup"] == 1001
    c = pod["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    # HOME holds every cache (~/.cache/huggingface, vLLM's, Triton's); USER gives getpass a name,
    # which torch's cache set-up asks for and a uid without a passwd entry cannot give.
    assert env["USER"]["value"] and env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == {env["HOME"]["value"], "/tmp", "/dev/shm"}
    assert all("emptyDir" in volumes[name] for name in mounts.values())
    # A change of the setting is a change of what the pods run: a new config hash, a rollout.
    assert _hash(build_deployment(svc)) != _hash(build_deployment(svc, RenderOptions(engine_run_as_user=1001)))


@pytest.mark.parametrize("kind", ["vllm", "twin"])
def test_engine_pods_get_no_service_account_token(kind: str) -> None:
    pod = build_deployment(isvc(engine={"kind": kind}))["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize("kind", ["vllm", "twin"])
def test_the_engines_termination_message_is_its_log_tail_on_error(kind: str) -> None:
    """vLLM writes no termination-log file: the kubelet keeps its log's tail, where the operator
    reads vLLM's start-up error (builders.pods)."""
    assert container(build_deployment(isvc(engine={"kind": kind})))["terminationMessagePolicy"] == \
        "FallbackToLogsOnError"


@pytest.mark.parametrize(("gpu_type", "selected"), [
    ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-80GB-HBM3"),  # a product label stays as written
    ("H100-80GB", "NVIDIA-H100-80GB-HBM3"),  # a twin name becomes its board's product label
    ("a100", "NVIDIA-A100-SXM4-80GB"),  # so does any spelling the twin resolves
    ("H200", "NVIDIA-H200"),
    ("NVIDIA-B200", "NVIDIA-B200"),  # a GPU the twin does not model is still selected on
])
@pytest.mark.parametrize("kind", ["vllm", "twin"])
def test_gpu_type_becomes_the_gpu_product_node_selector(gpu_type: str, selected: str, kind: str) -> None:
    dep = build_deployment(isvc(engine={"kind": kind}, resources={"gpuType": gpu_type}))
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": selected}


def test_no_gpu_type_no_node_selector_and_the_same_hash_as_before() -> None:
    dep = build_deployment(isvc())
    assert "nodeSelector" not in dep["spec"]["template"]["spec"]
    assert _hash(dep) != _hash(build_deployment(isvc(resources={"gpuType": "H100-80GB"})))


def test_twin_pods_mount_the_model_config_map_and_read_it() -> None:
    ref = {"configMapRef": {"name": "llama-config", "key": "llama.json"}}
    dep = build_deployment(isvc(engine={"kind": "twin"}, modelConfig=ref))
    pod = dep["spec"]["template"]["spec"]
    c = container(dep)
    assert {"name": "model-config", "configMap": {"name": "llama-config",
                                                  "items": [{"key": "llama.json", "path": "config.json"}]}} in pod["volumes"]
    assert {"name": "model-config", "mountPath": "/etc/kvpilot/model", "readOnly": True} in c["volumeMounts"]
    i = c["args"].index("--model-config")
    assert c["args"][i + 1] == "/etc/kvpilot/model/config.json"
    assert not restricted_violations(pod)
    # vLLM reads the real model's config itself: its pods get neither.
    vllm = build_deployment(isvc(modelConfig=ref))
    assert "--model-config" not in container(vllm)["args"]
    assert all("configMap" not in v for v in vllm["spec"]["template"]["spec"]["volumes"])
