"""The whole path: helm install -> a twin InferenceService becomes Ready -> steady load through its
Service -> change maxNumBatchedTokens -> the rollout completes with not one failed request ->
delete -> helm uninstall leaves nothing behind (conftest.py).

One body, two targets (conftest.py): on a real cluster all of it; on the `cluster` tests' control
plane everything but the load (steps 4 and 6 of README.md), which needs running containers and
pod networking.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import NO_POD_NETWORK, Release, Settings, Target
from tests.e2e.kube import Kubectl, condition, wait_for

ROOT = Path(__file__).resolve().parents[2]
LOAD_SCRIPT = Path(__file__).resolve().parent / "load.py"

RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def twin_service(namespace: str) -> dict[str, Any]:
    """examples/twin.yaml, with tuning off (the test changes the engine itself)."""
    obj = yaml.safe_load((ROOT / "examples" / "twin.yaml").read_text())
    obj["metadata"]["namespace"] = namespace
    obj["metadata"]["name"] = "e2e-twin"
    obj["spec"]["replicas"] = 2
    obj["spec"]["tuning"] = {"enabled": False}
    return dict(obj)


def get_isvc(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    return dict(kubectl.json("get", "inferenceservices.kvpilot.dev", name, "-n", namespace))


def ready_at_generation(kubectl: Kubectl, namespace: str, name: str, replicas: int) -> dict[str, Any] | None:
    """The InferenceService once the operator has seen its current generation and says Ready."""
    obj = get_isvc(kubectl, namespace, name)
    status = obj.get("status") or {}
    ready = condition(obj, "Ready")
    if (
        status.get("observedGeneration") == obj["metadata"]["generation"]
        and ready is not None
        and ready["status"] == "True"
        and status.get("readyReplicas") == replicas
        and status.get("updatedReplicas", replicas) == replicas
    ):
        return obj
    return None


def engine_pods(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def flag_value(pod: dict[str, Any], flag: str) -> str | None:
    container = pod["spec"]["containers"][0]
    args = list(container.get("command", [])) + list(container.get("args", []))
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return str(args[i + 1])
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def load_pod(namespace: str, service: str, model: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "e2e-load",
            "namespace": namespace,
            "labels": {"app.kubernetes.io/name": "e2e-load"},
        },
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "load",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", LOAD_SCRIPT.read_text()],
                    "env": [
                        {"name": "LOAD_URL", "value": f"http://{service}.{namespace}.svc:8000"},
                        {"name": "LOAD_MODEL", "value": model},
                        {"name": "LOAD_CONCURRENCY", "value": "4"},
                    ],
                    "securityContext": RESTRICTED_CONTAINER,
                    "resources": {
                        "requests": {"cpu": "50m", "memory": "64Mi"},
                        "limits": {"memory": "128Mi"},
                    },
                }
            ],
        },
    }


def load_progress(kubectl: Kubectl, namespace: str) -> dict[str, int]:
    lines = [ln for ln in kubectl("logs", "e2e-load", "-n", namespace).splitlines() if ln.startswith("{")]
    return dict(json.loads(lines[-1])) if lines else {"ok": 0, "failed": 0, "in_flight": 0}


@pytest.mark.timeout(1800)
def test_changing_the_chunk_size_rolls_out_without_a_failed_request(
    target: Target, release: Release, settings: Settings
) -> None:
    if not target.pod_network:
        pytest.skip(NO_POD_NETWORK)
    chunk_size_rollout(target.kubectl, release, settings, load=True)


@pytest.mark.timeout(900)
def test_changing_the_chunk_size_rolls_out(target: Target, release: Release, settings: Settings) -> None:
    """Steps 1-3, 5, 7, 8 where pods run nothing: the same body without the load."""
    if target.pod_network:
        pytest.skip("on a cluster with pod networking the test with load runs these steps")
    chunk_size_rollout(target.kubectl, release, settings, load=False)


def chunk_size_rollout(kubectl: Kubectl, release: Release, settings: Settings, *, load: bool) -> None:
    """Steps 3-7 of README.md; `load` runs steps 4 and 6 (load through the Service) as well."""
    ns = release.namespace
    isvc = twin_service(ns)
    name, replicas = isvc["metadata"]["name"], isvc["spec"]["replicas"]
    model = isvc["spec"].get("servedModelName") or isvc["spec"]["model"]

    kubectl.apply(isvc)
    try:
        wait_for(
            lambda: ready_at_generation(kubectl, ns, name, replicas),
            timeout=settings.ready_timeout,
            what=f"InferenceService {ns}/{name} to be Ready with {replicas} replicas",
        )
        before = {p["metadata"]["name"] for p in engine_pods(kubectl, ns, name)}
        assert len(before) == replicas
        assert {flag_value(p, "--max-num-batched-tokens") for p in engine_pods(kubectl, ns, name)} == {"2048"}

        with contextlib.ExitStack() as stack:
            if load:  # steady load through the Service, from inside the cluster
                kubectl.apply(load_pod(ns, name, model, settings.image))
                stack.callback(kubectl, "delete", "pod", "e2e-load", "-n", ns, "--ignore-not-found",
                               "--wait=false", check=False)
                wait_for(lambda: load_progress(kubectl, ns)["ok"] >= 20, timeout=180,
                         what="the load to get 20 answers")

            kubectl(
                "patch",
                "inferenceservices.kvpilot.dev",
                name,
                "-n",
                ns,
                "--type",
                "merge",
                "-p",
                json.dumps({"spec": {"engine": {"maxNumBatchedTokens": 4096}}}),
            )
            at_change = load_progress(kubectl, ns) if load else {}

            def rolled_out() -> bool:
                pods = engine_pods(kubectl, ns, name)
                return (
                    ready_at_generation(kubectl, ns, name, replicas) is not None
                    and len(pods) == replicas
                    and not ({p["metadata"]["name"] for p in pods} & before)
                    and {flag_value(p, "--max-num-batched-tokens") for p in pods} == {"4096"}
                )

            wait_for(
                rolled_out,
                timeout=settings.rollout_timeout,
                what="every engine pod to be replaced by one with --max-num-batched-tokens 4096",
            )
            if load:
                summary = stop_load(kubectl, ns)
                assert summary["failed"] == 0, f"requests failed during the rollout: {summary['errors']}"
                assert summary["ok"] > at_change["ok"] + 20, "the load must have run through the whole rollout"
        final = get_isvc(kubectl, ns, name)
        assert final["status"]["observedGeneration"] == final["metadata"]["generation"]
    finally:
        kubectl(
            "delete",
            "inferenceservices.kvpilot.dev",
            name,
            "-n",
            ns,
            "--ignore-not-found",
            "--wait=true",
            timeout=300,
            check=False,
        )

    # Owner references: the operator's children go with their InferenceService.
    wait_for(
        lambda: (
            not kubectl.json(
                "get", "deployments,services", "-n", ns, "-l", f"app.kubernetes.io/instance={name}"
            )["items"]
        ),
        timeout=180,
        what="the engine Deployment and Service to be garbage-collected",
    )


def stop_load(kubectl: Kubectl, ns: str) -> dict[str, Any]:
    """Step 6: 20 more answers from the new pods, then SIGTERM the load and read its summary."""
    after_rollout = load_progress(kubectl, ns)["ok"]
    wait_for(
        lambda: load_progress(kubectl, ns)["ok"] >= after_rollout + 20,
        timeout=120,
        what="20 more answers from the new pods",
    )
    kubectl("exec", "e2e-load", "-n", ns, "--", "python", "-c", "import os, signal; os.kill(1, signal.SIGTERM)")
    wait_for(
        lambda: kubectl.json("get", "pod", "e2e-load", "-n", ns)["status"]["phase"] in ("Succeeded", "Failed"),
        timeout=120,
        what="the load to stop",
    )
    summary_line = next(ln for ln in kubectl("logs", "e2e-load", "-n", ns).splitlines() if ln.startswith("SUMMARY "))
    return dict(json.loads(summary_line.removeprefix("SUMMARY ")))
