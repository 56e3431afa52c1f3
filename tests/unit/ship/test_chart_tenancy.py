"""The chart on a shared cluster: the tuner's database URL only in its environment, the operator's
image allowlist and engine uid, and the NetworkPolicies (docs/multi-tenant.md).  Every value set is
also linted and validated strictly against Kubernetes' schemas in test_chart.py."""

from __future__ import annotations

from typing import Any

import pytest

from harness.chart import NAMESPACE, VALUE_SETS, Rendered, find, one, render, validate_values
from kvpilot.api.models import InferenceService
from kvpilot.api.vocabulary import ENV_TUNER_STORAGE
from kvpilot.operator.builders import RenderOptions, build_deployment
from kvpilot.operator.builders.common import HTTP_PORT_NAME

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')")

TUNER_SETS = sorted(name for name, values in VALUE_SETS.items() if values.get("tuner", {}).get("enabled", True))
# What the kubelet would put in the variable a secretKeyRef names.
SECRET_URL = "postgresql://kvpilot:s3cret-pw@db.example:5432/optuna"


def _container(objects: list[Rendered], suffix: str) -> dict[str, Any]:
    (c,) = one(objects, "Deployment", suffix)["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _parse(args: list[str]) -> Any:
    from kvpilot.cli import build_parser

    return build_parser().parse_args(args)


# --- the tuner's storage ------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", TUNER_SETS)
def test_the_tuner_reads_its_storage_from_its_environment_and_never_from_its_command_line(value_set: str) -> None:
    from kvpilot.tuner.commands import tuner_storage

    c = _container(render(value_set), "-tuner")
    env = {e["name"]: e for e in c["env"]}
    source = env[ENV_TUNER_STORAGE]
    # $(VAR) in args is expanded by the kubelet into the process's command line: none may appear.
    assert [a for a in c["args"] if "storage" in a.lower() or "$(" in a] == []
    kubelet_env = {ENV_TUNER_STORAGE: source.get("value", SECRET_URL)}
    url = tuner_storage(_parse(c["args"]), kubelet_env)
    assert url == kubelet_env[ENV_TUNER_STORAGE]
    if VALUE_SETS[value_set].get("tuner", {}).get("storage", {}).get("type") == "postgresql":
        secret = VALUE_SETS[value_set]["tuner"]["storage"]["postgresql"]["existingSecret"]
        assert source["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "url"}
        assert "value" not in source


# --- the operator's allowlist and engine uid -----------------------------------------------------------


def test_the_operator_gets_the_allowlist_and_the_engine_uid_as_flags_its_cli_reads() -> None:
    from kvpilot.operator.images import ImageAllowlist

    args = _parse(_container(render("multi-tenant"), "-operator")["args"])
    wanted = VALUE_SETS["multi-tenant"]["operator"]
    assert ImageAllowlist.parse(args.allowed_image).patterns == tuple(wanted["allowedImages"])
    assert args.engine_run_as_user == wanted["engineRunAsUser"]
    defaults = _parse(_container(render("default"), "-operator")["args"])
    assert (defaults.allowed_image, defaults.engine_run_as_user) == ([], None)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"operator": {"allowedImages": ["vllm/*"]}}, "/operator/allowedImages/0"),
        ({"operator": {"engineRunAsUser": -1}}, "/operator/engineRunAsUser"),
        ({"networkPolicy": {"apiServer": {"cidrs": ["10.0.0.1"]}}}, "/networkPolicy/apiServer/cidrs/0"),
        ({"networkPolicy": {"engine": {"namespaces": ["Team_A"]}}}, "/networkPolicy/engine/namespaces/0"),
        ({"networkPolicy": {"enable": True}}, "enable"),
    ],
    ids=["pattern-without-registry", "negative-uid", "cidr", "namespace", "typo"],
)
def test_the_schema_refuses_bad_tenancy_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as excinfo:
        validate_values(values)
    assert where in str(excinfo.value)


# --- NetworkPolicies ------------------------------------------------------------------------------------


def _policies(objects: list[Rendered]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in find(objects, "NetworkPolicy")}


def _prometheus_peer(peers: list[dict[str, Any]]) -> bool:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}} in peers


def test_only_the_webhooks_network_policy_is_on_by_default() -> None:
    for value_set in VALUE_SETS:
        if value_set != "multi-tenant":
            names = [p["metadata"]["name"] for p in find(render(value_set), "NetworkPolicy")]
            assert names == ["kvp-kvpilot-webhook"], value_set


