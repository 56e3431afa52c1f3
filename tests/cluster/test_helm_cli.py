"""The real helm CLI (helm.sh/helm/v4, scripts/build-helm.sh) on a real control plane of its own, running the
commands of charts/kvpilot/README.md as written (read from it): lint, install, upgrade, history, rollback,
test and uninstall. Only the kubeconfig differs, given as $KUBECONFIG.

The control plane is this module's own: the release installs the CRD, a ValidatingWebhookConfiguration with
failurePolicy Fail that no pod here can answer, and cluster-wide RBAC, none of which the package's other tests
may meet. The operator the chart deploys is a kwok pod that runs nothing, so `helm test` meets a real
`kvpilot operator` process started with the installed Deployment's arguments as the chart's ServiceAccount,
and the hook pod's command runs as a real process (see kwok-stages.yaml, helm-test-pod-*).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness import chart
from harness.cluster import ADMIN_TOKEN, ControlPlane, built_binaries, wait_for
from harness.helm_cli import Helm, built_helm, readme_command
from harness.kmock_api import OperatorProcess, free_port, operator_process
from tests.cluster.common import KWOK_STAGES, NODE

pytestmark = pytest.mark.cluster

LIFECYCLE = "Upgrade, roll back, test, uninstall"
CRD = "inferenceservices.kvpilot.dev"
EXIT_CODE = "kvpilot.dev/test-exit-code"
OUTPUT = "kvpilot.dev/test-output"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with ControlPlane(built_binaries(), tmp_path_factory.mktemp("helm-control-plane"), kwok_config=KWOK_STAGES) as cp:
        cp.add_node(NODE)
        yield cp
        cp.check_alive()


def install_command() -> tuple[list[str], str, str]:
    """The README's install command, its release name and its namespace."""
    argv = readme_command("install")
    release = argv[2]
    namespace = argv[argv.index("--namespace") + 1]
    return argv, release, namespace


def test_helm_lint_strict_passes_with_the_defaults_and_every_value_set(tmp_path: Path) -> None:
    helm = Helm(built_helm(), tmp_path / "no-cluster.kubeconfig", tmp_path / "helm")
    lint = readme_command("lint")
    assert lint[-2:] == ["--strict", "charts/kvpilot"], lint
    for name, values in chart.VALUE_SETS.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values))
        result = helm.run([*lint, f"--values={path}"], check=False)
        assert result.returncode == 0, f"helm lint --strict with value set {name!r}:\n{result.stdout}{result.stderr}"
        assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout
        # --strict fails on warnings; INFO lines (the icon, say) are not findings worth failing on.
        assert "[WARNING]" not in result.stdout, result.stdout


