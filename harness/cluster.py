"""A real Kubernetes control plane for tests, started from binaries the project builds itself.

`scripts/build-control-plane.sh` (`make control-plane`) builds etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, kubectl and kwok and caches them by version;
`ControlPlane` starts them on 127.0.0.1, on free ports, in a temporary directory:

- etcd, one member, as kube-apiserver's storage;
- kube-apiserver with RBAC (`--authorization-mode=RBAC`; its default would allow everything), a
  static admin token (group system:masters), a TLS serving certificate from a throwaway CA, a
  service-account signing key, so a test can mint a token for a ServiceAccount and act as it, and the
  front-proxy (requestheader) credentials its aggregator needs to proxy an APIService to an extension
  API server such as a metrics adapter (harness/metrics_adapter.py);
- kube-controller-manager with the controllers the operator relies on: deployment, replicaset,
  garbage collector, plus serviceaccount (pods need their namespace's "default" ServiceAccount),
  namespace, and the horizontal-pod-autoscaler (it acts only where an HPA exists);
- kube-scheduler (kwok does not schedule);
- kwok, which plays the kubelet of fake Nodes: it marks them Ready and, by its default stages,
  makes each pod bound to them Running and Ready at once. No container ever runs.

There is no kube-proxy, CNI or container runtime: anything needing pod networking is out of reach.
Readiness is polled (/health, /readyz, /healthz, Node Ready), never slept for.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from harness import kmock_api
from harness.kmock_api import OperatorProcess, free_port, operator_process

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT / "scripts" / "build-control-plane.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")
ADMIN_TOKEN = "kvpilot-test-admin-token"  # noqa: S105 - a throwaway cluster on 127.0.0.1
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
CONTROLLERS = ("deployment-controller", "replicaset-controller", "garbage-collector-controller", "node-lifecycle-controller",
               "serviceaccount-controller", "namespace-controller", "horizontal-pod-autoscaler-controller")
# The client certificate kube-apiserver's aggregator presents to an extension API server (a metrics
# adapter), and the only name that server accepts the requestheader identity from.
FRONT_PROXY_CLIENT = "front-proxy-client"


class ApiError(Exception):
    """An HTTP error from the API server: the status and the Status object (or text) it sent."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        try:
            payload = json.loads(body)
        except ValueError:
            payload = {}
        self.reason = str(payload.get("reason", ""))
        self.message = str(payload.get("message", body))
        super().__init__(f"{status} {self.reason}: {self.message}")


def print_dir(build_script: Path) -> Path:
    """Where a build script (scripts/build-<name>.sh) caches its version's output, built or not."""
    out = subprocess.run(["bash", str(build_script), "--print-dir"], capture_output=True, text=True,
                         check=True, timeout=30)
    return Path(out.stdout.strip())


def binary_dir() -> Path:
    """Where the build script caches this version's binaries (built or not)."""
    return print_dir(BUILD_SCRIPT)


def missing_binaries(bin_dir: Path) -> list[str]:
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def not_built(reason: str) -> NoReturn:
    """A program a test needs is not built: skip, saying how to build it; in CI (where `make test`
    builds every one first) fail."""
    if in_ci():
        pytest.fail(reason)
    pytest.skip(reason)


def built_binaries() -> Path:
    """The control plane's binary directory; without the binaries a test skips, saying how to build
    them, and in CI fails."""
    bin_dir = binary_dir()
    missing = missing_binaries(bin_dir)
    if missing:
        not_built(f"control plane not built: {', '.join(missing)} missing in {bin_dir}; "
                  "run `make control-plane` (needs Go >= 1.25 and the Go module proxy)")
    return bin_dir


