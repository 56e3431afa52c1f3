"""The Helm chart, rendered offline with Helm's own engine (helm-python-sdk), for the default
values and the other value sets in chart.py: lint, Kubernetes schema validation, the restricted
Pod Security Standard, the values schema, and what each setting turns into.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    ROOT,
    VALUE_SETS,
    Rendered,
    find,
    one,
    render,
    validate_values,
)
from tests.unit.ship.pss import restricted_violations

helm_python = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')"
)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed"
)

KUBE_VERSIONS = ("1.30", "1.33")
# Custom resources kubernetes-validate has no schema for: Prometheus Operator kinds.
# They are checked below by structure and, for the rules, by promtool (test_chart_monitoring.py).
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    # cert-manager's, for the admission webhook's certificate (test_chart_webhook.py checks them).
    ("cert-manager.io/v1", "Issuer"),
    ("cert-manager.io/v1", "Certificate"),
}
FULLNAME = f"{RELEASE}-kvpilot"
SETS = sorted(VALUE_SETS)


def _pod_specs(objects: list[Rendered]) -> list[tuple[str, dict[str, Any]]]:
    """Every pod the chart can run: its workloads' templates and its bare Pods (the `helm test` hook)."""
    return [
        (r.name, r.obj["spec"]["template"]["spec"])
        for r in objects
        if r.kind in ("Deployment", "StatefulSet", "Job")
    ] + [(r.name, r.obj["spec"]) for r in objects if r.kind == "Pod"]


def _container(objects: list[Rendered], deployment_suffix: str) -> dict[str, Any]:
    containers = one(objects, "Deployment", deployment_suffix)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


# --- lint and schema validation of every rendered object -----------------------------------------


@pytest.mark.parametrize("value_set", SETS)
def test_lint_is_clean(value_set: str) -> None:
    report = helm_python.lint(str(CHART), VALUE_SETS[value_set], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); nothing at warning (2) or error (3).
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("value_set", SETS)
def test_every_object_validates_strictly(value_set: str, kube_version: str) -> None:
    objects = render(value_set)
    assert objects
    for r in objects:
        key = (r.obj["apiVersion"], r.kind)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an unknown-field warning is a failure here
            if key in CUSTOM_KINDS:
                # Honest about the limit: no schema ships for CRDs, so the validator cannot judge them.
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(r.obj, kube_version, strict=True)
                continue
            try:
                kubernetes_validate.validate(r.obj, kube_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{r.template}: {r.kind}/{r.name} is invalid on Kubernetes {kube_version}: {exc}")


@pytest.mark.parametrize("value_set", SETS)
def test_names_and_namespaces(value_set: str) -> None:
    objects = render(value_set)
    cluster_scoped = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"}
    seen: set[tuple[str, str | None, str]] = set()
    for r in objects:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", r.name) and len(r.name) <= 63, r.name
        namespace = r.obj["metadata"].get("namespace")
        assert (namespace is None) == (r.kind in cluster_scoped), f"{r.kind}/{r.name} namespace {namespace}"
        key = (r.kind, namespace, r.name)
        assert key not in seen, f"rendered twice: {key}"
        seen.add(key)
        labels = r.obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"


def test_crds_are_identical_to_the_generated_ones() -> None:
    generated = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    packaged = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert generated, "no generated CRDs in crds/ (run `kvpilot crd --write`)"
    assert packaged == generated, "charts/kvpilot/crds/ must hold exactly the files of crds/"
    for name in generated:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), (
            f"charts/kvpilot/crds/{name} differs from crds/{name}: cp crds/*.yaml charts/kvpilot/crds/"
        )


# --- the restricted Pod Security Standard ---------------------------------------------------------


def test_restricted_checker_catches_a_privileged_pod() -> None:
    bad = {
        "hostNetwork": True,
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [{"name": "c", "securityContext": {"privileged": True, "runAsUser": 0}}],
    }
    problems = restricted_violations(bad)
    for expected in (
        "hostNetwork",
        "hostPath",
        "runAsNonRoot",
        "runAsUser",
        "allowPrivilegeEscalation",
        "privileged",
        "capabilities",
        "seccompProfile",
        "readOnlyRootFilesystem",
    ):
        assert any(expected in p for p in problems), expected


@pytest.mark.parametrize("value_set", SETS)
def test_pods_fit_the_restricted_pod_security_standard(value_set: str) -> None:
    pods = _pod_specs(render(value_set))
    assert pods
    for name, pod in pods:
        assert restricted_violations(pod) == [], name
        # The read-only root needs a writable /tmp (HOME and MPLCONFIGDIR point there in the image).
        mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts, name
        assert pod["securityContext"]["runAsUser"] == 65532  # the image's USER (test_dockerfile.py)


