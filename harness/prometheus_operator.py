"""Prometheus Operator for real, against the test control plane (harness/cluster.py).

`scripts/build-prometheus-operator.sh` builds its operator binary from its Go module, the Prometheus
it is built against (`prometheus`: Debian's has no Kubernetes service discovery), and copies its
CRDs next to them, cached by version. `PrometheusOperator` runs that binary as a process with a
kubeconfig (the admin token: it manages Secrets, ConfigMaps and StatefulSets in every namespace).
There is no kubelet to run the StatefulSet it makes for a `Prometheus`, so a test reads the
configuration it generates (the Secret `prometheus-<name>`, the rule ConfigMaps) and runs a real
Prometheus on it here (`out_of_cluster`).
"""

from __future__ import annotations

import functools
import gzip
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import yaml

from harness.cluster import ROOT, ApiError, ControlPlane, not_built, print_dir, wait_for
from harness.kmock_api import free_port

BUILD_SCRIPT = ROOT / "scripts" / "build-prometheus-operator.sh"
CRD_GROUP = "monitoring.coreos.com"
# Where the StatefulSet's config-reloader would write the rule ConfigMaps; the generated
# configuration's rule_files point under it.
IN_POD_RULES_DIR = "/etc/prometheus/rules"


def prometheus_version(directory: Path) -> str:
    """The version of the built Prometheus (`v3.13.1`), for a `Prometheus` object's spec.version, so
    the operator writes the configuration for the Prometheus that runs it."""
    out = subprocess.run([str(directory / "prometheus"), "--version"], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    return "v" + out.split()[2]


def built_operator() -> Path:
    """The directory holding `operator`, `prometheus` and `crds/`; without them a test skips, saying
    how to build them, and in CI fails."""
    directory = print_dir(BUILD_SCRIPT)
    crds = sorted((directory / "crds").glob(f"{CRD_GROUP}_*.yaml"))
    if not all(os.access(directory / b, os.X_OK) for b in ("operator", "prometheus")) or not crds:
        not_built(f"Prometheus Operator not built: operator, prometheus or crds/ missing in {directory}; run "
                  f"scripts/build-prometheus-operator.sh (needs Go >= 1.26 and the Go module proxy)")
    return directory


def install_crds(cp: ControlPlane, directory: Path) -> list[str]:
    """Create every CRD of the build, as-is, and wait until each is Established and served. kubectl
    reads the files (Go's YAML: PyYAML refuses their `- =`, a YAML 1.1 "value" tag)."""
    created = cp.kubectl("create", "-o", "name", "-f", str(directory / "crds")).stdout.split()
    names = [n.split("/", 1)[1] for n in created]
    path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for name in names:
        def established(name: str = name) -> bool:
            conds = cp.get(f"{path}/{name}").get("status", {}).get("conditions", [])
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)
        wait_for(established, timeout=60, what=f"CRD {name} Established")
        crd = cp.get(f"{path}/{name}")
        served = f"/apis/{CRD_GROUP}/{crd['spec']['versions'][0]['name']}/{crd['spec']['names']['plural']}"
        # Established is not yet served: the first calls may answer 429 "storage is (re)initializing".
        wait_for(functools.partial(cp.get, served), timeout=60, what=f"{name} served")
    return names


class PrometheusOperator:
    """The operator binary as a process; stopped with SIGTERM (SIGKILL after 15 s)."""

    def __init__(self, directory: Path, kubeconfig: Path, workdir: Path) -> None:
        self.port = free_port()
        self.log_path = workdir / "prometheus-operator.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(directory / "operator"), f"--web.listen-address=127.0.0.1:{self.port}", "--log-level=info",
                 # Its verdict on each monitor and rule (status.bindings: Accepted, or why not).
                 "--feature-gates=StatusForConfigurationResources=true"],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                env={**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(workdir)})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus-operator exited with {self.proc.returncode}:\n{self.log()[-4000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def generated_config(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    """The prometheus.yaml the operator generated for Prometheus `name` (Secret `prometheus-<name>`,
    key prometheus.yaml.gz), or None before it exists."""
    import base64

    try:
        secret = cp.get(f"/api/v1/namespaces/{namespace}/secrets/prometheus-{name}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise
    data = (secret.get("data") or {}).get("prometheus.yaml.gz")
    if not data:
        return None
    loaded: dict[str, Any] = yaml.safe_load(gzip.decompress(base64.b64decode(data)))
    return loaded


def rule_files(cp: ControlPlane, namespace: str, name: str) -> dict[str, dict[str, str]]:
    """The rule ConfigMaps `prometheus-<name>-rulefiles-<n>`: ConfigMap name -> {file: text}."""
    selector = f"prometheus-name={name}"
    items = cp.get(f"/api/v1/namespaces/{namespace}/configmaps", params={"labelSelector": selector})["items"]
    return {cm["metadata"]["name"]: dict(cm.get("data") or {})
            for cm in items if cm["metadata"]["name"].startswith(f"prometheus-{name}-rulefiles-")}


# The config-reloader expands `$(NAME)` from its container's environment before Prometheus reads
# the file (the shard's keep rule, the replica's external label).
_RELOADER_ENV_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def reloader_env(name: str, shard: int = 0) -> dict[str, str]:
    """The environment the config-reloader of shard `shard`'s first pod of Prometheus `name` has."""
    return {"SHARD": str(shard), "POD_NAME": f"prometheus-{name}-0" if shard == 0 else f"prometheus-{name}-shard-{shard}-0"}


def out_of_cluster(config: dict[str, Any], kubeconfig: Path, rules: dict[str, dict[str, str]],
                   rules_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    """The generated configuration, runnable here. Changed, and only so: `$(NAME)` expanded from
    `env`, as the config-reloader does in the pod; every kubernetes_sd_config gets `kubeconfig_file`
    (in a pod Prometheus uses its ServiceAccount; out of a cluster it needs a way to the API server);
    rule_files under IN_POD_RULES_DIR point at `rules_dir`, where the rule ConfigMaps' files are
    written as the StatefulSet would mount them."""
    def expand(match: re.Match[str]) -> str:
        if match.group(1) not in env:
            raise KeyError(f"the generated configuration uses $({match.group(1)}); the config-reloader's "
                           f"environment here has only {sorted(env)}")
        return env[match.group(1)]

    def expanded(node: Any) -> Any:  # strings stay strings: `$(SHARD)` becomes "0", not 0
        if isinstance(node, dict):
            return {k: expanded(v) for k, v in node.items()}
        if isinstance(node, list):
            return [expanded(v) for v in node]
        return _RELOADER_ENV_VAR.sub(expand, node) if isinstance(node, str) else node
    out: dict[str, Any] = expanded(config)
    for job in out.get("scrape_configs") or []:
        for sd in job.get("kubernetes_sd_configs") or []:
            sd["kubeconfig_file"] = str(kubeconfig)
    for cm_name, files in rules.items():
        (rules_dir / cm_name).mkdir(parents=True, exist_ok=True)
        for file, text in files.items():
            (rules_dir / cm_name / file).write_text(text)
    out["rule_files"] = [str(rules_dir) + f[len(IN_POD_RULES_DIR):] if f.startswith(IN_POD_RULES_DIR) else f
                         for f in out.get("rule_files") or []]
    return out
