"""Render the kvpilot Helm chart offline (helm-python-sdk bundles Helm's own engine).

The value sets the chart tests run against live here, so every test can iterate the same
ones: the defaults and the shapes a real installation takes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvpilot"
RELEASE = "kvp"
NAMESPACE = "kvpilot-system"

VALUE_SETS: dict[str, dict[str, Any]] = {
    # What `helm install kvpilot charts/kvpilot` gets.
    "default": {},
    # A team that may only touch its own namespaces: Roles instead of a ClusterRole.
    "namespace-scoped": {
        "rbac": {"scope": "namespace"},
        "watch": {"allNamespaces": False, "namespaces": ["team-a"]},
    },
    # Several namespaces, operator only (`kvpilot tuner` watches one namespace or all).
    "namespaces-operator-only": {
        "rbac": {"scope": "namespace"},
        "watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]},
        "tuner": {"enabled": False},
    },
    # A shared / HA Optuna study in PostgreSQL; no PVC.
    "postgresql": {
        "tuner": {"storage": {"type": "postgresql", "postgresql": {"existingSecret": "kvpilot-optuna-db"}}},
    },
    # A cluster with the Prometheus Operator: ServiceMonitor and PrometheusRule on.
    "monitoring": {
        "monitoring": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        },
        "image": {"digest": "sha256:" + "ab" * 32},
    },
    # A shared cluster (docs/multi-tenant.md): an image allowlist, vLLM as a non-root uid,
    # NetworkPolicies, the study in PostgreSQL reached through an extra egress rule.
    "multi-tenant": {
        "rbac": {"scope": "namespace"},
        "watch": {"allNamespaces": False, "namespaces": ["team-a"]},
        "operator": {"allowedImages": ["docker.io/vllm/vllm-openai:*", "registry.example.com/ml/*"],
                     "engineRunAsUser": 1001},
        "tuner": {"storage": {"type": "postgresql", "postgresql": {"existingSecret": "kvpilot-optuna-db"}}},
        "networkPolicy": {
            "enabled": True,
            "apiServer": {"cidrs": ["10.0.0.1/32"], "ports": [6443]},
            "webhook": {"sourceCidrs": ["10.0.0.0/24"]},
            "tuner": {"extraEgress": [{"to": [{"ipBlock": {"cidr": "10.0.5.7/32"}}],
                                       "ports": [{"port": 5432, "protocol": "TCP"}]}]},
            "engine": {"clients": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]},
        },
    },
    # The admission webhook's certificate from cert-manager (a ClusterIssuer of the cluster's), and
    # Fail as its failurePolicy.
    "webhook-cert-manager": {
        "webhook": {"failurePolicy": "Fail", "timeoutSeconds": 3,
                    "certManager": {"enabled": True, "issuerRef": {"name": "cluster-ca", "kind": "ClusterIssuer"}}},
    },
    # An offline sweep as a Job (`kvpilot tune --offline --join` in 3 pods) on the tuner's PostgreSQL study.
    "sweep": {
        "tuner": {"storage": {"type": "postgresql", "postgresql": {"existingSecret": "kvpilot-optuna-db"}}},
        "sweep": {"enabled": True, "parallelism": 3, "trials": 45, "studyName": "llama-h100-chat",
                  "args": ["--model=Llama-3.1-8B", "--gpu=H100-80GB", "--workload=chat", "--slo=ttft=0.5,itl=0.05"]},
    },
    # Operator only: no tuner Deployment, no tuner RBAC, no PVC, no dashboard.
    "operator-only": {
        "tuner": {"enabled": False},
        "grafana": {"dashboard": {"enabled": False}},
    },
}


@dataclass(frozen=True)
class Rendered:
    """One rendered manifest: the template it came from and the object."""

    template: str
    obj: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj["kind"])

    @property
    def name(self) -> str:
        return str(self.obj["metadata"]["name"])


def _load_chart() -> Any:
    import helm_python

    return helm_python.Chart.load(str(CHART))


def render_raw(values: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it."""
    chart = _load_chart()
    try:
        return dict(chart.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE))
    finally:
        chart.close()


@cache
def _render_named(name: str) -> tuple[Rendered, ...]:
    return tuple(_objects(render_raw(VALUE_SETS[name])))


def render(values: Mapping[str, Any] | str | None = None) -> list[Rendered]:
    """Rendered objects (CRDs from crds/ are not templates and are not included)."""
    if isinstance(values, str):
        return [Rendered(r.template, copy.deepcopy(r.obj)) for r in _render_named(values)]
    return list(_objects(render_raw(values)))


def _objects(raw: Mapping[str, str]) -> Iterator[Rendered]:
    for template, text in sorted(raw.items()):
        if not template.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        for obj in yaml.safe_load_all(text):
            if obj:
                yield Rendered(template, obj)


def find(objects: list[Rendered], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    return [r.obj for r in objects if r.kind == kind and r.name.endswith(name_suffix)]


def one(objects: list[Rendered], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = find(objects, kind, name_suffix)
    assert len(found) == 1, (
        f"expected one {kind} *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def merged(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The chart's defaults with `overrides` on top, as an install would use them."""
    chart = _load_chart()
    try:
        return dict(chart.merge_values(dict(overrides)))
    finally:
        chart.close()


def validate_values(values: Mapping[str, Any]) -> None:
    """Raise helm_python.HelmValuesError when values.schema.json rejects `values`."""
    chart = _load_chart()
    try:
        chart.validate_schema(dict(values))
    finally:
        chart.close()


def local_operator_args(chart_args: list[str], workdir: Path) -> list[str]:
    """The chart's operator arguments (after the subcommand), runnable as a local process: no
    --metrics-port (the harness picks a free one), and the admission webhook on a free port with a
    throwaway certificate written to `workdir` in place of the Secret the pod mounts."""
    import trustme

    from harness.kmock_api import free_port

    cert = trustme.CA().issue_cert("127.0.0.1")
    cert_file, key_file = workdir / "webhook-tls.crt", workdir / "webhook-tls.key"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    local = {"--webhook-port": str(free_port()), "--webhook-cert-file": str(cert_file),
             "--webhook-key-file": str(key_file)}
    args = []
    for arg in chart_args:
        flag = arg.split("=", 1)[0]
        if flag == "--metrics-port":
            continue
        args.append(f"{flag}={local[flag]}" if flag in local else arg)
    return args
