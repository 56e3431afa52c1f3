from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.kmock_api import free_port
from kvpilot.cli import build_parser, main
from kvpilot.operator import rbac

ROOT = Path(__file__).resolve().parents[3]


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_operator_help_names_every_option() -> None:
    code, out, _ = run(["operator", "--help"])
    assert code == 0
    for option in ("--namespace", "--all-namespaces", "--twin-image", "--metrics-port", "--log-format",
                   "--max-workers", "--crash-loop-restarts", "--allowed-image", "--engine-run-as-user", "--monitor-label",
                   "--webhook-port", "--webhook-host", "--webhook-cert-file", "--webhook-key-file"):
        assert option in out


@pytest.mark.parametrize(("argv", "complaint"), [
    (["operator", "--metrics-port", "70000"], "must be a port number 1-65535"),
    (["operator", "--log-format", "xml"], "invalid choice"),
    (["operator", "--crash-loop-restarts", "0"], "--crash-loop-restarts: must be a whole number >= 1 (got 0)"),
    (["operator", "-n", "a", "--all-namespaces"], "not allowed with argument"),
    (["render"], "required: -f/--filename"),
    (["operator", "--engine-run-as-user", "0"], "must be a non-root numeric user id"),
    (["operator", "--engine-run-as-user", "vllm"], "must be a numeric user id"),
    (["operator", "--allowed-image", "vllm/*"], "allowed image pattern 'vllm/*' must start with a registry host"),
    (["operator", "--monitor-label", "release"], "--monitor-label: must be KEY=VALUE"),
    (["operator", "--monitor-label", "bad key=x"], "label key 'bad key': the name must be 1-63 characters"),
    (["operator", "--monitor-label", "Example.com/x=y"], "the prefix before '/' must be a DNS subdomain"),
    (["render", "-f", "x.yaml", "--monitor-label", "release=" + "v" * 64], "at most 63 characters"),
])
def test_bad_options_are_refused_with_a_reason(argv: list[str], complaint: str) -> None:
    code, _, err = run(argv)
    assert code == 2
    assert complaint in err
    assert "Traceback" not in err


def test_settings_from_arguments() -> None:
    args = build_parser().parse_args(["operator", "-n", "a", "-n", "b", "--metrics-port", "9100"])
    assert (args.namespace, args.all_namespaces, args.metrics_port, args.log_format) == (["a", "b"], False, 9100, "text")


def test_a_bad_allowed_image_pattern_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.api.vocabulary import ENV_ALLOWED_IMAGES

    monkeypatch.setenv(ENV_ALLOWED_IMAGES, "docker.io/vllm/*,ubuntu")
    code, _, err = run(["operator"])
    assert code == 2
    assert "'ubuntu' must start with a registry host" in err and "Traceback" not in err


def test_rbac_rules_are_well_formed() -> None:
    rules = rbac.cluster_role_rules()
    assert {"apiGroups": ["apps"], "resources": ["deployments"],
            "verbs": ["get", "list", "watch", "create", "patch", "delete"]} in rules
    assert rbac.allows("kvpilot.dev", "inferenceservices/status", "patch")
    assert not rbac.allows("", "secrets", "get")  # the HF token is mounted by the kubelet, never read


@pytest.mark.parametrize(("flags", "scanning_off", "cluster_scoped"), [
    ({"all_namespaces": True}, False, {("apiextensions.k8s.io", "customresourcedefinitions")}),
    ({"namespaces": ("team-a", "team-b")}, True, set()),
    ({}, True, set()),  # "default"
    ({"namespaces": ("team-*",)}, False, {("apiextensions.k8s.io", "customresourcedefinitions"),
                                          ("", "namespaces")}),
    ({"namespaces": ("team-a", "!team-b,team-c")}, False, {("apiextensions.k8s.io", "customresourcedefinitions"),
                                                           ("", "namespaces")}),
])
def test_scanning_is_off_for_exact_namespaces_and_rbac_follows(flags: dict[str, Any], scanning_off: bool,
                                                               cluster_scoped: set[tuple[str, str]]) -> None:
    import kopf

    from kvpilot.operator.handlers import configure_kopf
    from kvpilot.operator.settings import OperatorSettings

    settings = OperatorSettings(**flags)
    kopf_settings = kopf.OperatorSettings()
    configure_kopf(kopf_settings, exact_namespaces=settings.exact_namespaces)
    assert kopf_settings.scanning.disabled is scanning_off
    rules = rbac.rules_for(all_namespaces=settings.all_namespaces, namespaces=settings.watched_namespaces)
    namespaced = {(g, r) for rule in rbac.RULES for g in rule.api_groups for r in rule.resources}
    extra = {(g, r) for rule in rules for g in rule.api_groups for r in rule.resources} - namespaced
    assert extra == cluster_scoped


