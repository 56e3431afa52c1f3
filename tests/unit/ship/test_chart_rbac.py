"""Least privilege, checked three ways:

1. the chart grants the operator exactly what kvpilot/operator/rbac.py declares (no more, no less),
   in both RBAC scopes;
2. every request a real operator run makes (KMock records them) is granted by the chart;
3. the tuner's grants match the calls its Kubernetes code makes.

A permission is a (apiGroup, resource, verb) triple; resource may carry a subresource
("inferenceservices/status"), as in RBAC.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.chart import NAMESPACE, ROOT, VALUE_SETS, Rendered, find, local_operator_args, render

Permission = tuple[str, str, str]

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')")

# Cluster-scoped resources a namespaced Role cannot grant (the ones an operator might touch).
CLUSTER_SCOPED = {
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("", "namespaces"),
    ("", "nodes"),
    ("", "persistentvolumes"),
    ("rbac.authorization.k8s.io", "clusterroles"),
    ("rbac.authorization.k8s.io", "clusterrolebindings"),
    ("storage.k8s.io", "storageclasses"),
}


def expand(rules: Iterable[dict[str, Any]]) -> set[Permission]:
    """RBAC rules -> the set of permissions they grant (wildcards are refused outright)."""
    granted: set[Permission] = set()
    for rule in rules:
        assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], f"wildcard in {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


def chart_grants(objects: list[Rendered], component: str) -> dict[str | None, set[Permission]]:
    """namespace (None for cluster-wide) -> what the chart grants `component`'s ServiceAccount."""
    sa = next(
        r.obj["metadata"]["name"]
        for r in objects
        if r.kind == "ServiceAccount" and r.name.endswith(f"-{component}")
    )
    roles = {
        (r.kind, r.obj["metadata"].get("namespace"), r.name): r.obj
        for r in objects
        if r.kind in ("Role", "ClusterRole")
    }
    grants: dict[str | None, set[Permission]] = {}
    for r in objects:
        if r.kind not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in r.obj["subjects"]):
            continue
        namespace = r.obj["metadata"].get("namespace")
        role_kind = r.obj["roleRef"]["kind"]
        role = roles[(role_kind, namespace if role_kind == "Role" else None, r.obj["roleRef"]["name"])]
        grants.setdefault(namespace, set()).update(expand(role["rules"]))
    return grants


def operator_args(objects: list[Rendered]) -> list[str]:
    deployment = next(r.obj for r in objects if r.kind == "Deployment" and r.name.endswith("-operator"))
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def declared_operator(objects: list[Rendered] | None = None) -> set[Permission]:
    """What kvpilot/operator/rbac.py declares for the operator run as the chart runs it: with
    --all-namespaces kopf also watches CRDs; with exact --namespace names it reads nothing
    cluster-scoped (scanning off)."""
    from kvpilot.operator import rbac

    args = operator_args(objects if objects is not None else render("default"))
    namespaces = [a.split("=", 1)[1] for a in args if a.startswith("--namespace=")]
    return expand(rbac.cluster_role_rules(all_namespaces="--all-namespaces" in args, namespaces=namespaces))


def declared_lease(objects: list[Rendered] | None = None) -> set[Permission]:
    """What rbac.py declares for leader election, which the chart's operator always runs with; the
    Lease lives in the release namespace (--leader-elect-resource-namespace)."""
    from kvpilot.operator import rbac

    args = operator_args(objects if objects is not None else render("default"))
    assert "--leader-elect" in args and f"--leader-elect-resource-namespace={NAMESPACE}" in args, args
    return expand(rule.as_manifest() for rule in rbac.LEADER_ELECTION)


def diff(granted: set[Permission], needed: set[Permission]) -> str:
    missing, extra = sorted(needed - granted), sorted(granted - needed)
    return f"missing: {missing}; granted but not needed: {extra}"


# --- 1. chart == declared --------------------------------------------------------------------------


def test_cluster_scope_grants_the_operator_exactly_what_it_declares() -> None:
    objects = render("default")
    grants = chart_grants(objects, "operator")
    assert set(grants) == {None, NAMESPACE}
    assert grants[None] == declared_operator(objects), diff(grants[None], declared_operator(objects))
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in grants[None]
    # Leases only in the release namespace, where the operator's own Lease is.
    assert grants[NAMESPACE] == declared_lease(objects), diff(grants[NAMESPACE], declared_lease(objects))
    assert not any(resource == "leases" for _, resource, _ in grants[None])


