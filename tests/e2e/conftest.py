"""The e2e suite's targets, settings, and the namespace and Helm release fixtures.

Two targets (README.md here says which steps run where and why):

- `kube-context`: the current kube context with `kubectl` and `helm` from PATH. Opt-in, with
  KVPILOT_E2E=1 (or `--e2e`, where the repository's root conftest registers that option); opted in
  but without kubectl, helm or a reachable cluster, skipped naming what is missing. Marker `e2e`.
- `control-plane`: the `cluster` tests' real control plane (harness/cluster.py: etcd,
  kube-apiserver, controllers, kube-scheduler, kwok as the kubelet), run wherever its binaries are
  built, CI included (marker `cluster`; a missing build skips, or fails with CI=true). kwok runs no
  container: the chart's operator pod is Ready but empty, so the operator runs here as a local
  `kvpilot operator` process with the arguments and the ServiceAccount Helm installed for it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.kube import CommandError, Helm, HelmCLI, HelmLibrary, Kubectl, missing_tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
HERE = Path(__file__).resolve().parent

DISABLED_REASON = "real-cluster e2e suite: opt in with KVPILOT_E2E=1 (or --e2e) and a kube context"
NO_POD_NETWORK = ("needs running containers and pod networking (a load pod reaching the engine through its "
                  "Service); kwok runs no container and the control plane has no kube-proxy or CNI")


def e2e_enabled(config: pytest.Config) -> bool:
    if os.environ.get("KVPILOT_E2E", "").lower() in ("1", "true", "yes"):
        return True
    try:
        return bool(config.getoption("--e2e"))
    except ValueError:  # the option is not registered (it lives in the root conftest, if anywhere)
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items: touch only this directory's, and of those
    # only the kube-context ones (marked `e2e` by the `target` fixture's parameter).
    if e2e_enabled(config):
        return
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents and item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.skip(reason=DISABLED_REASON))


@dataclass(frozen=True)
class Settings:
    """What the suite installs; each can be changed through the environment (README.md)."""

    image_repository: str
    image_tag: str
    scope: str  # namespace | cluster
    ready_timeout: float
    rollout_timeout: float

    @classmethod
    def from_env(cls) -> Settings:
        image = os.environ.get("KVPILOT_E2E_IMAGE", "ghcr.io/kvpilot/kvpilot:0.1.0")
        repository, _, tag = image.rpartition(":")
        if not repository or "/" in tag:
            raise pytest.UsageError(f"KVPILOT_E2E_IMAGE must be REPOSITORY:TAG, got {image!r}")
        scope = os.environ.get("KVPILOT_E2E_RBAC_SCOPE", "namespace")
        if scope not in ("namespace", "cluster"):
            raise pytest.UsageError(f"KVPILOT_E2E_RBAC_SCOPE must be namespace or cluster, got {scope!r}")
        return cls(
            image_repository=repository,
            image_tag=tag,
            scope=scope,
            ready_timeout=float(os.environ.get("KVPILOT_E2E_READY_TIMEOUT", "300")),
            rollout_timeout=float(os.environ.get("KVPILOT_E2E_ROLLOUT_TIMEOUT", "600")),
        )

    @property
    def image(self) -> str:
        return f"{self.image_repository}:{self.image_tag}"


@pytest.fixture(scope="package")
def settings() -> Settings:
    return Settings.from_env()


@dataclass(frozen=True)
class Target:
    """Where the suite runs and what that place can do."""

    name: str
    kubectl: Kubectl
    helm: Helm
    # Pods really run and a pod reaches another through a Service (kube-proxy, CNI, a runtime).
    pod_network: bool
    control_plane: Any = None  # harness.cluster.ControlPlane, for the control-plane target


@pytest.fixture(scope="package", params=[
    pytest.param("control-plane", marks=pytest.mark.cluster, id="control-plane"),
    pytest.param("kube-context", marks=pytest.mark.e2e, id="kube-context"),
])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    if request.param == "kube-context":
        yield _kube_context()
        return
    from harness.cluster import ControlPlane, built_binaries

    bin_dir = built_binaries()
    # kwok's default stages: every pod bound to the node turns Running and Ready at once.
    with ControlPlane(bin_dir, tmp_path_factory.mktemp("e2e-control-plane")) as cp:
        cp.add_node("kwok-node-0", gpus=0)
        yield Target("control-plane", Kubectl(str(bin_dir / "kubectl"), cp.admin_kubeconfig),
                     HelmLibrary(cp.admin_kubeconfig), pod_network=False, control_plane=cp)
        cp.check_alive()


def _kube_context() -> Target:
    """The current kube context, once it is known to answer."""
    missing = missing_tools()
    if missing:
        pytest.skip(f"e2e needs {' and '.join(missing)} on PATH")
    kubectl = Kubectl()
    try:
        kubectl("config", "current-context", timeout=20)
        kubectl("version", "-o", "json", timeout=30)
    except CommandError as exc:
        pytest.skip(f"no reachable Kubernetes cluster in the current kube context: {exc}")
    return Target("kube-context", kubectl, HelmCLI(), pod_network=True)


@pytest.fixture(scope="package")
def namespace(target: Target) -> Iterator[str]:
    """A fresh namespace, deleted afterwards. The chart's pods fit the "restricted" Pod Security
    Standard; engine pods (vLLM needs more, the twin gets the same pod spec) are held to
    "baseline", and the API server warns about anything short of "restricted"."""
    kubectl = target.kubectl
    name = f"kvpilot-e2e-{secrets.token_hex(3)}"
    kubectl("create", "namespace", name)
    kubectl(
        "label",
        "namespace",
        name,
        "pod-security.kubernetes.io/enforce=baseline",
        "pod-security.kubernetes.io/warn=restricted",
        "app.kubernetes.io/part-of=kvpilot-e2e",
    )
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=true", "--ignore-not-found", timeout=300, check=False)


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    fullname: str


def _release_leftovers(kubectl: Kubectl, release: str) -> list[str]:
    """Objects still labelled with the release, cluster-wide (namespaced and cluster-scoped)."""
    kinds = (
        "deployments,services,serviceaccounts,configmaps,roles,rolebindings,clusterroles,clusterrolebindings"
    )
    listing = kubectl.json("get", kinds, "-A", "-l", f"app.kubernetes.io/instance={release}")
    return [
        f"{i['kind']}/{i['metadata'].get('namespace', '')}/{i['metadata']['name']}" for i in listing["items"]
    ]


@contextlib.contextmanager
def _local_operator(target: Target, release: str, namespace: str, workdir: Path) -> Iterator[None]:
    """The operator Helm installed, run as a local process: its container's arguments and its
    ServiceAccount's token (so the chart's Roles meet the real RBAC authorizer). kwok keeps the
    chart's own operator pod Ready, but nothing runs in it."""
    from harness.kmock_api import operator_process

    (deployment,) = target.kubectl.json(
        "get", "deployments", "-n", namespace,
        "-l", f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator")["items"]
    pod = deployment["spec"]["template"]["spec"]
    args = [a for a in pod["containers"][0]["args"][1:]  # [0] is the subcommand
            # The local process picks its own port and log format, and serves no admission webhook:
            # the API server calls the webhook's Service, never this process (failurePolicy decides).
            if not a.startswith(("--metrics-port", "--log-format", "--webhook-"))]
    kubeconfig = target.control_plane.service_account_kubeconfig(
        workdir / "operator.kubeconfig", namespace, pod["serviceAccountName"])
    with operator_process(kubeconfig, workdir, *args) as op:
        yield
        assert op.proc.poll() is None, f"the operator died:\n{op.log()[-4000:]}"
    forbidden = [line for line in op.log().splitlines() if re.search(r"\b403\b|[Ff]orbidden", line)]
    assert forbidden == [], "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


@pytest.fixture(scope="package")
def release(
    target: Target, settings: Settings, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """Helm install of charts/kvpilot into the test namespace (and waits for it); Helm uninstall
    after, checked clean."""
    name = "kvpilot-e2e"
    kubectl = target.kubectl
    crd_existed = bool(
        kubectl("get", "crd", "inferenceservices.kvpilot.dev", "--ignore-not-found", "-o", "name")
    )
    values = {
        "image": {"repository": settings.image_repository, "tag": settings.image_tag},
        # Namespace scope (the default here) keeps the suite to its own namespace on a shared cluster.
        "watch": {"allNamespaces": settings.scope == "cluster", "namespaces": [namespace]},
        "rbac": {"scope": settings.scope},
        # The tuner needs a Prometheus; the rollout is what is under test here.
        "tuner": {"enabled": False},
        "grafana": {"dashboard": {"enabled": False}},
    }
    target.helm.install(name, CHART, namespace, values, timeout_s=300)
    try:
        with contextlib.ExitStack() as stack:
            if target.control_plane is not None:
                stack.enter_context(_local_operator(target, name, namespace, tmp_path_factory.mktemp("operator")))
            yield Release(name=name, namespace=namespace, fullname=name)  # the name already says kvpilot
    finally:
        target.helm.uninstall(name, namespace, timeout_s=300)
        leftovers = _release_leftovers(kubectl, name)
        if not crd_existed:
            # Helm never deletes CRDs (that would delete every InferenceService); the suite
            # installed it, so the suite removes it.
            kubectl(
                "delete",
                "crd",
                "inferenceservices.kvpilot.dev",
                "--ignore-not-found",
                "--wait=true",
                timeout=180,
                check=False,
            )
        assert leftovers == [], f"helm uninstall left objects behind: {leftovers}"
