"""The real-cluster suite: opt-in, against the current kube context.

Enable with KVPILOT_E2E=1 (or `--e2e`, where the repository's root conftest registers that
option). Without it every test here is skipped with the reason; with it but without kubectl,
helm or a reachable cluster, they are skipped naming what is missing. See README.md here.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.kube import CommandError, helm, kubectl, kubectl_json, missing_tools

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
HERE = Path(__file__).resolve().parent

DISABLED_REASON = "real-cluster e2e suite: opt in with KVPILOT_E2E=1 (or --e2e) and a kube context"


def e2e_enabled(config: pytest.Config) -> bool:
    if os.environ.get("KVPILOT_E2E", "").lower() in ("1", "true", "yes"):
        return True
    try:
        return bool(config.getoption("--e2e"))
    except ValueError:  # the option is not registered (it lives in the root conftest, if anywhere)
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A conftest's hook sees the whole session's items: touch only this directory's.
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    for item in mine:
        item.add_marker(pytest.mark.e2e)
    if not e2e_enabled(config):
        for item in mine:
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


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings.from_env()


@pytest.fixture(scope="session")
def cluster() -> str:
    """The current kube context, once it is known to answer."""
    missing = missing_tools()
    if missing:
        pytest.skip(f"e2e needs {' and '.join(missing)} on PATH")
    try:
        context = kubectl("config", "current-context", timeout=20).strip()
        kubectl("version", "-o", "json", timeout=30)
    except CommandError as exc:
        pytest.skip(f"no reachable Kubernetes cluster in the current kube context: {exc}")
    return context


@pytest.fixture(scope="session")
def namespace(cluster: str) -> Iterator[str]:
    """A fresh namespace, deleted afterwards. The chart's pods fit the "restricted" Pod Security
    Standard; engine pods (vLLM needs more, the twin gets the same pod spec) are held to
    "baseline", and the API server warns about anything short of "restricted"."""
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


def _release_leftovers(release: str) -> list[str]:
    """Objects still labelled with the release, cluster-wide (namespaced and cluster-scoped)."""
    kinds = (
        "deployments,services,serviceaccounts,configmaps,roles,rolebindings,clusterroles,clusterrolebindings"
    )
    listing = kubectl_json("get", kinds, "-A", "-l", f"app.kubernetes.io/instance={release}")
    return [
        f"{i['kind']}/{i['metadata'].get('namespace', '')}/{i['metadata']['name']}" for i in listing["items"]
    ]


@pytest.fixture(scope="session")
def release(
    settings: Settings, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """`helm install` of charts/kvpilot into the test namespace; `helm uninstall` after, checked clean."""
    name = "kvpilot-e2e"
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
    values_file = tmp_path_factory.mktemp("helm") / "values.json"
    values_file.write_text(json.dumps(values))
    helm(
        "install",
        name,
        str(CHART),
        "--namespace",
        namespace,
        "--values",
        str(values_file),
        "--wait",
        "--timeout",
        "5m",
    )
    try:
        yield Release(name=name, namespace=namespace, fullname=name)  # the name already says kvpilot
    finally:
        helm("uninstall", name, "--namespace", namespace, "--wait", "--timeout", "5m")
        leftovers = _release_leftovers(name)
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
