"""`kvpilot check` (the chart's `helm test` hook) as a real process against real HTTP servers on 127.0.0.1:
one plays the operator's /healthz, one the API server's discovery (reached through a kubeconfig)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "check-test-token"  # noqa: S105 - a throwaway server on 127.0.0.1


class Server:
    """Answers each path with the (status, JSON body) in `routes`; records the Authorization headers."""

    def __init__(self, routes: dict[str, tuple[int, Any]]) -> None:
        self.routes = routes
        self.auth: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                server.auth.append(self.headers.get("Authorization", ""))
                status, body = server.routes.get(self.path, (404, {"kind": "Status", "code": 404}))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


DISCOVERY = {"kind": "APIResourceList", "groupVersion": "kvpilot.dev/v1alpha1",
             "resources": [{"name": "inferenceservices", "kind": "InferenceService", "namespaced": True},
                           {"name": "inferenceservices/status", "kind": "InferenceService", "namespaced": True}]}


@pytest.fixture
def api() -> Iterator[Server]:
    with Server({"/apis/kvpilot.dev/v1alpha1": (200, DISCOVERY)}) as server:
        yield server


@pytest.fixture
def operator() -> Iterator[Server]:
    with Server({"/healthz": (200, "ok")}) as server:
        yield server


def check(tmp_path: Path, api_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": api_url}}],
        "users": [{"name": "t", "user": {"token": TOKEN}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvpilot.cli", "check", *args], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)


def test_both_checks_pass_one_line_each(tmp_path: Path, api: Server, operator: Server) -> None:
    result = check(tmp_path, api.url, f"--operator-url={operator.url}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"ok: operator {operator.url}/healthz: HTTP 200",
        "ok: inferenceservices.kvpilot.dev/v1alpha1 served: GET /apis/kvpilot.dev/v1alpha1 lists inferenceservices"]
    assert api.auth == [f"Bearer {TOKEN}"]  # the kubeconfig's credentials, as in a pod its ServiceAccount's


def test_an_unhealthy_operator_fails(tmp_path: Path, api: Server, operator: Server) -> None:
    operator.routes["/healthz"] = (503, "kopf not watching")
    result = check(tmp_path, api.url, f"--operator-url={operator.url}/")
    assert result.returncode == 1
    assert result.stdout.splitlines()[0].startswith(f"FAILED: operator {operator.url}/healthz: HTTP 503")
    assert result.stdout.splitlines()[1].startswith("ok: inferenceservices")


def test_an_unreachable_operator_fails(tmp_path: Path, api: Server) -> None:
    from harness.kmock_api import free_port

    url = f"http://127.0.0.1:{free_port()}"
    result = check(tmp_path, api.url, f"--operator-url={url}")
    assert result.returncode == 1
    assert result.stdout.startswith(f"FAILED: operator {url}/healthz: unreachable:")


@pytest.mark.parametrize(("status", "body", "expected"), [
    (404, {"kind": "Status", "code": 404}, "GET /apis/kvpilot.dev/v1alpha1: HTTP 404"),
    (200, {"kind": "APIResourceList", "resources": [{"name": "other"}]},
     "GET /apis/kvpilot.dev/v1alpha1 does not list inferenceservices (served: ['other'])"),
], ids=["group-not-served", "resource-missing"])
def test_a_crd_that_is_not_served_fails(tmp_path: Path, operator: Server, status: int, body: Any,
                                        expected: str) -> None:
    with Server({"/apis/kvpilot.dev/v1alpha1": (status, body)}) as api:
        result = check(tmp_path, api.url, f"--operator-url={operator.url}")
    assert result.returncode == 1
    assert result.stdout.splitlines()[1] == f"FAILED: inferenceservices.kvpilot.dev/v1alpha1 served: {expected}"


@pytest.mark.parametrize("url", ["kvpilot-operator:8080", "ftp://host/x", "http://"])
def test_a_bad_operator_url_is_refused_naming_the_flag(tmp_path: Path, api: Server, url: str) -> None:
    result = check(tmp_path, api.url, f"--operator-url={url}")
    assert result.returncode == 2
    assert "--operator-url: must be an http:// or https:// URL with a host" in result.stderr


def test_no_credentials_is_one_line_after_the_healthz_result(tmp_path: Path, operator: Server) -> None:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "missing"), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "kvpilot.cli", "check", f"--operator-url={operator.url}"],
                            capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.startswith("ok: operator")
    assert result.stderr.startswith("kvpilot check: cannot read Kubernetes credentials:")
