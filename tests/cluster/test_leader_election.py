"""Leader election against a real kube-apiserver: two `kvpilot operator --leader-elect` processes
as the chart's operator ServiceAccount, so every Lease call meets the real RBAC authorizer with the
Role the chart renders, and the real API server validates and stores the Lease (MicroTime fields,
resourceVersion preconditions on merge patches).

The replicas watch a namespace of their own with nothing in it: the package's other operator (all
namespaces) may be running, and which replica reconciles is the KMock test's subject
(tests/integration/operator/test_leader_election.py); here it is the Lease as Kubernetes keeps it.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import chart
from harness.cluster import ControlPlane, wait_for
from harness.kmock_api import OperatorProcess, operator_process

pytestmark = pytest.mark.cluster

LEASE_SECONDS = 3
LEASE = f"{chart.RELEASE}-kvpilot-operator"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{chart.NAMESPACE}/leases/{LEASE}"
WATCHED = "ha-quiet"


def micro(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)


def identity(op: OperatorProcess) -> str:
    found = re.search(r"contending for the lease \S+ as ([^\s\"]+)", op.log())
    assert found, op.log()[-2000:]
    return found.group(1)


def leads(op: OperatorProcess) -> bool:
    return re.search(r"^kvpilot_operator_leader 1\.0$", op.http_get("/metrics")[1], re.M) is not None


@pytest.fixture
def replicas(control_plane: ControlPlane, operator_kubeconfig: Path,
             tmp_path: Path) -> Iterator[list[OperatorProcess]]:
    if control_plane.get_or_none(f"/api/v1/namespaces/{WATCHED}") is None:
        control_plane.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": WATCHED}})
    # The chart's election flags, with short timings; the Lease's namespace is the default one, the
    # namespace of the ServiceAccount's kubeconfig context (the chart's release namespace).
    (deployment,) = [r.obj for r in chart.render("default") if r.kind == "Deployment" and r.name.endswith("-operator")]
    chart_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    args = ["--leader-elect", f"--leader-elect-lease-duration={LEASE_SECONDS}", "--leader-elect-renew-deadline=2",
            "--leader-elect-retry-period=0.5",
            *[a for a in chart_args if a.startswith("--leader-elect-resource-name=")],
            f"--namespace={WATCHED}"]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(operator_process(operator_kubeconfig, tmp_path, *args, log_name=f"replica-{i}.log"))
               for i in range(2)]
    if control_plane.get_or_none(LEASE_PATH) is not None:  # the next test starts without a holder
        control_plane.delete(LEASE_PATH)
    for log in sorted(tmp_path.glob("replica-*.log")):
        forbidden = [line for line in log.read_text(errors="replace").splitlines()
                     if re.search(r"\b403\b|[Ff]orbidden", line)]
        assert forbidden == [], "the chart's RBAC refused a replica:\n" + "\n".join(forbidden[:10])


def holder(control_plane: ControlPlane, replicas: list[OperatorProcess]) -> OperatorProcess:
    """The live replica the Lease names, once it leads and no other live replica does."""
    def settled() -> OperatorProcess | None:
        spec = (control_plane.get_or_none(LEASE_PATH) or {}).get("spec") or {}
        live = [op for op in replicas if op.proc.poll() is None]
        named = [op for op in live if identity(op) == spec.get("holderIdentity")]
        if len(named) == 1 and leads(named[0]) and not any(leads(op) for op in live if op is not named[0]):
            return named[0]
        return None
    found: OperatorProcess = wait_for(settled, timeout=60, what="one replica holding the Lease")
    return found


def test_the_real_api_server_keeps_one_holder_and_hands_the_lease_over_after_a_kill(
        control_plane: ControlPlane, replicas: list[OperatorProcess]) -> None:
    leader = holder(control_plane, replicas)
    (follower,) = [op for op in replicas if op is not leader]
    lease: dict[str, Any] = control_plane.get(LEASE_PATH)
    spec = lease["spec"]
    assert spec["leaseDurationSeconds"] == LEASE_SECONDS and spec["leaseTransitions"] == 0
    # Renewals land: the API server took the resourceVersion-checked merge patches.
    wait_for(lambda: control_plane.get(LEASE_PATH)["spec"]["renewTime"] != spec["renewTime"], what="a renewal")
    for op in replicas:
        assert op.http_get("/healthz")[0] == 200
    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(15)
    last_renewal = micro(control_plane.get(LEASE_PATH)["spec"]["renewTime"])
    assert holder(control_plane, [follower]) is follower
    spec = control_plane.get(LEASE_PATH)["spec"]
    assert spec["holderIdentity"] == identity(follower) and spec["leaseTransitions"] == 1
    assert (micro(spec["acquireTime"]) - last_renewal).total_seconds() >= LEASE_SECONDS - 0.1
    # A clean stop hands it back: holderIdentity empty, as client-go's release leaves it.
    assert follower.stop() == 0, follower.log()[-3000:]
    released = control_plane.get(LEASE_PATH)["spec"]
    assert released.get("holderIdentity", "") == "" and released["leaseTransitions"] == 1
