"""An admission path that does not fail open: by default the chart runs two operator replicas with
leader election (one reconciles, both serve the webhook), the webhook's failurePolicy is Fail, a
PodDisruptionBudget keeps one replica through drains, the rolling update starts the new pod first,
and a NetworkPolicy lets the API server reach the webhook port.  The RBAC for the Lease is held
against rbac.py in test_chart_rbac.py; tests/integration/operator/test_leader_election.py runs two
replicas for real.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from harness.chart import NAMESPACE, VALUE_SETS, Rendered, find, one, render

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

FULLNAME = "kvp-kvpilot"


def _operator(objects: list[Rendered]) -> tuple[dict[str, Any], dict[str, Any]]:
    deployment = one(objects, "Deployment", "-operator")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


@pytest.mark.parametrize("kube_version", ["1.30", "1.33"])
def test_the_defaults_are_fail_two_replicas_a_pdb_and_a_webhook_policy_and_validate(kube_version: str) -> None:
    objects = render("default")
    deployment, container = _operator(objects)
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    pdb = one(objects, "PodDisruptionBudget", "-operator")
    policy = one(objects, "NetworkPolicy", "-webhook")
    assert hook["failurePolicy"] == "Fail"
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert pdb["spec"]["minAvailable"] == 1
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (pdb["spec"]["selector"]["matchLabels"], policy["spec"]["podSelector"]["matchLabels"]):
        assert selector.items() <= labels.items()
        # ... and no other component's pods (the tuner's): their budget and policy are not the operator's.
        for other in find(objects, "Deployment"):
            if other is not deployment:
                assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
    # The webhook Service sends reviews to every Ready operator pod; the port the policy opens is theirs.
    service = one(objects, "Service", "-webhook")
    assert service["spec"]["selector"].items() <= labels.items()
    assert {"port": "https-webhook", "protocol": "TCP"} in policy["spec"]["ingress"][0]["ports"]
    assert "https-webhook" in {p["name"] for p in container["ports"]}
    for obj in (deployment, pdb, policy, one(objects, "Role", "-leader-election"),
                one(objects, "RoleBinding", "-leader-election")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kubernetes_validate.validate(obj, kube_version, strict=True)


def test_every_replica_runs_with_leader_election_on_the_release_namespaces_lease() -> None:
    from kvpilot.cli import build_parser

    _, container = _operator(render("default"))
    args = container["args"]
    assert "--leader-elect" in args
    assert _flag(args, "leader-elect-resource-name") == f"{FULLNAME}-operator"
    assert _flag(args, "leader-elect-resource-namespace") == NAMESPACE
    parsed = build_parser().parse_args(args)
    assert (parsed.leader_elect_lease_duration, parsed.leader_elect_renew_deadline,
            parsed.leader_elect_retry_period) == (15, 10.0, 2.0)
    _, custom = _operator(render({"operator": {"leaderElection": {
        "leaseDurationSeconds": 30, "renewDeadlineSeconds": 20, "retryPeriodSeconds": 4}}}))
    parsed = build_parser().parse_args(custom["args"])
    assert (parsed.leader_elect_lease_duration, parsed.leader_elect_renew_deadline,
            parsed.leader_elect_retry_period) == (30, 20.0, 4.0)


def test_replicas_spread_over_nodes_unless_the_affinity_is_given() -> None:
    objects = render("default")
    deployment, _ = _operator(objects)
    pod = deployment["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    mine = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}]}}}
    deployment, _ = _operator(render({"operator": {"affinity": mine}}))
    assert deployment["spec"]["template"]["spec"]["affinity"] == mine


def test_one_replica_gets_no_pdb_that_would_block_every_drain() -> None:
    objects = render({"operator": {"replicas": 1}})
    assert _operator(objects)[0]["spec"]["replicas"] == 1
    assert find(objects, "PodDisruptionBudget") == []
    assert find(render({"operator": {"podDisruptionBudget": {"enabled": False}}}), "PodDisruptionBudget") == []
    three = render({"operator": {"replicas": 3, "podDisruptionBudget": {"minAvailable": 2}}})
    assert one(three, "PodDisruptionBudget", "-operator")["spec"]["minAvailable"] == 2


@pytest.mark.parametrize(("values", "message"), [
    ({"operator": {"podDisruptionBudget": {"minAvailable": 2}}},
     "operator.podDisruptionBudget.minAvailable must be less than operator.replicas"),
    ({"operator": {"leaderElection": {"leaseDurationSeconds": 10}}},
     "operator.leaderElection.renewDeadlineSeconds must be less than operator.leaderElection.leaseDurationSeconds"),
    ({"operator": {"leaderElection": {"retryPeriodSeconds": 9}}},
     "operator.leaderElection.renewDeadlineSeconds must be more than 1.2 x operator.leaderElection.retryPeriodSeconds"),
], ids=["pdb-blocks-drains", "deadline-past-lease", "one-try"])
def test_settings_that_would_break_the_ha_are_refused_naming_the_field(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=message):
        render(values)


@pytest.mark.parametrize(("values", "where"), [
    ({"operator": {"replicas": 0}}, "/operator/replicas"),
    ({"operator": {"leaderElection": {"leaseDurationSeconds": 1.5}}}, "/operator/leaderElection/leaseDurationSeconds"),
    ({"operator": {"podDisruptionBudget": {"minAvailable": 0}}}, "/operator/podDisruptionBudget/minAvailable"),
    ({"networkPolicy": {"webhook": {"enabled": "yes"}}}, "/networkPolicy/webhook/enabled"),
], ids=["replicas", "lease", "pdb", "policy"])
def test_the_schema_refuses_bad_ha_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        render(values)


def test_every_value_set_with_the_webhook_keeps_it_reachable() -> None:
    """Wherever the webhook is served, some NetworkPolicy (its own, or the operator's) opens its port."""
    for name, values in VALUE_SETS.items():
        objects = render(name)
        if not find(objects, "ValidatingWebhookConfiguration"):
            continue
        opened = [rule for p in find(objects, "NetworkPolicy") if p["metadata"]["namespace"] == NAMESPACE
                  for rule in p["spec"].get("ingress", [])
                  if {"port": "https-webhook", "protocol": "TCP"} in rule.get("ports", [])]
        assert len(opened) == 1, (name, values)