def test_the_webhooks_own_policy_admits_the_api_server_and_leaves_metrics_as_they_were() -> None:
    objects = render("default")
    policy = _policies(objects)[(NAMESPACE, "kvp-kvpilot-webhook")]["spec"]
    pod = one(objects, "Deployment", "-operator")["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    # Ingress only: the operator's egress is not touched (it would cut it off from the API server).
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"] == [{"ports": [{"port": "https-webhook", "protocol": "TCP"}]},
                                 {"ports": [{"port": "http-metrics", "protocol": "TCP"}]}]
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {"https-webhook", "http-metrics"} <= ports
    narrowed = render({"networkPolicy": {"webhook": {"sourceCidrs": ["10.0.0.0/24"]}}})
    (webhook, _) = _policies(narrowed)[(NAMESPACE, "kvp-kvpilot-webhook")]["spec"]["ingress"]
    assert webhook["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}}]
    # Off when asked, and when the full policies are on (the operator's own admits the webhook port).
    assert find(render({"networkPolicy": {"webhook": {"enabled": False}}}), "NetworkPolicy") == []
    assert (NAMESPACE, "kvp-kvpilot-webhook") not in _policies(render("multi-tenant"))
    # And not without a webhook (the operator watching only its own namespace serves none).
    assert find(render({"watch": {"allNamespaces": False}}), "NetworkPolicy") == []


@pytest.mark.parametrize("component", ["operator", "tuner"])
def test_a_component_admits_only_prometheus_and_helm_test_on_its_metrics_port(component: str) -> None:
    objects = render("multi-tenant")
    policy = _policies(objects)[(NAMESPACE, f"kvp-kvpilot-{component}")]["spec"]
    pod = one(objects, "Deployment", f"-{component}")["spec"]["template"]
    others = [d["spec"]["template"] for d in find(objects, "Deployment") if not d["metadata"]["name"].endswith(component)]
    selector = policy["podSelector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert all(not selector.items() <= other["metadata"]["labels"].items() for other in others)
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    rule, *webhook = policy["ingress"]
    prometheus, *hook = rule["from"]
    assert _prometheus_peer([prometheus])
    if component == "operator":
        # ... and the release's `helm test` pod, which asks the operator's /healthz; no other pod of the release.
        (peer,) = hook
        assert set(peer) == {"podSelector"}
        assert peer["podSelector"]["matchLabels"].items() <= one(objects, "Pod", "-test")["metadata"]["labels"].items()
        assert all(not peer["podSelector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for d in find(objects, "Deployment") + find(objects, "Job"))
    else:
        assert hook == []
    (port,) = rule["ports"]
    assert port["port"] in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    # The operator also admits the API server's calls to its admission webhook, from the CIDRs given.
    assert webhook == ([{"ports": [{"port": "https-webhook", "protocol": "TCP"}],
                         "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]}] if component == "operator" else [])


def test_the_webhook_port_is_open_to_any_address_without_source_cidrs() -> None:
    objects = render({"networkPolicy": {"enabled": True, "engine": {"enabled": False}}})
    _, webhook = _policies(objects)[(NAMESPACE, "kvp-kvpilot-operator")]["spec"]["ingress"]
    assert webhook == {"ports": [{"port": "https-webhook", "protocol": "TCP"}]}


def test_the_operator_may_reach_the_api_server_and_nothing_else() -> None:
    policy = _policies(render("multi-tenant"))[(NAMESPACE, "kvp-kvpilot-operator")]["spec"]
    assert policy["egress"] == [{"ports": [{"port": 6443, "protocol": "TCP"}], "to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}]}]


def test_the_tuner_may_reach_the_api_server_dns_prometheus_and_its_database() -> None:
    egress = _policies(render("multi-tenant"))[(NAMESPACE, "kvp-kvpilot-tuner")]["spec"]["egress"]
    api, dns, prometheus, database = egress
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert prometheus["ports"] == [{"port": 9090, "protocol": "TCP"}] and _prometheus_peer(prometheus["to"])
    assert database == VALUE_SETS["multi-tenant"]["networkPolicy"]["tuner"]["extraEgress"][0]


def test_the_api_server_rule_without_cidrs_allows_its_ports_to_any_address() -> None:
    objects = render({"networkPolicy": {"enabled": True, "engine": {"enabled": False}}})
    (rule,) = _policies(objects)[(NAMESPACE, "kvp-kvpilot-operator")]["spec"]["egress"]
    assert rule == {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}


@pytest.mark.parametrize("kind", ["vllm", "twin"])
def test_the_engine_policy_selects_the_pods_the_operator_renders_and_admits_clients_and_prometheus(kind: str) -> None:
    policy = _policies(render("multi-tenant"))[("team-a", "kvp-kvpilot-engines")]["spec"]
    isvc = InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "llama", "namespace": "team-a"},
        "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "engine": {"kind": kind}}})
    template = build_deployment(isvc, RenderOptions())["spec"]["template"]
    assert policy["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (rule,) = policy["ingress"]
    (port,) = rule["ports"]
    assert port["port"] == HTTP_PORT_NAME
    assert port["port"] in {p["name"] for p in template["spec"]["containers"][0]["ports"]}
    clients = VALUE_SETS["multi-tenant"]["networkPolicy"]["engine"]["clients"]
    assert rule["from"][:len(clients)] == clients and _prometheus_peer(rule["from"])
    # DNS and HTTPS (model downloads); no API server: engine pods carry no token.
    dns, https = policy["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert https == {"ports": [{"port": 443, "protocol": "TCP"}]}


def test_without_clients_the_engines_admit_their_own_namespace() -> None:
    objects = render({"watch": {"allNamespaces": False, "namespaces": ["team-b"]}, "rbac": {"scope": "namespace"},
                      "tuner": {"enabled": False}, "networkPolicy": {"enabled": True, "engine": {"egress": []}}})
    policy = _policies(objects)[("team-b", "kvp-kvpilot-engines")]["spec"]
    (rule,) = policy["ingress"]
    assert rule["from"][0] == {"podSelector": {}}
    assert len(policy["egress"]) == 1  # DNS alone


def test_watching_every_namespace_the_engine_policy_needs_its_namespaces_named() -> None:
    with pytest.raises(helm_python.HelmError, match="list them in networkPolicy.engine.namespaces"):
        render({"networkPolicy": {"enabled": True}})
    objects = render({"networkPolicy": {"enabled": True, "engine": {"namespaces": ["team-a", "team-b"]}}})
    engines = sorted(ns for ns, name in _policies(objects) if name == "kvp-kvpilot-engines")
    assert engines == ["team-a", "team-b"]