def test_the_readme_lifecycle_install_upgrade_rollback_test_uninstall(cluster: ControlPlane, tmp_path: Path) -> None:
    install, release, ns = install_command()
    helm = Helm(built_helm(), tmp_path / "kubeconfig", tmp_path / "helm")
    cluster.write_kubeconfig(helm.kubeconfig, ADMIN_TOKEN, "admin")
    assert cluster.get_or_none(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD}") is None

    # ---- install ----
    out = helm.run(install).stdout
    assert re.search(r"^STATUS: deployed$", out, re.M), out
    manifest = list(yaml.safe_load_all(helm.run(["helm", "get", "manifest", release, "-n", ns]).stdout))
    manifest = [o for o in manifest if o]
    objects = live_objects(cluster, manifest, tmp_path / "manifest.yaml")
    assert sorted(objects) == sorted(key(o) for o in manifest), "objects of the release missing from the API server"
    kinds = {k for k, _, _ in objects}
    assert {"Deployment", "Service", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
            "PodDisruptionBudget", "ValidatingWebhookConfiguration", "Secret", "PersistentVolumeClaim",
            "ConfigMap", "NetworkPolicy"} <= kinds, kinds
    assert not any(k == "Pod" for k, _, _ in objects), "the test hook must not run at install"
    # crds/ is installed by helm (not in the manifest) before the templates, and is served.
    crd = cluster.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD}")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}.get("Established") == "True"
    # Established is not yet served (429 "storage is (re)initializing" for a moment, README.md): the
    # operator started below would log its retry as an error.
    wait_for(lambda: cluster.get("/apis/kvpilot.dev/v1alpha1/inferenceservices"), timeout=30,
             what="InferenceServices served")
    # The webhook's TLS comes from the CA the chart generates at install: the configuration trusts the
    # certificate in the Secret the operator mounts.
    (webhook,) = [o for o in manifest if o["kind"] == "ValidatingWebhookConfiguration"]
    live_hook = cluster.get(f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/"
                            f"{webhook['metadata']['name']}")
    assert live_hook["webhooks"][0]["clientConfig"]["caBundle"]
    operator = f"{release}-operator" if "kvpilot" in release else f"{release}-kvpilot-operator"
    deployment_path = f"/apis/apps/v1/namespaces/{ns}/deployments/{operator}"
    wait_for(lambda: cluster.get(deployment_path)["status"].get("availableReplicas") == 2, timeout=90,
             what="the operator Deployment's 2 replicas available (kwok pods)")

    # ---- upgrade, rollback, history ----
    upgrade = readme_command("upgrade", LIFECYCLE)
    assert "--set" in upgrade and upgrade[2] == release
    helm.run(upgrade)
    live = cluster.get(deployment_path)
    assert live["spec"]["replicas"] == 1
    assert "--log-format=text" in live["spec"]["template"]["spec"]["containers"][0]["args"]
    pdb_path = f"/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets/{operator}"
    assert cluster.get_or_none(pdb_path) is None, "one replica: the chart renders no PDB, so the upgrade deletes it"

    helm.run(readme_command("rollback", LIFECYCLE))
    live = cluster.get(deployment_path)
    assert live["spec"]["replicas"] == 2
    args = live["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--log-format=json" in args and "--log-format=text" not in args
    assert cluster.get_or_none(pdb_path) is not None

    history = helm.run(readme_command("history", LIFECYCLE)).stdout
    assert revisions(history) == [(1, "superseded", "Install complete"), (2, "superseded", "Upgrade complete"),
                                  (3, "deployed", "Rollback to 1")], history

    # ---- helm test: failing while no operator answers, then passing ----
    test = readme_command("test", LIFECYCLE)
    service = cluster.get(f"/api/v1/namespaces/{ns}/services/{operator}")
    no_operator = f"http://127.0.0.1:{free_port()}"
    failed = run_helm_test(cluster, helm, test, ns, service, no_operator, tmp_path / "helm-test-1.log")
    assert failed.returncode != 0, failed.stdout
    assert "FAILED: operator" in failed.pod_output and "ok: inferenceservices.kvpilot.dev/v1alpha1 served" in failed.pod_output
    pod = cluster.get(f"/api/v1/namespaces/{ns}/pods/{failed.pod}")
    assert pod["status"]["phase"] == "Failed", "a failed hook pod stays for `kubectl logs`"

    with local_operator(cluster, live, ns, tmp_path) as op:
        passed = run_helm_test(cluster, helm, test, ns, service, f"http://127.0.0.1:{op.metrics_port}",
                               tmp_path / "helm-test-2.log")
        assert passed.returncode == 0, passed.stdout
        assert re.search(r"Phase:\s+Succeeded", passed.stdout), passed.stdout
        assert passed.pod_output.splitlines() == [
            f"ok: operator http://127.0.0.1:{op.metrics_port}/healthz: HTTP 200",
            "ok: inferenceservices.kvpilot.dev/v1alpha1 served: GET /apis/kvpilot.dev/v1alpha1 lists inferenceservices"]
        # hook-succeeded: a pod that passed is removed (and the failed one went before the new one came).
        wait_for(lambda: cluster.get_or_none(f"/api/v1/namespaces/{ns}/pods/{passed.pod}") is None, timeout=30,
                 what="the passed test pod deleted")
        op.assert_no_errors_logged()

    # ---- uninstall ----
    uninstall = readme_command("uninstall", LIFECYCLE)
    out = helm.run(uninstall).stdout
    assert f'release "{release}" uninstalled' in out, out
    # What helm keeps by design (the README says which): the CRD from crds/, the tuner's PVC
    # (helm.sh/resource-policy: keep) and the namespace --create-namespace made. Nothing else.
    kept = {("PersistentVolumeClaim", ns, f"{operator.removesuffix('-operator')}-tuner")}
    assert set(live_objects(cluster, manifest, tmp_path / "manifest.yaml")) == kept
    assert cluster.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD}")
    assert cluster.get(f"/api/v1/namespaces/{ns}")["status"]["phase"] == "Active"
    labelled = "pods,replicasets,deployments,services,serviceaccounts,secrets,configmaps,persistentvolumeclaims," \
               "roles,rolebindings,clusterroles,clusterrolebindings,validatingwebhookconfigurations," \
               "networkpolicies,poddisruptionbudgets,leases"

    def only_kept() -> list[str] | None:
        names = cluster.kubectl("get", labelled, "-A", "-o", "name",
                                f"-l=app.kubernetes.io/instance={release}").stdout.split()
        return names if names == [f"persistentvolumeclaim/{next(iter(kept))[2]}"] else None
    wait_for(only_kept, timeout=60, what="the release's pods garbage-collected, only the kept PVC left")
    release_secrets = cluster.kubectl("get", "secrets", "-n", ns, "-o", "name", "-l", f"owner=helm,name={release}").stdout
    assert release_secrets.strip() == "", "helm uninstall (without --keep-history) deletes the release's records"
    assert helm.run(["helm", "list", "-n", ns, "-q"]).stdout.strip() == ""


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def live_objects(cp: ControlPlane, manifest: list[dict[str, Any]], path: Path) -> list[tuple[str, str, str]]:
    """Which of the manifest's objects the API server has, read by the real kubectl (`get -f`)."""
    path.write_text(yaml.safe_dump_all(manifest))
    out = cp.kubectl("get", "-f", str(path), "--ignore-not-found", "-o", "json").stdout
    if not out.strip():
        return []
    listed = json.loads(out)
    return [key(o) for o in listed.get("items", [listed] if "kind" in listed and listed["kind"] != "List" else [])]