@pytest.mark.parametrize("value_set", SETS)
def test_containers_have_resources(value_set: str) -> None:
    for name, pod in _pod_specs(render(value_set)):
        for c in pod["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], name
            assert c["resources"]["limits"]["memory"], name


# --- the operator ---------------------------------------------------------------------------------


def _flag(args: list[str], name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]


def test_operator_probes_hit_healthz_on_its_metrics_port() -> None:
    objects = render("default")
    c = _container(objects, "-operator")
    port = int(_flag(c["args"], "metrics-port")[0])
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert named[get["port"]] == port
    service = one(objects, "Service", "-operator")
    assert service["spec"]["ports"][0]["targetPort"] == "http-metrics"


def test_operator_watches_all_namespaces_by_default_and_runs_twins_from_its_own_image() -> None:
    c = _container(render("default"), "-operator")
    assert c["args"][0] == "operator"
    assert "--all-namespaces" in c["args"] and not _flag(c["args"], "namespace")
    assert _flag(c["args"], "twin-image") == [c["image"]]
    assert c["image"] == "ghcr.io/kvpilot/kvpilot:0.1.0"  # the tag defaults to appVersion


def test_operator_watches_listed_namespaces() -> None:
    c = _container(render("namespaces-operator-only"), "-operator")
    assert "--all-namespaces" not in c["args"]
    assert _flag(c["args"], "namespace") == ["team-a", "team-b"]
    tuner = _container(render("namespace-scoped"), "-tuner")
    assert _flag(tuner["args"], "namespace") == ["team-a"]


def test_tuner_refuses_several_namespaces_with_a_clear_message() -> None:
    with pytest.raises(helm_python.HelmError, match="the tuner watches one namespace or all of them"):
        render({"watch": {"allNamespaces": False, "namespaces": ["a", "b"]}})


def test_watching_no_listed_namespace_means_the_release_namespace() -> None:
    c = _container(render({"watch": {"allNamespaces": False}}), "-operator")
    assert _flag(c["args"], "namespace") == [NAMESPACE]


def test_image_digest_pins_every_container() -> None:
    objects = render("monitoring")
    digest = VALUE_SETS["monitoring"]["image"]["digest"]
    for _, pod in _pod_specs(objects):
        for c in pod["containers"]:
            assert c["image"].endswith("@" + digest)
    assert _flag(_container(objects, "-operator")["args"], "twin-image")[0].endswith("@" + digest)


def test_chart_args_parse_with_the_real_cli() -> None:
    """The operator and tuner command lines the chart writes are accepted by `kvpilot` itself."""
    from kvpilot.cli import build_parser

    parser = build_parser()
    for value_set in ("default", "namespace-scoped", "namespaces-operator-only", "postgresql", "multi-tenant", "sweep"):
        objects = render(value_set)
        for _, pod in _pod_specs(objects):
            for c in pod["containers"]:
                args = list(c["args"])
                try:
                    parsed = parser.parse_args(args)
                    if "--metrics-port" in " ".join(args) and hasattr(parsed, "metrics_port"):
                        # The port the chart's Service and probes point at is the one the process opens.
                        assert str(parsed.metrics_port) in {str(p["containerPort"]) for p in c["ports"]}
                except (SystemExit, argparse.ArgumentError):
                    pytest.fail(f"`kvpilot {' '.join(args)}` is rejected by the CLI ({value_set})")
                assert callable(parsed.handler)


def test_operator_monitor_labels_reach_the_operator_as_flags_it_accepts() -> None:
    """operator.monitorLabels (kube-prometheus-stack's release label) become --monitor-label flags the
    real CLI parses into the operator's labels; without the value there is no flag."""
    from kvpilot.cli import build_parser

    assert _flag(_container(render("default"), "-operator")["args"], "monitor-label") == []
    args = _container(render({"operator": {"monitorLabels": {"release": "kps", "team": "a"}}}), "-operator")["args"]
    assert sorted(_flag(args, "monitor-label")) == ["release=kps", "team=a"]
    assert sorted(build_parser().parse_args(args).monitor_label) == [("release", "kps"), ("team", "a")]


# --- the tuner ------------------------------------------------------------------------------------


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container.get("env", [])}


