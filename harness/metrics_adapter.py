"""A real prometheus-adapter serving external.metrics.k8s.io through a test control plane's aggregator.

`scripts/build-prometheus-adapter.sh` (`make prometheus-adapter`) builds the adapter (cmd/adapter of
sigs.k8s.io/prometheus-adapter, pinned in tools/prometheus-adapter/go.mod) and caches it by version;
`MetricsAdapter` runs it on 127.0.0.1, on a free port, reading one Prometheus with the rules a test gives
(the `externalRules` of a prometheus-adapter config), and registers it as the cluster's
`v1beta1.external.metrics.k8s.io` APIService, as the adapter's Helm chart does in a cluster.

How kube-apiserver reaches it: an APIService names a Service. Its Endpoints or EndpointSlices cannot hold
127.0.0.1 (the API server refuses loopback addresses there), and nothing routes a ClusterIP here (no
kube-proxy). An ExternalName Service can: without `--enable-aggregator-routing` the aggregator dials an
ExternalName Service at its name and the APIService's port, so the Service says `localhost` and the
APIService gives the adapter's port. The aggregator checks the adapter's certificate against the
APIService's caBundle for the name `<service>.<namespace>.svc`, which the certificate carries.

The adapter authenticates the aggregator's requests by its front-proxy client certificate (the
requestheader CA kube-apiserver publishes in kube-system/extension-apiserver-authentication) and asks the
API server whether the named user may read the metric (a SubjectAccessReview), as in a cluster; it does
that, and reads the cluster's API discovery, with the admin kubeconfig: the adapter's own RBAC is the
chart's business, not what the test is about.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from harness.cluster import ApiError, ControlPlane, built_binaries, not_built, print_dir, wait_for
from harness.kmock_api import free_port

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build-prometheus-adapter.sh"
GROUP_VERSION = "external.metrics.k8s.io/v1beta1"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
API_SERVICES = "/apis/apiregistration.k8s.io/v1/apiservices"


def built_adapter() -> Path:
    """The adapter binary; without it a test skips, saying how to build it, and in CI fails."""
    binary = print_dir(BUILD_SCRIPT) / "adapter"
    if not os.access(binary, os.X_OK):
        not_built(f"prometheus-adapter not built: {binary} missing; run `make prometheus-adapter` "
                  "(scripts/build-prometheus-adapter.sh; needs Go >= 1.26 and the Go module proxy)")
    built_binaries()  # and the control plane it registers with
    return binary


class MetricsAdapter:
    """One adapter process, registered as the external metrics API of `cp` while it runs."""

    def __init__(self, cp: ControlPlane, workdir: Path, *, prometheus_url: str,
                 external_rules: Sequence[dict[str, Any]], namespace: str, service: str = "prometheus-adapter",
                 relist_interval: str = "1s") -> None:
        self.cp, self.workdir = cp, workdir
        self.prometheus_url, self.external_rules = prometheus_url, list(external_rules)
        self.namespace, self.service, self.relist_interval = namespace, service, relist_interval
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / "adapter.log"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> MetricsAdapter:
        binary = built_adapter()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.yaml"
        config.write_text(yaml.safe_dump({"externalRules": self.external_rules}, sort_keys=False))
        cert = self.cp.ca.issue_cert(f"{self.service}.{self.namespace}.svc", "localhost", "127.0.0.1")
        cert.private_key_pem.write_to_path(str(self.workdir / "tls.key"))
        cert.cert_chain_pems[0].write_to_path(str(self.workdir / "tls.crt"))
        kubeconfig = str(self.cp.admin_kubeconfig)
        self.port = free_port()
        argv = [str(binary), f"--config={config}", f"--prometheus-url={self.prometheus_url}",
                # The metric's series are listed again this often: a new series is served after it.
                f"--metrics-relist-interval={self.relist_interval}",
                "--bind-address=127.0.0.1", f"--secure-port={self.port}",
                f"--tls-cert-file={self.workdir / 'tls.crt'}", f"--tls-private-key-file={self.workdir / 'tls.key'}",
                f"--lister-kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--v=2"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        try:
            self._register()
        except BaseException:
            self.stop()
            raise
        return self

    def _register(self) -> None:
        self.cp.apply_manifests([
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": self.service, "namespace": self.namespace},
             "spec": {"type": "ExternalName", "externalName": "localhost"}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": API_SERVICE},
             "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1",
                      "service": {"namespace": self.namespace, "name": self.service, "port": self.port},
                      "caBundle": base64.b64encode(self.cp.ca.cert_pem.bytes()).decode(),
                      "groupPriorityMinimum": 100, "versionPriority": 100}},
        ])

        def available() -> bool:
            self.check_alive()
            conds = {c["type"]: c for c in self.cp.get(f"{API_SERVICES}/{API_SERVICE}")
                     .get("status", {}).get("conditions", [])}
            return bool(conds.get("Available", {}).get("status") == "True")
        wait_for(available, timeout=90, interval=0.5, what=f"APIService {API_SERVICE} Available (the adapter on "
                 f"127.0.0.1:{self.port} reached through the aggregator); adapter log:\n{self.log_tail()}")

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"prometheus-adapter exited with {self.proc.returncode}:\n{self.log_tail()}")

    def external_metric(self, namespace: str, metric: str, label_selector: str = "") -> dict[str, Any]:
        """GET the metric through kube-apiserver (the aggregator), as the HPA controller reads it."""
        params = {"labelSelector": label_selector} if label_selector else None
        result: dict[str, Any] = self.cp.get(f"/apis/{GROUP_VERSION}/namespaces/{namespace}/{metric}", params=params)
        return result

    def stop(self) -> None:
        for path in (f"{API_SERVICES}/{API_SERVICE}", f"/api/v1/namespaces/{self.namespace}/services/{self.service}"):
            # Never registered, or the control plane is already gone.
            with contextlib.suppress(ApiError, OSError):
                self.cp.delete(path)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> MetricsAdapter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
