"""The `cluster` tests: one real control plane for this package (harness/cluster.py).

Binaries come from `make control-plane` (scripts/build-control-plane.sh), cached by version.
Without them the tests skip, saying how to build them; in CI (CI=true) a missing binary fails.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import chart
from harness.cluster import (
    ApiError,
    ControlPlane,
    Operator,
    built_binaries,
    wait_for,
)
from tests.cluster.common import CRD_FILE, KWOK_STAGES, NODE, RBAC_KINDS, SERVING


@pytest.fixture(scope="package")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with ControlPlane(built_binaries(), tmp_path_factory.mktemp("control-plane"), kwok_config=KWOK_STAGES) as cp:
        cp.add_node(NODE)
        yield cp
        cp.check_alive()




@pytest.fixture(scope="package")
def crd(control_plane: ControlPlane) -> dict[str, Any]:
    """The project's CRD, created as-is (a compile error in any CEL rule, a rule over the cost
    budget or a non-structural schema makes the API server refuse it), once Established."""
    manifest = yaml.safe_load(CRD_FILE.read_text())
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    try:
        control_plane.create(path, manifest)
    except ApiError as exc:
        pytest.fail(f"the API server refused crds/{CRD_FILE.name}: {exc}")

    def established() -> dict[str, Any] | None:
        live = control_plane.get(f"{path}/{manifest['metadata']['name']}")
        conds = {c["type"]: c for c in live.get("status", {}).get("conditions", [])}
        return live if conds.get("Established", {}).get("status") == "True" else None
    live = dict(wait_for(established, timeout=30, what="the CRD Established"))
    # Established is not yet served: the first calls may answer 429 "storage is (re)initializing".
    wait_for(lambda: control_plane.get("/apis/kvpilot.dev/v1alpha1/inferenceservices"), timeout=30,
             what="InferenceServices served")
    return live


@pytest.fixture(scope="package")
def chart_identities(control_plane: ControlPlane) -> dict[str, str]:
    """The chart's ServiceAccounts and RBAC, rendered by Helm's own engine with the default values
    and created as rendered; returns component -> ServiceAccount name (in chart.NAMESPACE)."""
    objects = [r.obj for r in chart.render("default") if r.kind in RBAC_KINDS]
    if control_plane.get_or_none(f"/api/v1/namespaces/{chart.NAMESPACE}") is None:
        control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": chart.NAMESPACE}})
    control_plane.apply_manifests(objects)
    accounts = [o for o in objects if o["kind"] == "ServiceAccount"]
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["metadata"]["name"] for o in accounts}


@pytest.fixture(scope="package")
def serving(control_plane: ControlPlane) -> str:
    """The namespace the InferenceServices under test live in."""
    control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": SERVING}})
    # Pods need their namespace's "default" ServiceAccount (the serviceaccount controller makes it).
    wait_for(lambda: control_plane.get_or_none(f"/api/v1/namespaces/{SERVING}/serviceaccounts/default"),
             timeout=30, what="the default ServiceAccount in " + SERVING)
    return SERVING


@pytest.fixture(scope="package")
def operator_kubeconfig(control_plane: ControlPlane, chart_identities: dict[str, str],
                        tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("operator-sa") / "kubeconfig"
    return control_plane.service_account_kubeconfig(path, chart.NAMESPACE, chart_identities["operator"])


@pytest.fixture(scope="package")
def operator(control_plane: ControlPlane, crd: dict[str, Any], serving: str, operator_kubeconfig: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(operator_kubeconfig, tmp_path_factory.mktemp("operator"))
    try:
        yield op
        assert op.current.proc.poll() is None, f"operator died:\n{op.current.log()[-4000:]}"
        assert op.current.stop() == 0, f"operator did not shut down cleanly:\n{op.current.log()[-4000:]}"
    finally:
        op.close()
    forbidden = [line for line in op.log().splitlines() if re.search(r"\b403\b|[Ff]orbidden", line)]
    assert forbidden == [], "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])