def test_tuner_keeps_sqlite_on_a_kept_pvc_by_default() -> None:
    objects = render("default")
    c = _container(objects, "-tuner")
    url = _env(c)["KVPILOT_TUNER_STORAGE"]["value"]
    assert url.startswith("sqlite:////")
    pvc = one(objects, "PersistentVolumeClaim", "-tuner")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pod = one(objects, "Deployment", "-tuner")["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (volume,) = claims
    assert claims[volume] == pvc["metadata"]["name"]
    # The database file lives on the claim's mount.
    assert url.removeprefix("sqlite:///").startswith(mount[volume] + "/")
    # A RWO volume: the old pod must be gone before the new one mounts it.
    assert one(objects, "Deployment", "-tuner")["spec"]["strategy"]["type"] == "Recreate"


def test_tuner_existing_claim_is_used_and_none_is_created() -> None:
    objects = render({"tuner": {"storage": {"sqlite": {"existingClaim": "my-studies"}}}})
    assert find(objects, "PersistentVolumeClaim") == []
    pod = one(objects, "Deployment", "-tuner")["spec"]["template"]["spec"]
    assert {"name": "studies", "persistentVolumeClaim": {"claimName": "my-studies"}} in pod["volumes"]


def test_tuner_postgresql_url_comes_from_the_secret() -> None:
    objects = render("postgresql")
    assert find(objects, "PersistentVolumeClaim") == []
    c = _container(objects, "-tuner")
    ref = _env(c)["KVPILOT_TUNER_STORAGE"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "kvpilot-optuna-db", "key": "url"}
    # Not even as $(KVPILOT_TUNER_STORAGE): the kubelet would expand it into the command line.
    assert [a for a in c["args"] if "storage" in a.lower() or "$(" in a] == []


def test_tuner_off_leaves_no_tuner_objects() -> None:
    objects = render("operator-only")
    assert [r.name for r in objects if r.name.endswith("-tuner")] == []
    assert find(objects, "ConfigMap") == []


def test_tuner_reads_the_configured_prometheus() -> None:
    c = _container(render({"tuner": {"prometheusUrl": "http://prom.example:9090"}}), "-tuner")
    assert _flag(c["args"], "prometheus") == ["http://prom.example:9090"]


# --- RBAC shape (what is granted is in test_chart_rbac.py) ----------------------------------------


def test_cluster_scope_binds_cluster_roles_to_the_service_accounts() -> None:
    objects = render("default")
    # The one Role is leader election's, in the release namespace (test_chart_rbac.py).
    assert [r["metadata"]["name"] for r in find(objects, "Role") + find(objects, "RoleBinding")] == \
        [f"{FULLNAME}-operator-leader-election"] * 2
    for component in ("operator", "tuner"):
        binding = one(objects, "ClusterRoleBinding", f"-{component}")
        assert binding["roleRef"]["name"] == one(objects, "ClusterRole", f"-{component}")["metadata"]["name"]
        sa = one(objects, "ServiceAccount", f"-{component}")["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
        pod = one(objects, "Deployment", f"-{component}")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == sa


def test_namespace_scope_grants_roles_in_each_watched_namespace_only() -> None:
    objects = render("namespaces-operator-only")
    # Watching namespaces by exact name the operator reads nothing cluster-scoped (kopf's
    # scanning is off): no ClusterRole, no ClusterRoleBinding.
    assert find(objects, "ClusterRole") == [] and find(objects, "ClusterRoleBinding") == []
    for component in ("operator",):
        roles = find(objects, "Role", f"-{component}")
        bindings = find(objects, "RoleBinding", f"-{component}")
        assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
        assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
        for b in bindings:
            assert b["subjects"][0]["namespace"] == NAMESPACE  # the ServiceAccount stays home


# --- values: schema and documentation -------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"tuner": {"enabled": "yes"}}, "/tuner/enabled"),
        ({"operator": {"metricsPort": "8080"}}, "/operator/metricsPort"),
        ({"watch": {"namespaces": "team-a"}}, "/watch/namespaces"),
        ({"rbac": {"scope": "cluster-wide"}}, "/rbac/scope"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"tuner": {"storage": {"type": "mysql"}}}, "/tuner/storage/type"),
        ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ],
    ids=["bool", "port", "list", "scope", "pullPolicy", "storage", "root-uid"],
)
def test_schema_rejects_wrong_types_and_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as excinfo:
        validate_values(values)
    assert where in str(excinfo.value)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"replicaCount": 2}, "replicaCount"),
        ({"operator": {"replica": 2}}, "replica"),
        ({"tuner": {"storage": {"sqlite": {"sise": "1Gi"}}}}, "sise"),
        ({"monitoring": {"serviceMonitor": {"enable": True}}}, "enable"),
    ],
    ids=["top", "operator", "deep", "typo"],
)
def test_schema_rejects_unknown_keys(values: dict[str, Any], key: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as excinfo:
        validate_values(values)
    assert f"additional properties '{key}' not allowed" in str(excinfo.value)


def test_render_refuses_bad_values_with_a_message_naming_the_field() -> None:
    with pytest.raises(helm_python.HelmValuesError, match="/tuner/enabled"):
        render({"tuner": {"enabled": "yes"}})
    with pytest.raises(helm_python.HelmError, match="watch.allNamespaces=false"):
        render({"rbac": {"scope": "namespace"}})
    with pytest.raises(helm_python.HelmValuesError, match="existingSecret"):
        render({"tuner": {"storage": {"type": "postgresql"}}})


def test_schema_accepts_every_value_set() -> None:
    for values in VALUE_SETS.values():
        validate_values(values)


def test_schema_closes_every_object() -> None:
    """additionalProperties: false on every object with declared properties (draft-07)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if "properties" in node:
                assert node.get("additionalProperties") is False, f"{path or '/'} is open to unknown keys"
            for key, child in node.items():
                # if/then/else only add conditions to an object already declared (and closed).
                if key not in ("if", "then", "else"):
                    walk(child, f"{path}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")

    walk(schema, "")


def _value_keys(node: Any, prefix: str = "") -> list[str]:
    keys = []
    if isinstance(node, dict):
        for key, child in node.items():
            keys.append(f"{prefix}{key}")
            keys.extend(_value_keys(child, f"{prefix}{key}."))
    return keys


def test_every_value_is_commented_and_declared_in_the_schema() -> None:
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[A-Za-z_][\w.-]*:", line):
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#"), f"values.yaml line {i + 1} ({line.strip()}) has no comment above it"
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load(text)
    for dotted in _value_keys(values):
        node = schema
        for part in dotted.split("."):
            props = node.get("properties", {})
            if part not in props:
                # A free-form map (labels, nodeSelector...) declares its values, not its keys.
                assert "additionalProperties" in node and node["additionalProperties"] is not False, dotted
                break
            node = props[part]


# --- Grafana dashboard ----------------------------------------------------------------------------


def test_dashboard_configmap_carries_the_checked_in_json() -> None:
    objects = render("default")
    cm = one(objects, "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    checked_in = (CHART / "dashboards" / "kvpilot.json").read_text()
    assert json.loads(cm["data"]["kvpilot.json"]) == json.loads(checked_in)


def test_checked_in_dashboard_is_the_generated_one(tmp_path: Path) -> None:
    """charts/kvpilot/dashboards/kvpilot.json is `kvpilot slo dashboard --all`, not a hand-edited copy."""
    from kvpilot.cli import main

    out = tmp_path / "kvpilot.json"
    assert main(["slo", "dashboard", "--all", "-o", str(out)]) == 0
    checked_in = CHART / "dashboards" / "kvpilot.json"
    assert checked_in.read_text() == out.read_text(), (
        "the chart's dashboard is stale: kvpilot slo dashboard --all > charts/kvpilot/dashboards/kvpilot.json"
    )


def test_dashboard_namespace_is_configurable() -> None:
    cm = one(render({"grafana": {"dashboard": {"namespace": "monitoring"}}}), "ConfigMap", "-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"


# --- Prometheus Operator objects (structure; promtool checks the rules themselves) ----------------


def test_monitoring_objects_are_off_by_default_and_on_when_asked() -> None:
    assert find(render("default"), "ServiceMonitor") == [] and find(render("default"), "PrometheusRule") == []
    objects = render("monitoring")
    sm = one(objects, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The ServiceMonitor selects the operator's and the tuner's Services and scrapes their named port.
    selector = sm["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    for component in ("operator", "tuner"):
        service = one(objects, "Service", f"-{component}")
        labels = service["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert expression["operator"] == "In" and labels[expression["key"]] in expression["values"]
        assert sm["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    # The webhook's Service (component webhook) is not scraped: it serves no /metrics.
    webhook = one(objects, "Service", "-webhook")["metadata"]["labels"]
    assert webhook[expression["key"]] not in expression["values"]
    scraped = [s for s in find(render("operator-only"), "Service") if not s["metadata"]["name"].endswith("-webhook")]
    assert [s["metadata"]["name"][-9:] for s in scraped] == ["-operator"]
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    rule = one(objects, "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"KvpilotOperatorDown", "KvpilotReconcileErrors", "KvpilotRollback", "KvpilotOperatorNoLeader"}
    for g in rule["spec"]["groups"]:
        for r in g["rules"]:
            assert r["labels"]["severity"] in ("critical", "warning")
            assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_operator_down_alert_needs_the_service_monitor_it_keys_on() -> None:
    rule = one(render({"monitoring": {"prometheusRule": {"enabled": True}}}), "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"KvpilotReconcileErrors", "KvpilotRollback", "KvpilotOperatorNoLeader"}


def test_notes_render() -> None:
    from harness.chart import render_raw

    notes = render_raw({})["kvpilot/templates/NOTES.txt"]
    assert f"deployment/{FULLNAME}-operator" in notes
    assert "kubectl get kvis -w" in notes