def wait_for(predicate: Callable[[], Any], *, timeout: float = 60.0, interval: float = 0.1,
             what: str = "condition") -> Any:
    """kmock_api's poll, where this control plane's API errors and refused connections mean "not yet"."""
    return kmock_api.wait_for(predicate, timeout, interval, what,
                              errors=(ApiError, OSError, KeyError, IndexError, TypeError))


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Where and as whom its health is polled once started (ControlPlane.restart polls it again).
    health: tuple[str, str | None] | None = None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok, on 127.0.0.1."""

    bin_dir: Path
    workdir: Path
    kwok_config: Path | None = None
    # Write an audit log (audit.log, level Metadata): who made which call, for benchmarks.
    audit: bool = False
    # More kube-apiserver flags (a chaos run keeps etcd's whole history watchable, for one).
    apiserver_args: tuple[str, ...] = ()
    # kube-controller-manager's --controllers (a test that needs Services' endpoints adds the
    # endpoints and endpointslice controllers).
    controllers: tuple[str, ...] = CONTROLLERS
    components: list[Component] = field(default_factory=list)
    api_port: int = 0

    # ---- lifecycle ----
    def start(self) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._write_credentials()
            self._start_etcd()
            self._start_apiserver()
            self.admin_kubeconfig = self.write_kubeconfig(self.workdir / "admin.kubeconfig", ADMIN_TOKEN, "admin")
            self._start_controllers()
            self._start_kwok()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for component in reversed(self.components):
            component.stop()
        self.components.clear()

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_alive(self) -> None:
        for component in self.components:
            component.check_alive()

    def _spawn(self, name: str, args: list[str]) -> Component:
        log_path = self.workdir / f"{name}.log"
        argv = [str(self.bin_dir / name.split("@")[0]), *args]
        env = {**os.environ, "HOME": str(self.workdir)}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=env)
        component = Component(name, proc, log_path, argv, env)
        self.components.append(component)
        return component

    def restart(self, name: str, *, kill: bool = True) -> None:
        """Stop one component (SIGKILL, or SIGTERM with kill=False) and start it again with the same
        flags, ports and data; return once it is healthy again."""
        (component,) = [c for c in self.components if c.name == name]
        if kill:
            component.proc.kill()
            component.proc.wait(15)
        else:
            component.stop()
        with component.log_path.open("ab") as log:
            component.proc = subprocess.Popen(component.argv, stdout=log, stderr=subprocess.STDOUT,
                                              cwd=self.workdir, env=component.env)
        if component.health is not None:
            url, token = component.health
            self._wait_healthy(component, url, token=token, timeout=180)

    def _wait_healthy(self, component: Component, url: str, *, token: str | None = None,
                      timeout: float = 90.0) -> None:
        component.health = (url, token)

        def healthy() -> bool:
            component.check_alive()
            try:
                return self._raw("GET", url, token=token)[0] == 200
            except OSError:
                return False
        wait_for(healthy, timeout=timeout, interval=0.2, what=f"{component.name} at {url}")

    def _write_credentials(self) -> None:
        import trustme

        pki = self.workdir / "pki"
        pki.mkdir()
        ca = self.ca = trustme.CA()
        serving = ca.issue_cert("127.0.0.1", "localhost")
        self.ca_file = pki / "ca.crt"
        ca.cert_pem.write_to_path(str(self.ca_file))
        serving.private_key_pem.write_to_path(str(pki / "apiserver.key"))
        serving.cert_chain_pems[0].write_to_path(str(pki / "apiserver.crt"))
        # Service-account tokens are signed with this key; the API server verifies them with the
        # same file (a private key file also gives the public key).
        trustme.CA().private_key_pem.write_to_path(str(pki / "sa.key"))
        (pki / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')
        # A CA of its own, as kubeadm has: a client certificate of the cluster CA must not be able to
        # claim any user through the X-Remote-User header.
        front_proxy_ca = trustme.CA()
        front_proxy_ca.cert_pem.write_to_path(str(pki / "front-proxy-ca.crt"))
        client = front_proxy_ca.issue_cert(FRONT_PROXY_CLIENT, common_name=FRONT_PROXY_CLIENT)
        client.private_key_pem.write_to_path(str(pki / "front-proxy-client.key"))
        client.cert_chain_pems[0].write_to_path(str(pki / "front-proxy-client.crt"))
        self._ssl = ssl.create_default_context(cafile=str(self.ca_file))
        self._insecure = ssl.create_default_context()
        self._insecure.check_hostname = False
        self._insecure.verify_mode = ssl.CERT_NONE

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        etcd = self._spawn("etcd", [
            "--name=default", f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={self.etcd_url}", f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}", f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=default=http://127.0.0.1:{peer}",
            "--log-level=warn", "--unsafe-no-fsync",  # a throwaway store: fsync only costs time
        ])
        self._wait_healthy(etcd, f"{self.etcd_url}/health")

    def _start_apiserver(self) -> None:
        pki = self.workdir / "pki"
        self.api_port = free_port()
        apiserver = self._spawn("kube-apiserver", [
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", f"--secure-port={self.api_port}",
            # No kube-proxy and no pod network: the "kubernetes" Service's endpoints would need a
            # routable advertise address, and nothing here would use them.
            "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.key'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--profiling=false",
            *self._front_proxy_flags(pki), *self._audit_flags(), *self.apiserver_args,
        ])
        self.url = f"https://127.0.0.1:{self.api_port}"
        self._wait_healthy(apiserver, f"{self.url}/readyz", token=ADMIN_TOKEN, timeout=120)

    @staticmethod
    def _front_proxy_flags(pki: Path) -> list[str]:
        """The aggregation layer's: without them an APIService's requests cannot be proxied (the extension
        server would not know who asks). No --enable-aggregator-routing: an APIService's Service is then
        dialled by its ClusterIP, or for an ExternalName Service by that name, which is how a test reaches
        an adapter on 127.0.0.1 (EndpointSlices and Endpoints refuse loopback addresses)."""
        return [f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
                f"--proxy-client-key-file={pki / 'front-proxy-client.key'}"]

    def _audit_flags(self) -> list[str]:
        if not self.audit:
            return []
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text("apiVersion: audit.k8s.io/v1\nkind: Policy\n"
                          "omitStages: [RequestReceived, ResponseStarted]\nrules:\n- level: Metadata\n")
        self.audit_log = self.workdir / "audit.log"
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-maxsize=0"]

    def calls_by(self, username: str) -> int:
        """API requests `username` made (completed), from the audit log (audit=True)."""
        count = 0
        with self.audit_log.open() as log:
            for line in log:
                if f'"username":"{username}"' in line:
                    count += 1
        return count

    def _start_controllers(self) -> None:
        kubeconfig = str(self.admin_kubeconfig)
        common = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                  f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false", "--bind-address=127.0.0.1"]
        kcm_port, scheduler_port = free_port(), free_port()
        kcm = self._spawn("kube-controller-manager", [
            *common, f"--secure-port={kcm_port}", f"--cert-dir={self.workdir / 'kcm-certs'}",
            f"--controllers={','.join(self.controllers)}",
            # kwok's node heartbeats lag when the machine is busy; past the default 50 s the
            # node-lifecycle controller marks the node and every pod on it not Ready, and rollouts
            # stall for reasons no test is about. It still lifts the not-ready taint at start.
            "--node-monitor-grace-period=1h",
            # An HPA decides every 15 s by default; a test watching one scale need not wait that long.
            "--horizontal-pod-autoscaler-sync-period=2s",
            f"--root-ca-file={self.ca_file}",
        ])
        scheduler = self._spawn("kube-scheduler", [
            *common, f"--secure-port={scheduler_port}", f"--cert-dir={self.workdir / 'scheduler-certs'}",
        ])
        self._wait_healthy(kcm, f"https://127.0.0.1:{kcm_port}/healthz")
        self._wait_healthy(scheduler, f"https://127.0.0.1:{scheduler_port}/healthz")

    def _start_kwok(self) -> None:
        port = free_port()
        args = [f"--kubeconfig={self.admin_kubeconfig}", "--manage-all-nodes=true",
                # Pod IPs must not be loopback (Endpoints refuse 127.x); nothing routes to them.
                "--cidr=10.244.0.1/16", "--node-ip=10.0.0.1", f"--server-address=127.0.0.1:{port}"]
        config = self.workdir / "kwok.yaml"
        if self.kwok_config is not None:
            shutil.copyfile(self.kwok_config, config)
        else:
            # Without --config kwok reads ~/.kwok/kwok.yaml; an empty configuration means its default stages.
            config.write_text("apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\n")
        kwok = self._spawn("kwok", [f"--config={config}", *args])
        self._wait_healthy(kwok, f"http://127.0.0.1:{port}/healthz")

    # ---- nodes ----
    def add_node(self, name: str, *, gpus: int = 8, pods: int = 110, memory: str = "512Gi",
                 gpu_resource: str = "nvidia.com/gpu", labels: dict[str, str] | None = None,
                 pod_cidr: str | None = None) -> dict[str, Any]:
        """A fake GPU node, managed by kwok; returns it once kwok has marked it Ready. kwok gives its
        pods IPs from `pod_cidr` (default: kwok's --cidr)."""
        capacity = {"cpu": "64", "memory": memory, "pods": str(pods), gpu_resource: str(gpus)}
        self.create("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "type": "kwok", **(labels or {})},
                         "annotations": {"kwok.x-k8s.io/node": "fake"}},
            "spec": {"podCIDR": pod_cidr} if pod_cidr else {},
            "status": {"capacity": capacity, "allocatable": capacity},
        })

        def ready() -> dict[str, Any] | None:
            node = self.get(f"/api/v1/nodes/{name}")
            conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
            return node if conds.get("Ready") == "True" else None
        return dict(wait_for(ready, timeout=60, what=f"node {name} Ready (kwok)"))

    # ---- credentials ----
    def write_kubeconfig(self, path: Path, token: str, user: str, namespace: str = "default",
                         server: str | None = None) -> Path:
        """`server` (default: the API server) may be anything serving a certificate of this CA."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": user,
            "clusters": [{"name": "test", "cluster": {"server": server or self.url,
                                                      "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "test", "user": user, "namespace": namespace}}],
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def service_account_token(self, namespace: str, name: str, expiration_seconds: int = 3600) -> str:
        """A bound token for the ServiceAccount (the TokenRequest API, as `kubectl create token`)."""
        review = self.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", {
            "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
            "spec": {"expirationSeconds": expiration_seconds},
        })
        return str(review["status"]["token"])

    def service_account_kubeconfig(self, path: Path, namespace: str, name: str) -> Path:
        return self.write_kubeconfig(path, self.service_account_token(namespace, name),
                                     f"system:serviceaccount:{namespace}:{name}", namespace)

    # ---- the API, over real HTTPS ----
    def _raw(self, method: str, url: str, body: bytes | None = None, *, token: str | None = None,
             content_type: str = "application/json", accept: str = "application/json") -> tuple[int, str]:
        headers = {"Accept": accept}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = content_type
        verify = url.startswith(getattr(self, "url", "\0"))
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        context = (self._ssl if verify else self._insecure) if url.startswith("https") else None
        try:
            with urllib.request.urlopen(req, timeout=30, context=context) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def request(self, method: str, path: str, body: Any = None, *, token: str = ADMIN_TOKEN,
                content_type: str = "application/json", params: dict[str, str] | None = None,
                accept: str = "application/json") -> Any:
        url = self.url + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        status, text = self._raw(method, url, data, token=token, content_type=content_type, accept=accept)
        if status >= 400:
            raise ApiError(status, text)
        return json.loads(text) if text else None

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def get_or_none(self, path: str, **kw: Any) -> Any:
        try:
            return self.get(path, **kw)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("POST", path, body, **kw)

    def merge_patch(self, path: str, body: Any, **kw: Any) -> Any:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json", **kw)

    def apply(self, path: str, body: Any, *, field_manager: str, force: bool = False, **kw: Any) -> Any:
        """Server-side apply of `body` (the object's full intent) as `field_manager`."""
        params = {"fieldManager": field_manager, **({"force": "true"} if force else {})}
        return self.request("PATCH", path, body, content_type="application/apply-patch+yaml", params=params, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    def kubectl(self, *args: str, kubeconfig: Path | None = None, input_text: str | None = None,
                check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """The real kubectl (same build as the server), against this control plane."""
        result = subprocess.run([str(self.bin_dir / "kubectl"), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}",
                                 *args], capture_output=True, text=True, input=input_text, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    def apply_manifests(self, objects: Iterable[dict[str, Any]], *, field_manager: str = "kvpilot-tests") -> None:
        """kubectl apply --server-side of several objects at once (admin)."""
        text = yaml.safe_dump_all(list(objects), sort_keys=False)
        self.kubectl("apply", "--server-side", f"--field-manager={field_manager}", "-f", "-", input_text=text)


class Watch:
    """A real watch (`?watch=1`) read in a background thread; `events` holds (type, object) in the
    order the API server sent them, which is the order of the writes (resourceVersion), and
    `received` the time.monotonic() each arrived. The thread re-watches from the last
    resourceVersion every second (as informers do), so `stop()` never waits on a quiet stream."""

    def __init__(self, cp: ControlPlane, path: str, *, resource_version: str, label_selector: str = "") -> None:
        import threading

        self._cp, self._path, self._rv, self._selector = cp, path, resource_version, label_selector
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.received: list[float] = []
        self.error: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.is_set():
            params = {"watch": "1", "resourceVersion": self._rv, "timeoutSeconds": "1"}
            if self._selector:
                params["labelSelector"] = self._selector
            req = urllib.request.Request(f"{self._cp.url}{self._path}?{urllib.parse.urlencode(params)}",
                                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            try:
                with urllib.request.urlopen(req, timeout=30, context=self._cp._ssl) as resp:
                    for line in resp:
                        event = json.loads(line)
                        if event["type"] == "ERROR":  # e.g. 410 Gone: the history is lost, say so
                            self.error = str(event["object"].get("message"))
                            return
                        self.received.append(time.monotonic())
                        self.events.append((event["type"], event["object"]))
                        self._rv = event["object"]["metadata"]["resourceVersion"]
            except (OSError, ValueError) as exc:
                if not self._stopping.is_set():
                    self.error = f"{type(exc).__name__}: {exc}"
                    return

    def stop(self) -> list[tuple[str, dict[str, Any]]]:
        self._stopping.set()
        self._thread.join(35)
        assert self.error is None, f"the watch on {self._path} broke: {self.error}"
        return list(self.events)


class Operator:
    """The operator under test: a real `kvpilot operator --all-namespaces` process, as the chart's
    operator ServiceAccount, that a test can restart (stop it cleanly, start a new process)."""

    def __init__(self, kubeconfig: Path, workdir: Path, *extra_args: str) -> None:
        self._kubeconfig, self._workdir, self._extra_args = kubeconfig, workdir, extra_args
        self._stack = contextlib.ExitStack()
        self.processes: list[OperatorProcess] = []
        self._start()

    def _start(self) -> None:
        self.processes.append(self._stack.enter_context(operator_process(
            self._kubeconfig, self._workdir, "--all-namespaces", *self._extra_args,
            log_name=f"operator-{len(self.processes)}.log")))

    @property
    def current(self) -> OperatorProcess:
        return self.processes[-1]

    def restart(self) -> None:
        assert self.current.stop() == 0, f"operator did not shut down cleanly:\n{self.current.log()[-4000:]}"
        self._start()

    def kill_and_restart(self) -> None:
        """SIGKILL (no shutdown, no last status write, kopf's state as it was), then a new process."""
        self.current.proc.kill()
        self.current.proc.wait(15)
        self._start()

    def log(self) -> str:
        return "".join(p.log() for p in self.processes)

    def close(self) -> None:
        self._stack.close()
