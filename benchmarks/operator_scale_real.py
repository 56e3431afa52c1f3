"""`operator_scale.py --real`: the same burst against a real control plane (harness/cluster.py).

The operator runs as the chart's operator ServiceAccount; every InferenceService gets its real
Deployment, ReplicaSet and kwok pods. Latency is create (the POST answered) -> the first watch event
carrying the operator's status (observedGeneration), as this process received them; the operator's API
calls are counted from kube-apiserver's audit log (by its ServiceAccount's name).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from harness.cluster import ROOT, ControlPlane, Watch, binary_dir, missing_binaries, wait_for
from harness.kmock_api import operator_process

ISVCS = "/apis/kvpilot.dev/v1alpha1"


def _install(cp: ControlPlane, namespaces: tuple[str, ...]) -> tuple[str, str]:
    """CRD, namespaces and the chart's RBAC; returns the operator ServiceAccount (namespace, name)."""
    from harness import chart

    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml").read_text())
    cp.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    wait_for(lambda: any(c["type"] == "Established" and c["status"] == "True" for c in cp.get(
        f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}")
        .get("status", {}).get("conditions", [])), timeout=30, what="the CRD Established")
    # Established is not yet served: the first lists may answer 429 "storage is (re)initializing".
    wait_for(lambda: cp.get(f"{ISVCS}/inferenceservices"), timeout=30, what="InferenceServices served")
    for ns in (*namespaces, chart.NAMESPACE):
        cp.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    for ns in namespaces:
        wait_for(lambda ns=ns: cp.get_or_none(f"/api/v1/namespaces/{ns}/serviceaccounts/default"), timeout=30,
                 what=f"the default ServiceAccount in {ns}")
    rbac = [r.obj for r in chart.render("operator-only")
            if r.kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    cp.apply_manifests(rbac)
    (account,) = [o["metadata"]["name"] for o in rbac if o["kind"] == "ServiceAccount"]
    return chart.NAMESPACE, account


def run(count: int, concurrency: int, timeout: float, namespaces: tuple[str, ...],
        make: Any, percentile: Any, proc_status_kb: Any, cpu_seconds: Any) -> int:
    bin_dir = binary_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        print(f"--real needs the control plane: {', '.join(missing)} missing in {bin_dir}; run `make control-plane`")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with ControlPlane(bin_dir, work / "control-plane", audit=True) as cp:
            replicas = sum(make(i)["spec"]["replicas"] for i in range(count))
            cp.add_node("kwok-0", gpus=replicas + 16, pods=replicas + 110, memory=f"{32 * (replicas + 16)}Gi")
            sa_namespace, account = _install(cp, namespaces)
            kubeconfig = cp.service_account_kubeconfig(work / "operator.kubeconfig", sa_namespace, account)
            user = f"system:serviceaccount:{sa_namespace}:{account}"
            with operator_process(kubeconfig, work, "--all-namespaces") as op:
                pid = op.proc.pid
                idle_kb = proc_status_kb(pid, "VmRSS")
                calls_before = cp.calls_by(user)
                rv = cp.get(f"{ISVCS}/inferenceservices")["metadata"]["resourceVersion"]
                watch = Watch(cp, f"{ISVCS}/inferenceservices", resource_version=rv)
                created: dict[str, float] = {}

                def create(i: int) -> None:
                    body = make(i)
                    cp.create(f"{ISVCS}/namespaces/{body['metadata']['namespace']}/inferenceservices", body)
                    created[f"{body['metadata']['namespace']}/{body['metadata']['name']}"] = time.monotonic()

                def first_status() -> dict[str, float]:
                    seen: dict[str, float] = {}
                    for (_, obj), at in zip(list(watch.events), list(watch.received), strict=False):
                        if (obj.get("status") or {}).get("observedGeneration") is not None:
                            key = f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"
                            seen.setdefault(key, at)
                    return seen

                started = time.monotonic()
                with ThreadPoolExecutor(concurrency) as pool:
                    list(pool.map(create, range(count)))
                created_s = time.monotonic() - started
                wait_for(lambda: len(first_status()) >= count, timeout=timeout, interval=1.0,
                         what=f"the first status of all {count} InferenceServices")
                all_done_s = time.monotonic() - started

                def ready() -> bool:
                    items = cp.get(f"{ISVCS}/inferenceservices")["items"]
                    return sum(any(c["type"] == "Ready" and c["status"] == "True"
                                   for c in (o.get("status") or {}).get("conditions", [])) for o in items) >= count
                wait_for(ready, timeout=timeout, interval=1.0, what=f"all {count} InferenceServices Ready")
                ready_s = time.monotonic() - started
                watch.stop()
                seen = first_status()
                values = [seen[k] - created[k] for k in created if k in seen]
                peak_kb = proc_status_kb(pid, "VmHWM")
                rss_kb = proc_status_kb(pid, "VmRSS")
                operator_cpu = cpu_seconds(pid)
                # The audit log is written as requests complete; the last few need a moment.
                time.sleep(1)
                calls = cp.calls_by(user) - calls_before

    print("against a real control plane (kube-apiserver v1.35 + etcd + controllers + kwok, RBAC as the chart)")
    print(f"InferenceServices created:        {count} in {created_s:.1f} s "
          f"({count / created_s:.0f}/s, {concurrency} clients), {replicas} pods")
    print(f"all reconciled (first status):    {all_done_s:.1f} s after the first create; "
          f"all Ready (pods up via kwok): {ready_s:.1f} s")
    print(f"operator API calls (audit log):   {calls} ({calls / count:.1f} per InferenceService, watches included)")
    print(f"reconcile latency create->status: p50 {statistics.median(values) * 1000:.0f} ms, "
          f"p99 {percentile(values, 99) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms")
    print(f"operator CPU seconds:             {operator_cpu:.1f} s "
          f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"operator RSS before the load:     {idle_kb / 1024:.1f} MB")
    print(f"operator RSS after the load:      {rss_kb / 1024:.1f} MB")
    print(f"operator peak RSS (VmHWM):        {peak_kb / 1024:.1f} MB (goal <= 150 MB)")
    return 0