def revisions(history: str) -> list[tuple[int, str, str]]:
    """`helm history`'s table: revision, status, description."""
    rows = []
    for line in history.splitlines()[1:]:
        cells = [c.strip() for c in line.split("\t")]
        if cells and cells[0].isdigit():
            rows.append((int(cells[0]), cells[2], cells[-1]))
    return rows


class HelmTestRun:
    def __init__(self, returncode: int, stdout: str, pod: str, pod_output: str) -> None:
        self.returncode, self.stdout, self.pod, self.pod_output = returncode, stdout, pod, pod_output


def run_helm_test(cp: ControlPlane, helm: Helm, command: list[str], ns: str, service: dict[str, Any],
                  operator_url: str, log: Path) -> HelmTestRun:
    """`helm test` as the README runs it, with its hook pod played here: no container runs under kwok, so the
    pod's own command runs as a local process (the image's entrypoint is `kvpilot`), as the pod's
    ServiceAccount, and its exit code and output go on the pod, which kwok then ends Succeeded or Failed.
    The one change: the operator URL names the Service's cluster DNS name, which resolves only in a
    cluster; it is checked to be that Service's name and port, then pointed at `operator_url`."""
    proc = helm.popen(command, log)
    try:
        def hook_pod() -> dict[str, Any] | None:
            assert proc.poll() is None, f"helm test exited {proc.returncode} before its pod ran:\n{log.read_text()}"
            pods = cp.get(f"/api/v1/namespaces/{ns}/pods", params={
                "labelSelector": "app.kubernetes.io/component=test"})["items"]
            waiting = [p for p in pods if p["status"].get("phase") == "Pending" and "deletionTimestamp" not in p["metadata"]
                       and p["spec"].get("nodeName")]
            return waiting[0] if waiting else None
        pod = wait_for(hook_pod, timeout=60, what="helm test's hook pod scheduled")
        assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
        (container,) = pod["spec"]["containers"]
        args = list(container["args"])
        (url_arg,) = [a for a in args if a.startswith("--operator-url=")]
        url = urllib.parse.urlsplit(url_arg.split("=", 1)[1])
        svc = service["metadata"]
        assert (url.hostname, url.port) == (f"{svc['name']}.{svc['namespace']}.svc", service["spec"]["ports"][0]["port"])
        args[args.index(url_arg)] = f"--operator-url={operator_url}"
        account = pod["spec"].get("serviceAccountName", "default")
        kubeconfig = cp.service_account_kubeconfig(log.with_suffix(".kubeconfig"), ns, account)
        check = subprocess.run([sys.executable, "-m", "kvpilot.cli", *args], capture_output=True, text=True,
                               timeout=60, env=helm.env() | {"KUBECONFIG": str(kubeconfig)})
        output = check.stdout + check.stderr
        cp.merge_patch(f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}", {"metadata": {"annotations": {
            EXIT_CODE: str(check.returncode), OUTPUT: output}}})
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return HelmTestRun(proc.returncode, log.read_text(), pod["metadata"]["name"], output)


@contextlib.contextmanager
def local_operator(cp: ControlPlane, deployment: dict[str, Any], ns: str, workdir: Path) -> Iterator[OperatorProcess]:
    """`kvpilot operator` with the installed Deployment's arguments (webhook on a free port, throwaway
    certificate) as the Deployment's ServiceAccount, through the chart's RBAC."""
    spec = deployment["spec"]["template"]["spec"]
    kubeconfig = cp.service_account_kubeconfig(workdir / "operator.kubeconfig", ns, spec["serviceAccountName"])
    args = chart.local_operator_args(spec["containers"][0]["args"][1:], workdir)
    with operator_process(kubeconfig, workdir, *args) as op:
        yield op
        op.assert_alive()
