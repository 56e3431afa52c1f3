"""The tuner's server-side apply beside a GitOps tool's, as docs/gitops.md says they coexist.

The tuner is kvpilot's own KubernetesApplier, authenticated as the chart's tuner ServiceAccount;
"GitOps" is another field manager applying the manifest in Git. The operator runs as well, so the
tuner's apply only returns once the real rollout of the trial is complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import chart
from harness.cluster import ApiError, ControlPlane, Operator, wait_for
from tests.cluster.common import SERVING

pytestmark = pytest.mark.cluster

NAME = "gitops"
PATH = f"/apis/kvpilot.dev/v1alpha1/namespaces/{SERVING}/inferenceservices/{NAME}"
GITOPS = "gitops-controller"  # e.g. Flux's kustomize-controller
TUNED = ("maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs")


def in_git(**engine: Any) -> dict[str, Any]:
    """The manifest in Git: the tuned fields left out, as docs/gitops.md tells Flux users."""
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": SERVING},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2,
                     "engine": {"kind": "vllm", "maxModelLen": 8192, **engine},
                     "tuning": {"enabled": True, "space": {"maxNumBatchedTokens": [256, 16384]}}}}


def owners(obj: dict[str, Any], section: str = "engine") -> dict[str, set[str]]:
    """Field manager -> the spec.engine fields (or metadata.annotations) it owns."""
    out: dict[str, set[str]] = {}
    for entry in obj["metadata"].get("managedFields", []):
        fields = entry.get("fieldsV1", {})
        node = (fields.get("f:spec", {}).get("f:engine", {}) if section == "engine"
                else fields.get("f:metadata", {}).get("f:annotations", {}))
        owned = {k[2:] for k in node if k.startswith("f:")}
        if owned:
            out.setdefault(entry["manager"], set()).update(owned)
    return out


@pytest.fixture(scope="module")
def tuner(control_plane: ControlPlane, chart_identities: dict[str, str],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kvpilot.tuner.adapters.kubernetes import KubernetesApplier
    from kvpilot.tuner.kubeapi import KubeAPI

    path = control_plane.service_account_kubeconfig(
        tmp_path_factory.mktemp("tuner-sa") / "kubeconfig", chart.NAMESPACE, chart_identities["tuner"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(Path(path)))
        api = KubeAPI.from_environment()  # the tuner's own client, on the chart's tuner ServiceAccount
    try:
        yield KubernetesApplier(api, SERVING, NAME, timeout_s=120, poll_s=0.2)
    finally:
        api.close()


def test_tuner_and_gitops_own_disjoint_fields(control_plane: ControlPlane, operator: Operator,
                                              tuner: Any) -> None:
    from kvpilot.tuner.core.space import EngineParams

    control_plane.apply(PATH, in_git(), field_manager=GITOPS)
    wait_for(lambda: (control_plane.get(PATH).get("status") or {}).get("readyReplicas") == 2, timeout=90,
             what="the InferenceService Ready with 2 replicas")
    # The tuner's current engine is the CRD's defaults (nothing tuned is in Git).
    assert tuner.current().as_spec() == {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.92,
                                         "maxNumSeqs": 256}

    trial = EngineParams.from_spec({"maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 128})
    tuner.apply(trial, 1)  # returns once the operator reports the rollout complete
    obj = control_plane.get(PATH)
    assert {k: obj["spec"]["engine"][k] for k in TUNED} == trial.as_spec()
    # Each engine field has exactly one owner; the operator owns none (it writes no spec).
    assert owners(obj) == {"kvpilot-tuner": set(TUNED), GITOPS: {"kind", "maxModelLen"}}
    assert "kvpilot.dev/tuning-trial" in owners(obj, "annotations")["kvpilot-tuner"]

    # GitOps syncs a change of its own: no conflict, and the tuned values stay.
    changed = in_git()
    changed["spec"]["slo"] = {"objective": 0.995}
    control_plane.apply(PATH, changed, field_manager=GITOPS)
    obj = control_plane.get(PATH)
    assert {k: obj["spec"]["engine"][k] for k in TUNED} == trial.as_spec()
    assert obj["spec"]["slo"]["objective"] == 0.995

    # A manifest that still sets a tuned field conflicts with the tuner instead of undoing the trial.
    with pytest.raises(ApiError) as conflict:
        control_plane.apply(PATH, in_git(maxNumBatchedTokens=2048), field_manager=GITOPS)
    assert conflict.value.status == 409
    assert "kvpilot-tuner" in conflict.value.message and ".spec.engine.maxNumBatchedTokens" in conflict.value.message
    assert control_plane.get(PATH)["spec"]["engine"]["maxNumBatchedTokens"] == 4096

    # The tuner's apply is forced: the next trial takes over even a field GitOps forced back.
    control_plane.apply(PATH, in_git(maxNumBatchedTokens=2048), field_manager=GITOPS, force=True)
    assert "maxNumBatchedTokens" in owners(control_plane.get(PATH))[GITOPS]
    tuner.apply(EngineParams.from_spec({"maxNumBatchedTokens": 8192, "gpuMemoryUtilization": 0.9,
                                        "maxNumSeqs": 128}), 2)
    obj = control_plane.get(PATH)
    assert obj["spec"]["engine"]["maxNumBatchedTokens"] == 8192
    assert "maxNumBatchedTokens" not in owners(obj)[GITOPS]
    assert obj["metadata"]["annotations"]["kvpilot.dev/tuning-trial"] == "2"
    control_plane.delete(PATH)
