"""The chart's `helm test` hook (templates/tests/check.yaml): a Pod running `kvpilot check` against the
operator's Service and the API server. tests/cluster/test_helm_cli.py runs it through the real helm CLI;
test_chart.py holds it, with every other pod, to the restricted Pod Security Standard, resources, a
writable /tmp and a command line the real CLI accepts.
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import pytest

from harness.chart import NAMESPACE, VALUE_SETS, Rendered, find, one, render

pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")


def hook(objects: list[Rendered]) -> dict[str, Any]:
    return one(objects, "Pod", "-test")


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_value_set_has_one_test_hook_that_never_restarts(value_set: str) -> None:
    objects = render(value_set)
    assert [r.name for r in objects if r.kind == "Pod"] == ["kvp-kvpilot-test"]
    pod = hook(objects)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    # A new run replaces the last one's pod; a pod that passed is not left behind.
    assert set(pod["metadata"]["annotations"]["helm.sh/hook-delete-policy"].split(",")) == {
        "before-hook-creation", "hook-succeeded"}
    assert pod["spec"]["restartPolicy"] == "Never"  # a failed check is a failed test, not a retry
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "test"


@pytest.mark.parametrize("values", [{}, {"operator": {"metricsPort": 9191}}, {"fullnameOverride": "kv"}],
                         ids=["default", "metrics-port", "fullname-override"])
def test_the_hook_asks_the_operator_service_on_its_port(values: dict[str, Any]) -> None:
    objects = render(values)
    (container,) = hook(objects)["spec"]["containers"]
    assert container["args"][0] == "check"
    (url,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--operator-url=")]
    parts = urllib.parse.urlsplit(url)
    service = one(objects, "Service", "-operator")
    assert parts.scheme == "http"
    assert parts.hostname == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert parts.port == service["spec"]["ports"][0]["port"]
    # The Service's target is the port the operator serves /healthz on.
    operator = one(objects, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"][0]
    assert f"--metrics-port={parts.port}" in operator["args"]


def test_the_hook_uses_the_operator_image_and_needs_no_rbac_of_its_own() -> None:
    objects = render({"image": {"digest": "sha256:" + "cd" * 32}, "imagePullSecrets": ["regcred"]})
    pod = hook(objects)["spec"]
    operator = one(objects, "Deployment", "-operator")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == operator["containers"][0]["image"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    # The namespace's default ServiceAccount: discovery is open to every authenticated client.
    assert "serviceAccountName" not in pod and pod["automountServiceAccountToken"] is True
    bound = {s["name"] for r in objects if r.kind in ("RoleBinding", "ClusterRoleBinding")
             for s in r.obj.get("subjects", [])}
    assert "default" not in bound


def test_with_network_policies_the_operator_admits_the_hook_on_its_metrics_port() -> None:
    objects = render("multi-tenant")
    labels = hook(objects)["metadata"]["labels"]
    policy = one(objects, "NetworkPolicy", "-operator")
    admitted = [
        rule for rule in policy["spec"]["ingress"]
        if any(set(peer.get("podSelector", {}).get("matchLabels", {}).items()) <= set(labels.items())
               and "namespaceSelector" not in peer and "podSelector" in peer for peer in rule.get("from", []))
    ]
    assert [p["port"] for rule in admitted for p in rule["ports"]] == ["http-metrics"]
    assert find(objects, "NetworkPolicy", "-webhook") == []  # the operator's own policy does the job here
