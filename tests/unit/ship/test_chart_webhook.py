"""The chart's admission webhook objects (webhook.*): the ValidatingWebhookConfiguration, its Service,
its certificate (a CA Helm generates, or cert-manager's) and how the operator's pod serves it.
Every rendered object is also validated strictly for Kubernetes 1.30 and 1.33 by test_chart.py
(the webhook is on by default and in the webhook-cert-manager value set).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from pathlib import Path
from typing import Any

import pytest

from harness.chart import (
    NAMESPACE,
    VALUE_SETS,
    Rendered,
    find,
    one,
    render,
    render_raw,
    validate_values,
)
from kvpilot.api.vocabulary import WEBHOOK_PATH

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed (trustme's dependency)")

SERVICE = "kvp-kvpilot-webhook"
SECRET = "kvp-kvpilot-webhook-tls"


def _operator(objects: list[Rendered]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = one(objects, "Deployment", "-operator")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _flag(args: list[str], name: str) -> str | None:
    found = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(found) <= 1
    return found[0] if found else None


def _webhook(objects: list[Rendered]) -> dict[str, Any]:
    (hook,) = one(objects, "ValidatingWebhookConfiguration")["webhooks"]
    return dict(hook)


def test_the_webhook_is_configured_as_kubernetes_asks() -> None:
    hook = _webhook(render("default"))
    assert hook["name"] == "validate.inferenceservices.kvpilot.dev"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["sideEffects"] == "None"
    # Fail: an operator that is down or starved never admits anything unchecked (two replicas serve it).
    assert (hook["failurePolicy"], hook["timeoutSeconds"], hook["matchPolicy"]) == ("Fail", 5, "Equivalent")
    assert hook["rules"] == [{"apiGroups": ["kvpilot.dev"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["inferenceservices"], "scope": "Namespaced"}]
    # The operator's own namespace is never reviewed (nor blocked).
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]}]}


def test_the_api_server_reaches_the_operators_webhook_port_through_the_service() -> None:
    objects = render("default")
    service = one(objects, "Service", "-webhook")
    client = _webhook(objects)["clientConfig"]["service"]
    assert (client["name"], client["namespace"], client["path"]) == (SERVICE, NAMESPACE, WEBHOOK_PATH)
    (port,) = service["spec"]["ports"]
    assert client["port"] == port["port"] == 443
    pod, container = _operator(objects)
    assert service["spec"]["selector"].items() <= one(objects, "Deployment", "-operator")[
        "spec"]["template"]["metadata"]["labels"].items()
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named[port["targetPort"]] == int(_flag(container["args"], "webhook-port") or 0) == 9443
    # The certificate files the operator reads are the mounted Secret's.
    mount = next(m for m in container["volumeMounts"] if m["name"] == "webhook-tls")
    volume = next(v for v in pod["volumes"] if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == SECRET and mount["readOnly"] is True
    for flag, key in (("webhook-cert-file", "tls.crt"), ("webhook-key-file", "tls.key")):
        assert _flag(container["args"], flag) == f"{mount['mountPath']}/{key}"


def _secret_files(objects: list[Rendered]) -> dict[str, bytes]:
    secret = one(objects, "Secret", "-webhook-tls")
    assert secret["metadata"]["name"] == SECRET and secret["type"] == "kubernetes.io/tls"
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


def test_helm_generates_a_ca_whose_bundle_verifies_the_serving_certificate_for_the_service_name() -> None:
    objects = render("default")
    files = _secret_files(objects)
    bundle = base64.b64decode(_webhook(objects)["clientConfig"]["caBundle"])
    assert bundle == files["ca.crt"]
    ca = x509.load_pem_x509_certificate(bundle)
    cert = x509.load_pem_x509_certificate(files["tls.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert f"{SERVICE}.{NAMESPACE}.svc" in names  # the name the API server dials
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days >= 3649


def test_the_operator_serves_the_helm_generated_certificate_to_a_client_that_trusts_only_the_bundle(
        tmp_path: Path) -> None:
    """The Secret's files in the real webhook server; a client holding nothing but the caBundle,
    dialling the Service's DNS name as the API server does, completes the handshake and a review."""
    import aiohttp

    from kvpilot.operator.reviews import Reviewer
    from kvpilot.operator.webhook import WebhookServer

    objects = render("default")
    files = _secret_files(objects)
    (tmp_path / "tls.crt").write_bytes(files["tls.crt"])
    (tmp_path / "tls.key").write_bytes(files["tls.key"])
    trust = ssl.create_default_context(cadata=base64.b64decode(_webhook(objects)["clientConfig"]["caBundle"]).decode())

    async def main() -> tuple[int, dict[str, Any]]:
        server = WebhookServer(Reviewer(), cert_file=tmp_path / "tls.crt", key_file=tmp_path / "tls.key",
                               host="127.0.0.1", port=0)
        await server.start()
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as session:
                review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                          "request": {"uid": "1", "operation": "DELETE", "kind": {
                              "group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"}}}
                async with session.post(f"https://127.0.0.1:{server.bound_port}{WEBHOOK_PATH}", json=review,
                                        server_hostname=f"{SERVICE}.{NAMESPACE}.svc") as resp:
                    return resp.status, json.loads(await resp.read())
        finally:
            await server.stop()

    status, answer = asyncio.run(main())
    assert status == 200 and answer["response"] == {"uid": "1", "allowed": True}


