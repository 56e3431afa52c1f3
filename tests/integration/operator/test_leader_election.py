"""Two real `kvpilot operator --leader-elect` processes against one KMock API: exactly one holds the
Lease and reconciles, both serve the admission webhook over HTTPS and answer /healthz; the leader
SIGKILLed, the other takes over once the lease has expired (never before); the leader shut down
cleanly hands the Lease over at once; a leader that cannot renew steps down and stops kopf.

Short timings (lease 3 s, renew deadline 2 s, retry 0.5 s) keep the waits small; every wait is a
poll with a deadline.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.kmock_api import Fault, KMockAPI, OperatorProcess, free_port, operator_process, wait_for
from kvpilot.api.vocabulary import WEBHOOK_PATH

trustme = pytest.importorskip("trustme", reason="trustme is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.integration

NS = "serving"
LEASE_NS = "kvpilot-system"
LEASE = "kvpilot-operator"
LEASE_PATH = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases/{LEASE}"
LEASE_SECONDS = 3
ELECTION = ("--leader-elect", f"--leader-elect-lease-duration={LEASE_SECONDS}", "--leader-elect-renew-deadline=2",
            "--leader-elect-retry-period=0.5", f"--leader-elect-resource-namespace={LEASE_NS}")


class Replica:
    """One operator replica: its process, its webhook port and its identity in the Lease."""

    def __init__(self, op: OperatorProcess, webhook_port: int) -> None:
        self.op, self.webhook_port = op, webhook_port

    @property
    def identity(self) -> str:
        found = re.search(r"contending for the lease \S+ as ([^\s\"]+)", self.op.log())
        assert found, self.op.log()[-2000:]
        return found.group(1)

    def metric(self, name: str, labels: str = "") -> float:
        text = self.op.http_get("/metrics")[1]
        found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        assert found, f"{name}{labels} not in /metrics"
        return float(found.group(1))

    def leads(self) -> bool:
        return self.metric("kvpilot_operator_leader") == 1.0

    def reconciles(self) -> float:
        return sum(self.metric("kvpilot_reconciles_total", f'{{result="{r}"}}')
                   for r in ("success", "invalid", "error", "retry"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    directory = tmp_path_factory.mktemp("webhook-tls")
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_file.write_bytes(cert.private_key_pem.bytes())
    return ca, cert_file, key_file


@pytest.fixture
def api() -> Iterator[KMockAPI]:
    with KMockAPI() as server:
        yield server


@pytest.fixture
def replicas(api: KMockAPI, pki: tuple[Any, Path, Path], tmp_path: Path) -> Iterator[list[Replica]]:
    """Two replicas, started one after the other, each with the webhook on a port of its own."""
    _, cert_file, key_file = pki
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    with contextlib.ExitStack() as stack:
        started = []
        for index in range(2):
            port = free_port()
            op = stack.enter_context(operator_process(
                kubeconfig, tmp_path, *ELECTION, "--webhook-port", str(port), "--webhook-host", "127.0.0.1",
                "--webhook-cert-file", str(cert_file), "--webhook-key-file", str(key_file),
                log_name=f"operator-{index}.log"))
            started.append(Replica(op, port))
        yield started


def lease(api: KMockAPI) -> dict[str, Any]:
    return dict(api.get(LEASE_PATH)["spec"])


def the_leader(api: KMockAPI, replicas: list[Replica]) -> Replica:
    """The replica the Lease names, once it runs kopf (and no other replica does)."""
    def settled() -> Replica | None:
        holder = lease(api).get("holderIdentity")
        live = [r for r in replicas if r.op.proc.poll() is None]
        leaders = [r for r in live if r.identity == holder]
        if (len(leaders) == 1 and leaders[0].leads() and leaders[0].op.http_get("/healthz")[0] == 200
                and not any(r.leads() for r in live if r is not leaders[0])):
            return leaders[0]
        return None
    return wait_for(settled, timeout=30, what="one leader holding the Lease")  # type: ignore[no-any-return]


def other(replicas: list[Replica], one: Replica) -> Replica:
    return next(r for r in replicas if r is not one)


def make(name: str) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct"}}


def reconciled(api: KMockAPI, name: str) -> bool:
    return api.get_or_none(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}") is not None


def micro(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)


def admission(replica: Replica, ca: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """POST an AdmissionReview to the replica's webhook as the API server would (HTTPS, CA-verified)."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    request = {"uid": str(uuid.uuid4()), "operation": "CREATE", "namespace": NS, "name": obj["metadata"]["name"],
               "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"},
               "resource": {"group": "kvpilot.dev", "version": "v1alpha1", "resource": "inferenceservices"},
               "userInfo": {"username": "test"}, "object": obj, "oldObject": None, "dryRun": False}
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
    sent = urllib.request.Request(f"https://127.0.0.1:{replica.webhook_port}{WEBHOOK_PATH}", data=body.encode(),
                                  headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(sent, context=context, timeout=10) as answer:
        return dict(json.loads(answer.read())["response"])


def test_exactly_one_replica_reconciles_and_both_serve_the_webhook(
        api: KMockAPI, replicas: list[Replica], pki: tuple[Any, Path, Path]) -> None:
    leader = the_leader(api, replicas)
    follower = other(replicas, leader)
    spec = lease(api)
    assert spec["leaseDurationSeconds"] == LEASE_SECONDS and spec["leaseTransitions"] == 0
    assert spec["acquireTime"] and spec["renewTime"]
    api.create_isvc(make("one"))
    wait_for(lambda: reconciled(api, "one"), what="the Deployment of 'one'")
    wait_for(lambda: leader.reconciles() >= 1, what="the leader's reconcile counted")
    assert follower.reconciles() == 0
    assert not follower.leads()
    # The leader renews: renewTime moves on, the holder and acquireTime stay.
    first = lease(api)
    wait_for(lambda: lease(api)["renewTime"] != first["renewTime"], what="a renewal")
    assert lease(api)["holderIdentity"] == leader.identity and lease(api)["acquireTime"] == first["acquireTime"]
    # Every replica answers the webhook and /healthz, leading or not.
    ca = pki[0]
    bad = make("bad")
    bad["spec"]["engine"] = {"maxNumSeqs": 0}
    for replica in (leader, follower):
        assert replica.op.http_get("/healthz")[0] == 200
        assert admission(replica, ca, make("good"))["allowed"] is True
        denied = admission(replica, ca, bad)
        assert denied["allowed"] is False and "maxNumSeqs" in denied["status"]["message"]
    assert follower.reconciles() == 0
    assert "became the leader" not in follower.op.log()


def test_a_killed_leader_is_replaced_once_its_lease_expires(api: KMockAPI, replicas: list[Replica]) -> None:
    leader = the_leader(api, replicas)
    follower = other(replicas, leader)
    leader.op.proc.send_signal(signal.SIGKILL)
    leader.op.proc.wait(15)
    last_renewal = micro(lease(api)["renewTime"])
    new = the_leader(api, [follower])
    spec = lease(api)
    assert spec["holderIdentity"] == follower.identity
    assert spec["leaseTransitions"] == 1
    # Taken only once the dead leader's lease had run out, never while it might still be writing.
    assert (micro(spec["acquireTime"]) - last_renewal).total_seconds() >= LEASE_SECONDS - 0.1
    api.create_isvc(make("after-kill"))
    wait_for(lambda: reconciled(api, "after-kill"), what="the new leader reconciling 'after-kill'")
    wait_for(lambda: new.reconciles() >= 1, what="the new leader's reconcile counted")


def test_a_leader_shut_down_cleanly_hands_over_the_lease(api: KMockAPI, replicas: list[Replica]) -> None:
    leader = the_leader(api, replicas)
    follower = other(replicas, leader)
    assert leader.op.stop() == 0, leader.op.log()[-3000:]
    assert "released the lease" in leader.op.log()
    the_leader(api, [follower])
    assert lease(api)["leaseTransitions"] == 1
    api.create_isvc(make("after-stop"))
    wait_for(lambda: reconciled(api, "after-stop"), what="the new leader reconciling 'after-stop'")


def test_a_leader_that_cannot_renew_steps_down_and_stops_reconciling(
        api: KMockAPI, replicas: list[Replica]) -> None:
    leader = the_leader(api, replicas)
    # Every write of the Lease fails from now on: nobody can renew or take it.
    rule = api.fail("PATCH", re.escape(LEASE_PATH) + "$", *[Fault(503)] * 10_000)
    wait_for(lambda: "stepping down: not renewed within the renew deadline" in leader.op.log(),
             what="the leader stepping down")
    wait_for(lambda: not leader.leads(), what="the leader gauge at 0")
    assert "Operator is stopping" in leader.op.log()  # kopf itself stopped
    for replica in replicas:  # both go on serving as followers
        assert replica.op.http_get("/healthz")[0] == 200
        assert not replica.leads()
    rule.faults.clear()
    the_leader(api, replicas)
    api.create_isvc(make("after-outage"))
    wait_for(lambda: reconciled(api, "after-outage"), what="a leader reconciling 'after-outage'")


def test_a_leader_stopped_while_kopf_is_still_starting_stops_at_once_and_releases_the_lease(
        api: KMockAPI, tmp_path: Path) -> None:
    """SIGTERM lands while kopf is still discovering the API (held at its first GET /apis): kopf's
    graceful stop would wait for calls that retry against the connection its own shutdown closed;
    the operator cancels it after half the margin, exits 0 and hands the Lease back."""
    log = tmp_path / "operator.log"
    env = dict(os.environ, KUBECONFIG=str(api.write_kubeconfig(tmp_path / "kubeconfig")), PYTHONUNBUFFERED="1")
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "operator", "--all-namespaces",
                                 "--metrics-port", str(free_port()), "--log-format", "json", *ELECTION],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        hook = api.after("GET", r"^/apis$", lambda: proc.send_signal(signal.SIGTERM))
        assert hook.done.wait(60), log.read_text()[-3000:]
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert "released the lease" in log.read_text()
    assert lease(api)["holderIdentity"] == ""