def test_cluster_scope_watching_named_namespaces_grants_no_cluster_scoped_reads() -> None:
    objects = render({"watch": {"allNamespaces": False, "namespaces": ["team-a"]}})
    grants = chart_grants(objects, "operator")
    assert set(grants) == {None, NAMESPACE} and grants[NAMESPACE] == declared_lease(objects)
    assert grants[None] == declared_operator(objects), diff(grants[None], declared_operator(objects))
    assert not {p for p in grants[None] if (p[0], p[1].split("/")[0]) in CLUSTER_SCOPED}


@pytest.mark.parametrize("value_set", ["namespace-scoped", "namespaces-operator-only"])
def test_namespace_scope_grants_the_same_in_each_namespace_and_nothing_cluster_wide(value_set: str) -> None:
    """Watching exact namespace names, kopf's scanning is off: no Namespace or CRD reads, so
    the Roles are all there is (test_operator_works_with_only_the_chart_rbac runs that path)."""
    objects = render(value_set)
    grants = chart_grants(objects, "operator")
    declared = declared_operator(objects)
    assert not {p for p in declared if (p[0], p[1].split("/")[0]) in CLUSTER_SCOPED}
    namespaces = set(VALUE_SETS[value_set]["watch"]["namespaces"])
    assert NAMESPACE not in namespaces
    assert set(grants) == namespaces | {NAMESPACE}
    for ns in namespaces:
        assert grants[ns] == declared, diff(grants[ns], declared)
    assert grants[NAMESPACE] == declared_lease(objects)
    assert find(objects, "ClusterRole", "-operator") == []


def test_no_role_names_a_cluster_scoped_resource() -> None:
    for r in render("namespaces-operator-only") + render("namespace-scoped"):
        if r.kind == "Role":
            for group, resource, _ in expand(r.obj["rules"]):
                assert (group, resource.split("/")[0]) not in CLUSTER_SCOPED, (r.name, group, resource)


def test_the_comparison_catches_a_missing_and_an_extra_grant() -> None:
    declared = declared_operator()
    dropped = sorted(declared)[0]
    assert declared - {dropped} != declared
    text = diff(declared - {dropped}, declared)
    assert str(dropped) in text.split(";")[0]
    extra = ("", "secrets", "get")
    assert str(extra) in diff(declared | {extra}, declared).split(";")[1]


def test_no_component_can_read_secrets_or_escalate() -> None:
    forbidden_resources = {
        "secrets",
        "pods/exec",
        "serviceaccounts/token",
        "roles",
        "rolebindings",
        "clusterroles",
        "clusterrolebindings",
    }
    forbidden_verbs = {"escalate", "bind", "impersonate", "*"}
    for value_set in ("default", "namespace-scoped"):
        objects = render(value_set)
        for component in ("operator", "tuner"):
            for permissions in chart_grants(objects, component).values():
                for _group, resource, verb in permissions:
                    assert resource not in forbidden_resources and verb not in forbidden_verbs, (
                        component,
                        resource,
                        verb,
                    )


# --- 2. every recorded call is granted -------------------------------------------------------------

_RESOURCE_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?/?$"
)


def request_permission(method: str, path: str) -> tuple[str | None, Permission] | None:
    """An HTTP request -> (namespace, permission) as the API server's authorizer sees it.

    Discovery (/api, /apis, /apis/G/V, /version, /openapi) is a non-resource URL every
    authenticated user may read (system:discovery) and maps to None.
    """
    parsed = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(parsed.query)
    m = _RESOURCE_PATH.match(parsed.path)
    if not m:
        return None
    group = "" if m["core"] else m["group"]
    resource, name, sub, ns = m["resource"], m["name"], m["sub"], m["ns"]
    if sub:
        resource = f"{resource}/{sub}"
    watch = query.get("watch", ["false"])[0] in ("true", "1")
    verb = {
        "GET": "watch" if watch else ("get" if name else "list"),
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }[method.upper()]
    return ns, (group, resource, verb)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/apis", None),
        ("GET", "/apis/kvpilot.dev/v1alpha1", None),
        ("GET", "/api/v1", None),
        (
            "GET",
            "/apis/kvpilot.dev/v1alpha1/inferenceservices",
            (None, ("kvpilot.dev", "inferenceservices", "list")),
        ),
        (
            "GET",
            "/apis/kvpilot.dev/v1alpha1/inferenceservices?watch=true",
            (None, ("kvpilot.dev", "inferenceservices", "watch")),
        ),
        (
            "PATCH",
            "/apis/kvpilot.dev/v1alpha1/namespaces/ns/inferenceservices/x/status",
            ("ns", ("kvpilot.dev", "inferenceservices/status", "patch")),
        ),
        ("POST", "/api/v1/namespaces/ns/events", ("ns", ("", "events", "create"))),
        ("GET", "/api/v1/namespaces/ns/services/svc", ("ns", ("", "services", "get"))),
        (
            "DELETE",
            "/apis/policy/v1/namespaces/ns/poddisruptionbudgets/p",
            ("ns", ("policy", "poddisruptionbudgets", "delete")),
        ),
        (
            "GET",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            (None, ("apiextensions.k8s.io", "customresourcedefinitions", "list")),
        ),
    ],
)
def test_request_permission(method: str, path: str, expected: Any) -> None:
    assert request_permission(method, path) == expected