def test_cert_manager_issues_the_certificate_and_injects_the_ca() -> None:
    objects = render("webhook-cert-manager")
    assert find(objects, "Secret") == [] and find(objects, "Issuer") == []  # the cluster's ClusterIssuer signs
    cert = one(objects, "Certificate")
    assert cert["apiVersion"] == "cert-manager.io/v1"
    assert cert["spec"]["secretName"] == SECRET
    assert f"{SERVICE}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    vwc = one(objects, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{cert['metadata']['name']}"
    hook = _webhook(objects)
    assert "caBundle" not in hook["clientConfig"]
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Fail", 3)
    pod, _ = _operator(objects)
    assert next(v for v in pod["volumes"] if v["name"] == "webhook-tls")["secret"]["secretName"] == SECRET


def test_cert_manager_without_an_issuer_gets_a_self_signed_one() -> None:
    objects = render({"webhook": {"certManager": {"enabled": True}}})
    issuer = one(objects, "Issuer")
    assert issuer["spec"] == {"selfSigned": {}}
    assert one(objects, "Certificate")["spec"]["issuerRef"] == {
        "name": issuer["metadata"]["name"], "kind": "Issuer", "group": "cert-manager.io"}


def test_watching_namespaces_reviews_only_those_never_the_release_namespace() -> None:
    hook = _webhook(render("namespace-scoped"))
    assert hook["namespaceSelector"]["matchExpressions"] == [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [NAMESPACE]},
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}]
    hook = _webhook(render({"watch": {"allNamespaces": False, "namespaces": [NAMESPACE, "team-b"]},
                            "tuner": {"enabled": False}}))
    assert hook["namespaceSelector"]["matchExpressions"][1]["values"] == ["team-b"]


@pytest.mark.parametrize("values", [
    {"webhook": {"enabled": False}},
    # Watching only the release namespace leaves the webhook nothing to review.
    {"watch": {"allNamespaces": False}},
], ids=["disabled", "only-the-release-namespace"])
def test_no_webhook_objects_args_or_ports_when_it_is_not_served(values: dict[str, Any]) -> None:
    objects = render(values)
    webhook_kinds = ("ValidatingWebhookConfiguration", "Certificate", "Issuer", "Secret")
    assert [r.kind for r in objects if r.kind in webhook_kinds] == []
    assert find(objects, "Service", "-webhook") == []
    pod, container = _operator(objects)
    assert not [a for a in container["args"] if a.startswith("--webhook-")]
    assert [p["name"] for p in container["ports"]] == ["http-metrics"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    notes = render_raw(values)["kvpilot/templates/NOTES.txt"]
    assert ("No admission webhook is installed" in notes) == ("watch" in values)


def test_notes_say_where_the_webhook_reviews() -> None:
    notes = render_raw(VALUE_SETS["namespace-scoped"])["kvpilot/templates/NOTES.txt"]
    assert "The admission webhook (failurePolicy Fail) reviews InferenceService creates and updates in team-a" in notes
    assert "one operator replica" not in notes
    one_replica = render_raw({**VALUE_SETS["namespace-scoped"], "operator": {"replicas": 1}})["kvpilot/templates/NOTES.txt"]
    assert "With failurePolicy Fail and one operator replica, every InferenceService write is refused" in one_replica


@pytest.mark.parametrize(("values", "where"), [
    ({"webhook": {"failurePolicy": "Maybe"}}, "failurePolicy"),
    ({"webhook": {"timeoutSeconds": 31}}, "timeoutSeconds"),
    ({"webhook": {"timeoutSeconds": 0}}, "timeoutSeconds"),
    ({"webhook": {"port": 70000}}, "port"),
    ({"webhook": {"certManager": {"issuerRef": {"kind": "Vault"}}}}, "kind"),
    ({"webhook": {"tls": {}}}, "tls"),
    ({"networkPolicy": {"webhook": {"sourceCidrs": ["10.0.0.1"]}}}, "sourceCidrs"),
])
def test_schema_refuses_bad_webhook_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        validate_values(values)
