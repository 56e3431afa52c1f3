"""How long reconciling pauses when the leading operator replica dies or is stopped, and whether the
admission webhook stays answered meanwhile.

    python benchmarks/operator_failover.py [--rounds 3] [--lease-duration 15] [--renew-deadline 10]
                                           [--retry-period 2] [--smoke]

Runs a KMock API and two real `kvpilot operator --leader-elect` processes (the chart's timings by
default), each serving the webhook over TLS (trustme CA).  Each round kills the leader (SIGKILL, no
shutdown) and, in a last round, stops one cleanly (SIGTERM, which releases the Lease); a fresh replica
replaces the one that went.  Right after the kill it creates an InferenceService and measures:

- takeover: seconds from the kill until the other replica holds the Lease and its kopf watches
  (its /healthz 200 and kvpilot_operator_leader 1); at most lease duration + retry period (+ jitter)
  after the dead leader's last renewal, by client-go's rules;
- reconciled: seconds from the kill until that InferenceService's Deployment exists;
- webhook: reviews sent to the surviving replica every 50 ms during the gap, and how many failed
  (goal: none; the API server's Service sends reviews to every Ready replica).

Prints one JSON object: per round and the worst of each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import ssl
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.kmock_api import KMockAPI, OperatorProcess, free_port, operator_process, wait_for  # noqa: E402
from kvpilot.api.vocabulary import WEBHOOK_PATH  # noqa: E402

NS = "serving"


class Replica:
    def __init__(self, stack: contextlib.ExitStack, kubeconfig: Path, workdir: Path, args: list[str],
                 cert: Path, key: str, index: int) -> None:
        self.webhook_port = free_port()
        self.op: OperatorProcess = stack.enter_context(operator_process(
            kubeconfig, workdir, *args, "--webhook-port", str(self.webhook_port), "--webhook-host", "127.0.0.1",
            "--webhook-cert-file", str(cert), "--webhook-key-file", key, log_name=f"replica-{index}.log"))

    @property
    def identity(self) -> str:
        found = re.search(r"contending for the lease \S+ as ([^\s\"]+)", self.op.log())
        return found.group(1) if found else ""

    def leads(self) -> bool:
        try:
            metrics = self.op.http_get("/metrics")[1]
            return (re.search(r"^kvpilot_operator_leader 1\.0$", metrics, re.M) is not None
                    and self.op.http_get("/healthz")[0] == 200)
        except OSError:
            return False


def review(replica: Replica, context: ssl.SSLContext) -> bool:
    obj = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
           "metadata": {"name": "probe", "namespace": NS}, "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct"}}
    body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": str(uuid.uuid4()), "operation": "CREATE", "namespace": NS, "name": "probe",
        "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"},
        "resource": {"group": "kvpilot.dev", "version": "v1alpha1", "resource": "inferenceservices"},
        "userInfo": {"username": "bench"}, "object": obj, "oldObject": None, "dryRun": False}}).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{replica.webhook_port}{WEBHOOK_PATH}", data=body,
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, context=context, timeout=5) as answer:
            return bool(json.loads(answer.read())["response"]["allowed"])
    except OSError:
        return False


def one_round(api: KMockAPI, replicas: list[Replica], how: signal.Signals, name: str,
              context: ssl.SSLContext) -> tuple[Replica, dict[str, Any]]:
    """Send `how` to the leader, create `name` at once, and time the survivor's takeover and reconcile
    while probing its webhook every 50 ms."""
    leader: Replica = wait_for(lambda: next((r for r in replicas if r.leads()), None), timeout=120, what="a leader")
    survivor = next(r for r in replicas if r is not leader)
    failures, sent, stop = [0], [0], threading.Event()

    def probe() -> None:
        while not stop.is_set():
            sent[0] += 1
            failures[0] += not review(survivor, context)
            stop.wait(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    killed = time.monotonic()
    leader.op.proc.send_signal(how)
    api.create_isvc({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"name": name, "namespace": NS},
                     "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct"}})
    try:
        wait_for(survivor.leads, timeout=120, interval=0.05, what="the takeover")
        takeover = time.monotonic() - killed
        wait_for(lambda: api.get_or_none(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"), timeout=120,
                 interval=0.05, what="the reconcile")
        reconciled = time.monotonic() - killed
    finally:
        stop.set()
        prober.join()
    leader.op.proc.wait(30)
    return survivor, {"signal": how.name, "exit_code": leader.op.proc.returncode, "takeover_s": round(takeover, 2),
                      "reconciled_s": round(reconciled, 2), "webhook_reviews": sent[0],
                      "webhook_failures": failures[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="SIGKILL rounds (a SIGTERM round follows)")
    parser.add_argument("--lease-duration", type=int, default=15)
    parser.add_argument("--renew-deadline", type=float, default=10.0)
    parser.add_argument("--retry-period", type=float, default=2.0)
    parser.add_argument("--smoke", action="store_true", help="one short round (lease 3 s, renew 2 s, retry 0.5 s), for CI")
    opts = parser.parse_args()
    if opts.smoke:
        opts.rounds, opts.lease_duration, opts.renew_deadline, opts.retry_period = 1, 3, 2.0, 0.5
    import trustme

    election = ["--leader-elect", f"--leader-elect-lease-duration={opts.lease_duration}",
                f"--leader-elect-renew-deadline={opts.renew_deadline}",
                f"--leader-elect-retry-period={opts.retry_period}"]
    ca = trustme.CA()
    context = ssl.create_default_context()
    ca.configure_trust(context)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, KMockAPI() as api, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        cert = ca.issue_cert("127.0.0.1")
        cert_file, key_file = workdir / "tls.crt", workdir / "tls.key"
        cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
        key_file.write_bytes(cert.private_key_pem.bytes())
        kubeconfig = api.write_kubeconfig(workdir / "kubeconfig")
        started = 0

        def replica() -> Replica:
            nonlocal started
            started += 1
            return Replica(stack, kubeconfig, workdir, election, cert_file, str(key_file), started)

        replicas = [replica(), replica()]
        for n in range(opts.rounds + 1):
            how = signal.SIGKILL if n < opts.rounds else signal.SIGTERM
            survivor, result = one_round(api, replicas, how, f"after-{n}", context)
            rounds.append(result)
            replicas = [survivor, replica()]
        lease = api.get("/apis/coordination.k8s.io/v1/namespaces/default/leases/kvpilot-operator")["spec"]
    kills = [r for r in rounds if r["signal"] == "SIGKILL"]
    print(json.dumps({
        "timings": {"lease_duration_s": opts.lease_duration, "renew_deadline_s": opts.renew_deadline,
                    "retry_period_s": opts.retry_period},
        "rounds": rounds,
        "sigkill_takeover_max_s": max(r["takeover_s"] for r in kills) if kills else None,
        "sigkill_bound_s": round(opts.lease_duration + 1.2 * opts.retry_period, 2),
        "sigterm_takeover_s": rounds[-1]["takeover_s"],
        "webhook_failures": sum(r["webhook_failures"] for r in rounds),
        "lease_transitions": lease["leaseTransitions"],
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