def allowed(grants: dict[str | None, set[Permission]], namespace: str | None, permission: Permission) -> bool:
    group, resource, verb = permission
    needed = {permission}
    if verb == "list":
        # KMock records the path without the query, so a watch reads as a list: need either.
        needed = {(group, resource, "list"), (group, resource, "watch")}
    pools = [grants.get(None, set())] + ([grants.get(namespace, set())] if namespace else [])
    return any(p in pool for pool in pools for p in needed)


def own_requests(api: Any) -> list[tuple[str, str]]:
    """Record the requests this test sends through the KMockAPI helpers, so they can be told
    apart from the operator's in KMock's record of every request."""
    sent: list[tuple[str, str]] = []
    send = api.request

    def request(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        sent.append((method, path))
        return send(method, path, *args, **kwargs)

    api.request = request
    return sent


def without(calls: list[tuple[str, str]], ours: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """calls minus one occurrence of each of ours (a multiset difference)."""
    remaining = list(calls)
    for call in ours:
        remaining.remove(call)
    return remaining


def roll_out_a_change(kmock_api: Any, api: Any, name: str) -> None:
    """Wait for the operator's first status, change a tuned field, and wait until the Deployment
    runs it and the status reports the new generation."""
    deploy_path = f"/apis/apps/v1/namespaces/team-a/deployments/{name}"

    def observed(generation: int) -> bool:
        status = api.get_isvc("team-a", name).get("status") or {}
        return status.get("observedGeneration") == generation and bool(status.get("conditions"))

    kmock_api.wait_for(lambda: observed(1), timeout=60, what="status for generation 1")
    api.patch(api.isvc_path("team-a", name), {"spec": {"engine": {"maxNumBatchedTokens": 4096}}})
    kmock_api.wait_for(
        lambda: "4096" in api.get(deploy_path)["spec"]["template"]["spec"]["containers"][0]["args"],
        timeout=60,
        what="the Deployment to run --max-num-batched-tokens 4096",
    )
    kmock_api.wait_for(lambda: observed(2), timeout=60, what="status for generation 2")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_every_call_of_a_real_operator_run_is_granted(tmp_path: Path) -> None:
    """Run the real operator, with the chart's args, against KMock through a create and a change
    of an InferenceService, and hold every request it made against the chart's grants."""
    kmock_api = pytest.importorskip("harness.kmock_api", reason="the KMock harness is not there yet")

    isvc = yaml.safe_load((ROOT / "examples" / "twin.yaml").read_text())
    isvc["metadata"]["namespace"] = "team-a"
    name = isvc["metadata"]["name"]
    with kmock_api.KMockAPI(monitoring_crds=True) as api:
        ours = own_requests(api)
        # The operator exactly as the chart runs it, except the port (a free one, chosen by the harness).
        deployment = next(
            r.obj for r in render("default") if r.kind == "Deployment" and r.name.endswith("-operator")
        )
        chart_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert chart_args[0] == "operator"
        args = local_operator_args(chart_args[1:], tmp_path)
        with kmock_api.kopf_operator(api, tmp_path, *args):
            api.create_isvc(isvc)
            deploy_path = f"/apis/apps/v1/namespaces/team-a/deployments/{name}"
            kmock_api.wait_for(lambda: api.get_or_none(deploy_path), what="the engine Deployment", timeout=60)
            # A tuned-field change: the operator patches the Deployment and reports the new generation.
            roll_out_a_change(kmock_api, api, name)
        operator_calls = without(api.calls, ours)

    seen = {p for call in operator_calls if (p := request_permission(*call)) is not None}
    assert any(perm == ("apps", "deployments", "create") for _, perm in seen), sorted(seen)
    grants = chart_grants(render("default"), "operator")
    denied = sorted(((ns, perm) for ns, perm in seen if not allowed(grants, ns, perm)), key=str)
    assert denied == [], f"the operator called what the chart does not grant: {denied}"
    # And nothing it called is missing from what it declares (kvpilot/operator/rbac.py).
    declared = {None: declared_operator(), NAMESPACE: declared_lease()}
    assert any(perm == ("coordination.k8s.io", "leases", "patch") for _, perm in seen), sorted(seen)
    undeclared = sorted(((ns, perm) for ns, perm in seen if not allowed(declared, ns, perm)), key=str)
    assert undeclared == [], f"the operator called what rbac.py does not declare: {undeclared}"


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("value_set", ["default", "namespace-scoped"])
def test_operator_works_with_only_the_chart_rbac(value_set: str, tmp_path: Path) -> None:
    """The operator, run with the chart's args, through a proxy that enforces the chart's RBAC
    for its ServiceAccount (403 for anything else): it still creates every child, writes status,
    posts Events and rolls a change out to its Deployment."""
    kmock_api = pytest.importorskip("harness.kmock_api", reason="the KMock harness is not there yet")
    from tests.unit.ship.rbac_proxy import RbacProxy

    objects = render(value_set)
    deployment = next(r.obj for r in objects if r.kind == "Deployment" and r.name.endswith("-operator"))
    chart_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    args = local_operator_args(chart_args[1:], tmp_path)
    isvc = yaml.safe_load((ROOT / "examples" / "twin.yaml").read_text())
    isvc["metadata"]["namespace"] = "team-a"
    name = isvc["metadata"]["name"]
    deploy_path = f"/apis/apps/v1/namespaces/team-a/deployments/{name}"

    with (
        kmock_api.KMockAPI(monitoring_crds=True) as api,
        RbacProxy(
            api.url, chart_grants(objects, "operator"), request_permission, namespaces=("team-a",)
        ) as proxy,
        kmock_api.kopf_operator(proxy, tmp_path, *args) as operator,
    ):  # type: ignore[arg-type]
        api.create_isvc(isvc)
        children = [
            deploy_path,
            f"/api/v1/namespaces/team-a/services/{name}",
            f"/apis/policy/v1/namespaces/team-a/poddisruptionbudgets/{name}",
            f"/apis/monitoring.coreos.com/v1/namespaces/team-a/servicemonitors/{name}",
        ]
        for path in children:
            kmock_api.wait_for(lambda p=path: api.get_or_none(p), timeout=60, what=f"{path} to be created")
        # A change: the operator patches its Deployment and reports the new generation.
        roll_out_a_change(kmock_api, api, name)
        assert api.get_or_none(f"/api/v1/namespaces/team-a/services/{name}") is not None
        log = operator.log()

    denied = sorted({request_permission(*d) for d in proxy.denied}, key=str)
    assert denied == [], f"{value_set}: the chart's RBAC refused the operator: {denied}\n{log[-2000:]}"


# --- 3. the tuner ------------------------------------------------------------------------------------

# What the tuner's code calls (kvpilot/tuner/incluster.py and adapters/kubernetes.py); the recorded
# run below holds this list to what the code really does.
TUNER_NEEDS: set[Permission] = {
    ("kvpilot.dev", "inferenceservices", "list"),  # the scan for services with tuning enabled
    ("kvpilot.dev", "inferenceservices", "get"),
    ("kvpilot.dev", "inferenceservices", "patch"),  # server-side apply of the tuned fields
    ("kvpilot.dev", "inferenceservices/status", "patch"),  # status.tuning, the Scaling condition
    ("kvpilot.dev", "inferenceservices/scale", "patch"),  # the planner's spec.replicas (actor kvpilot)
    ("", "events", "create"),  # one Event per trial, and per scaling decision
}


def test_tuner_grants() -> None:
    grants = chart_grants(render("default"), "tuner")
    assert set(grants) == {None}
    assert grants[None] == TUNER_NEEDS, diff(grants[None], TUNER_NEEDS)
    assert chart_grants(render("namespace-scoped"), "tuner") == {"team-a": TUNER_NEEDS}
    assert find(render("operator-only"), "ClusterRole", "-tuner") == []


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_every_call_of_the_real_tuner_is_granted(tmp_path: Path) -> None:
    """The tuner process scanning (`kvpilot tuner`, as the chart runs it), and its Kubernetes applier
    and status observer driven through one trial, against KMock: every request is granted, and
    between them they use every grant."""
    import os
    import signal
    import subprocess
    import sys

    kmock_api = pytest.importorskip("harness.kmock_api", reason="the KMock harness is not there yet")
    pytest.importorskip(
        "kvpilot.tuner.adapters.kubernetes", reason="the tuner's kubernetes adapter is not there yet"
    )
    from kvpilot.api.vocabulary import TuningPhase
    from kvpilot.tuner.adapters.kubernetes import KubernetesApplier, KubeStatusObserver
    from kvpilot.tuner.core.loop import ApplyFailed
    from kvpilot.tuner.core.space import EngineParams

    isvc = yaml.safe_load((ROOT / "examples" / "twin.yaml").read_text())
    isvc["metadata"]["namespace"] = "team-a"
    isvc["spec"]["tuning"]["enabled"] = False  # the scan sees it; no study starts (that needs Prometheus)
    # The scan starts its planner, which holds the count (Prometheus is not there) and says so.
    isvc["spec"]["autoscaling"] = {"actor": "kvpilot", "minReplicas": 2, "maxReplicas": 4}
    name = isvc["metadata"]["name"]
    tuner = next(r.obj for r in render("default") if r.kind == "Deployment" and r.name.endswith("-tuner"))
    chart_args = tuner["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [a.replace("$(KVPILOT_TUNER_STORAGE)", f"sqlite:///{tmp_path}/tuner.db") for a in chart_args]
    args = [a for a in args if not a.startswith("--metrics-port")] + ["--metrics-port=0", "--resync=0.2"]

    with kmock_api.KMockAPI(monitoring_crds=True) as api:
        api.create_isvc(isvc)
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")
        before_scan = len(api.calls)
        env = dict(os.environ, KUBECONFIG=str(kubeconfig))
        with (tmp_path / "tuner.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpilot.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        try:
            kmock_api.wait_for(
                lambda: sum(1 for c in api.calls[before_scan:] if c[0] == "GET") >= 2,
                timeout=60,
                what="the tuner to scan twice",
            )
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        scan_calls = api.calls[before_scan:]
        assert proc.returncode == 0, (tmp_path / "tuner.log").read_text()[-3000:]

        # One trial's worth of the adapter's calls, in-process through the tuner's own client.
        from kvpilot.tuner.kubeapi import KubeAPI

        before_trial = len(api.calls)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KUBECONFIG", str(kubeconfig))
            client = KubeAPI.from_environment()
        try:
            applier = KubernetesApplier(client, "team-a", name, timeout_s=0.5, poll_s=0.1)
            observer = KubeStatusObserver(client, "team-a", name, study="e2e")
            params = applier.current()
            observer.trial_started(0, params, "current")
            observer.phase(TuningPhase.APPLYING, "Trial", "applying trial 0")
            with pytest.raises(ApplyFailed):  # no operator here to complete the rollout
                applier.apply(EngineParams(8192, 0.92, 1024), 0)
            observer.trial_finished(0, params, "infeasible", None)
            # One scale-up's writes, through the planner's own code.
            from prometheus_client import CollectorRegistry

            from kvpilot.tuner.capacity import TwinCapacity
            from kvpilot.tuner.observe import TunerMetrics
            from kvpilot.tuner.scaler import Scaler
            from kvpilot.tuner.scaling import Actions

            obj = api.get_isvc("team-a", name)
            scaler = Scaler(client, obj, prometheus="http://127.0.0.1:9", interval_s=30.0,
                            metrics=TunerMetrics(CollectorRegistry()), capacity=TwinCapacity())
            scaler.act(obj, 2, Actions(replicas=3, event=("Normal", "LoadRising", "up"),
                                       condition=("True", "LoadRising", "up")))
        finally:
            client.close()
        trial_calls = api.calls[before_trial:]

    seen = {p for call in scan_calls + trial_calls if (p := request_permission(*call)) is not None}
    used = {perm for _, perm in seen}
    grants = chart_grants(render("default"), "tuner")
    denied = sorted(((ns, perm) for ns, perm in seen if not allowed(grants, ns, perm)), key=str)
    assert denied == [], f"the tuner called what the chart does not grant: {denied}"
    # Nothing granted that no code path used (a list GET reads as list or watch; see allowed()).
    unused = sorted(p for p in grants[None] if p not in used)
    assert unused == [], f"the chart grants the tuner what it never called: {unused}"
