"""The bed a chaos run breaks: a real control plane with the real operator and tuner on it, and the
faults it can suffer (harness/chaos.py schedules them and checks the invariants after each).

- the control plane of harness/cluster.py, its API server keeping etcd's whole history watchable
  (`--watch-cache=false`, no compaction) and Events for a day, on `NODES` kwok GPU nodes whose pods
  turn Ready 1 to 4 s after they are bound (chaos-kwok-stages.yaml);
- the operator and the tuner as real processes, each as the chart's ServiceAccount, both talking to the
  API server through a FaultProxy (harness/fault_proxy.py) that can answer bursts of 429/5xx;
- a real Prometheus scraping a synthetic vLLM exporter (kwok pods serve nothing) as the tuner's signals;
- two InferenceServices: `steady` (2 replicas; the run changes its chunk size before each fault, so
  a rollout is in flight when the fault lands) and `tuned` (1 replica, tuned by the tuner without end:
  every trial is a rollout of its own).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import yaml

from harness import chart
from harness.cluster import ROOT, ApiError, ControlPlane, Operator, binary_dir, missing_binaries, wait_for
from harness.fault_proxy import FaultProxy
from harness.prometheus import PrometheusServer, prometheus_binary
from harness.synthetic_vllm import SyntheticVllm
from harness.tuner_process import TunerProcess
from kvpilot.api import vllm
from kvpilot.api.vocabulary import SERIES_LABEL_INFERENCESERVICE

NS = "chaos"
STEADY, TUNED = "steady", "tuned"
SERVICES = (STEADY, TUNED)
ISVCS = f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NS}/deployments"
PODS = f"/api/v1/namespaces/{NS}/pods"
EVENTS = f"/api/v1/namespaces/{NS}/events"
ENGINE_KEYS = ("maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs")
ENGINE_FLAGS = ("--max-num-batched-tokens", "--gpu-memory-utilization", "--max-num-seqs")
START = {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256}
NODES = 3
TOKEN_S = 24 * 3600  # the ServiceAccount tokens outlive the longest run
# Pods turn Ready 1 to 4 s after they are bound: a rollout lasts long enough for a fault to land in it.
KWOK_STAGES = Path(__file__).resolve().parent / "chaos-kwok-stages.yaml"
APISERVER_ARGS = ("--watch-cache=false", "--etcd-compaction-interval=0", "--event-ttl=24h")


class BedUnavailable(RuntimeError):
    """What the bed needs is not on this machine (the control plane's binaries, Prometheus)."""


def engine_of_template(template: dict[str, Any]) -> tuple[float, ...]:
    args = template["spec"]["containers"][0]["args"]
    return tuple(float(args[args.index(f) + 1]) for f in ENGINE_FLAGS)


def engine_of_spec(engine: dict[str, Any]) -> tuple[float, ...]:
    return tuple(float(engine[k]) for k in ENGINE_KEYS)


class ChaosBed:
    def __init__(self, workdir: Path, seed: int) -> None:
        self.workdir, self.seed = workdir, seed
        self._stack = contextlib.ExitStack()
        self._next_node = 0

    # ---- set-up ----
    def __enter__(self) -> ChaosBed:
        bin_dir = binary_dir()
        missing = missing_binaries(bin_dir)
        if missing:
            raise BedUnavailable(f"the control plane is not built ({', '.join(missing)} missing in {bin_dir}); "
                                 "run `make control-plane`")
        if prometheus_binary() is None:
            raise BedUnavailable("prometheus not found (apt-get install prometheus)")
        try:
            self._start(bin_dir)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self, bin_dir: Path) -> None:
        cp = self.cp = self._stack.enter_context(ControlPlane(
            bin_dir, self.workdir / "control-plane", kwok_config=KWOK_STAGES, apiserver_args=APISERVER_ARGS))
        for _ in range(NODES):
            self.add_node()
        operator_sa, tuner_sa = self._install()
        cert = cp.ca.issue_cert("127.0.0.1", "localhost")
        cert.cert_chain_pems[0].write_to_path(str(self.workdir / "proxy.crt"))
        cert.private_key_pem.write_to_path(str(self.workdir / "proxy.key"))
        self.proxy = self._stack.enter_context(FaultProxy(cp.url, cp.ca_file, self.workdir / "proxy.crt",
                                                          self.workdir / "proxy.key", seed=self.seed))

        def kubeconfig(account: str) -> Path:
            token = cp.service_account_token(chart.NAMESPACE, account, expiration_seconds=TOKEN_S)
            return cp.write_kubeconfig(self.workdir / f"{account}.kubeconfig", token,
                                       f"system:serviceaccount:{chart.NAMESPACE}:{account}", NS,
                                       server=self.proxy.url)
        (self.workdir / "operator").mkdir()
        self.operator = Operator(kubeconfig(operator_sa), self.workdir / "operator")
        self._stack.callback(self.operator.close)
        self.exporter = self._stack.enter_context(SyntheticVllm())
        labels = {"namespace": NS, SERIES_LABEL_INFERENCESERVICE: TUNED}
        self.prometheus = self._stack.enter_context(PrometheusServer(scrape_configs=[
            {"job_name": "vllm", "static_configs": [{"targets": [self.exporter.target], "labels": labels}]}]))
        self.prometheus.wait_for(f"{vllm.METRIC_TTFT}_count > 20", timeout=60)
        self._create_services()
        self.storage = f"sqlite:///{self.workdir / 'study.db'}"
        self.tuner = TunerProcess(kubeconfig(tuner_sa), self.prometheus.url, self.storage, self.workdir, NS)
        self._stack.callback(self.tuner.close)

    def _install(self) -> tuple[str, str]:
        """CRD, namespaces, the chart's RBAC; returns the operator's and the tuner's ServiceAccounts."""
        cp = self.cp
        crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.kvpilot.dev.yaml").read_text())
        cp.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
        # Established is not yet served: the first lists may answer 429 "storage is (re)initializing".
        wait_for(lambda: cp.get("/apis/kvpilot.dev/v1alpha1/inferenceservices"), timeout=60,
                 what="InferenceServices served")
        for ns in (NS, chart.NAMESPACE):
            cp.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        wait_for(lambda: cp.get_or_none(f"/api/v1/namespaces/{NS}/serviceaccounts/default"), timeout=60,
                 what=f"the default ServiceAccount in {NS}")
        rbac = [r.obj for r in chart.render("default")
                if r.kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
        cp.apply_manifests(rbac)
        accounts = {o["metadata"]["labels"]["app.kubernetes.io/component"]: o["metadata"]["name"]
                    for o in rbac if o["kind"] == "ServiceAccount"}
        return accounts["operator"], accounts["tuner"]

    def _create_services(self) -> None:
        def isvc(name: str, replicas: int, **spec: Any) -> dict[str, Any]:
            return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                    "metadata": {"name": name, "namespace": NS},
                    "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": replicas,
                             "engine": dict(START), **spec}}
        self.cp.create(ISVCS, isvc(STEADY, 2))
        self.cp.create(ISVCS, isvc(TUNED, 1, tuning={"enabled": True, "maxTrials": 1000, "trialSeconds": 10,
                                                     "warmupSeconds": 0}))

    def add_node(self) -> str:
        name = f"kwok-{self._next_node}"
        self._next_node += 1
        self.cp.add_node(name, gpus=8)
        return name

    # ---- what the run changes ----
    def set_steady_tokens(self, tokens: int) -> None:
        self.cp.merge_patch(f"{ISVCS}/{STEADY}", {"spec": {"engine": {"maxNumBatchedTokens": tokens}}})

    # ---- faults ----
    def restart_etcd(self) -> None:
        self.cp.restart("etcd")
        self.resync_kwok()

    def restart_apiserver(self) -> None:
        self.cp.restart("kube-apiserver")
        self.resync_kwok()

    def resync_kwok(self) -> None:
        """kwok plays the kubelets, but a stage whose patch failed while the store was down is never
        played again (a pod bound then stays Pending for good: seen at an etcd restart), where a kubelet
        keeps syncing its pods. Started again, kwok plays every pod's stage afresh."""
        self.cp.restart("kwok", kill=False)

    def kill_operator(self) -> None:
        self.operator.kill_and_restart()

    def kill_tuner(self) -> None:
        self.tuner.kill_and_restart()

    def remove_node(self, pick: Any) -> tuple[str, dict[str, list[str]], dict[str, int]]:
        """Delete the Node the pods of `steady` run on (`pick` chooses among several), and its pods at
        once, as the pod garbage collector does for a node that is gone; a new node takes its place.
        Returns the node, per Deployment the pods it took that were ready when deleted, and per
        Deployment the ready pods left elsewhere (not terminating) once they were gone."""
        def instance(pod: dict[str, Any]) -> str:
            return str(pod["metadata"].get("labels", {}).get("app.kubernetes.io/instance", ""))

        def ready(pod: dict[str, Any]) -> bool:
            return any(c["type"] == "Ready" and c["status"] == "True"
                       for c in (pod.get("status") or {}).get("conditions", []))

        pods = [p for p in self.cp.get(PODS)["items"] if p["spec"].get("nodeName")
                and not p["metadata"].get("deletionTimestamp")]
        steady_nodes = sorted({p["spec"]["nodeName"] for p in pods if instance(p) == STEADY})
        node = pick(steady_nodes or sorted({p["spec"]["nodeName"] for p in pods}))
        self.cp.delete(f"/api/v1/nodes/{node}")
        # Listed after the Node is gone (nothing is bound to it any more), and each pod judged by the
        # state its DELETE answers with: a pod that turned Ready between a list and its deletion (a
        # rollout's new pod; the old one then scaled away) counts as taken.
        taken: dict[str, list[str]] = {}
        for pod in self.cp.get(PODS, params={"fieldSelector": f"spec.nodeName={node}"})["items"]:
            try:
                last = self.cp.request("DELETE", f"{PODS}/{pod['metadata']['name']}",
                                       params={"gracePeriodSeconds": "0"})
            except ApiError:
                continue  # already gone
            if ready(last or pod):
                taken.setdefault(instance(pod), []).append(pod["metadata"]["name"])
        left: dict[str, int] = {}
        for pod in self.cp.get(PODS)["items"]:
            if pod["spec"].get("nodeName") != node and not pod["metadata"].get("deletionTimestamp") and ready(pod):
                left[instance(pod)] = left.get(instance(pod), 0) + 1
        self.add_node()
        return node, taken, left

    def logs(self) -> dict[str, str]:
        """Every kvpilot process's log so far, by a name for the report."""
        out = {f"operator-{i}": p.log() for i, p in enumerate(self.operator.processes)}
        for i in range(len(self.tuner.procs)):
            out[f"tuner-{i}"] = self.tuner.log_path(i).read_text(errors="replace")
        return out