def _operator_process(tmp_path: Path, kubeconfig: str, port: int) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, KUBECONFIG=kubeconfig, HOME=str(tmp_path))
    return subprocess.run([sys.executable, "-m", "kvpilot.cli", "operator", "-A", "--metrics-port", str(port)],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)


def test_operator_without_credentials_exits_with_the_reason(tmp_path: Path) -> None:
    done = _operator_process(tmp_path, str(tmp_path / "missing-kubeconfig"), free_port())
    assert done.returncode == 1
    assert "cannot read Kubernetes credentials" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


def test_operator_with_its_metrics_port_taken_exits_with_the_reason(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        done = _operator_process(tmp_path, str(kubeconfig), taken.getsockname()[1])
    assert done.returncode == 1
    assert "address already in use" in done.stderr.lower()
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize(("argv", "env", "complaint"), [
    (["operator", "--webhook-port", "9443"], {}, "--webhook-port needs --webhook-cert-file and --webhook-key-file"),
    (["operator", "--webhook-port", "9443", "--webhook-cert-file", "tls.crt"], {}, "needs --webhook-key-file ("),
    (["operator"], {"KVPILOT_WEBHOOK_PORT": "9443", "KVPILOT_WEBHOOK_CERT_FILE": "tls.crt"},
     "--webhook-port needs --webhook-key-file"),
    (["operator"], {"KVPILOT_WEBHOOK_PORT": "https"}, "$KVPILOT_WEBHOOK_PORT must be a port number 1-65535"),
    (["operator", "--webhook-port", "0"], {}, "must be a port number 1-65535 (got 0)"),
])
def test_webhook_options_are_refused_with_a_reason(
        monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], complaint: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, _, err = run(argv)
    assert code == 2
    assert complaint in err, err
    assert "Traceback" not in err


def test_webhook_settings_come_from_flags_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpilot.operator.commands import _webhook_options

    parser = build_parser()
    assert _webhook_options(parser.parse_args(["operator"]))["webhook_port"] is None  # no webhook by default
    flags = parser.parse_args(["operator", "--webhook-port", "9443", "--webhook-cert-file", "/tls/tls.crt",
                               "--webhook-key-file", "/tls/tls.key", "--webhook-host", "127.0.0.1"])
    assert _webhook_options(flags) == {"webhook_port": 9443, "webhook_host": "127.0.0.1",
                                       "webhook_cert_file": "/tls/tls.crt", "webhook_key_file": "/tls/tls.key"}
    monkeypatch.setenv("KVPILOT_WEBHOOK_PORT", "8443")
    monkeypatch.setenv("KVPILOT_WEBHOOK_CERT_FILE", "/env/tls.crt")
    monkeypatch.setenv("KVPILOT_WEBHOOK_KEY_FILE", "/env/tls.key")
    from_env = _webhook_options(parser.parse_args(["operator"]))
    assert (from_env["webhook_port"], from_env["webhook_cert_file"], from_env["webhook_key_file"]) == (
        8443, "/env/tls.crt", "/env/tls.key")
    assert _webhook_options(flags)["webhook_port"] == 9443  # a flag wins over the environment


def test_a_webhook_certificate_that_cannot_be_read_fails_the_start_plainly(tmp_path: Path) -> None:
    """The webhook starts before kopf touches the cluster: a missing certificate is exit 1 and one line."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "operator", "--metrics-port", str(free_port()),
         "--webhook-port", str(free_port()), "--webhook-cert-file", str(tmp_path / "missing.crt"),
         "--webhook-key-file", str(tmp_path / "missing.key")],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    assert "kvpilot operator:" in proc.stderr and "No such file" in proc.stderr
    assert "Traceback" not in proc.stderr
