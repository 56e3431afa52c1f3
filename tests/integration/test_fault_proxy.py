"""harness/fault_proxy.py against a real TLS upstream on 127.0.0.1: it passes calls through unchanged
(streamed), refuses them during a burst with Kubernetes Status bodies in a seeded order, and answers 502
while the upstream is down; the chaos run's API-error faults rest on each of these."""

from __future__ import annotations

import json
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme

from harness.fault_proxy import FAULT_STATUSES, FaultProxy

pytestmark = pytest.mark.integration


class Upstream:
    """A TLS server that echoes the method, path and Authorization header, and streams /stream in chunks."""

    def __init__(self, ca: trustme.CA) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(3):
                        line = json.dumps({"type": "ADDED", "n": i}).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                body = json.dumps({"method": "GET", "path": self.path,
                                   "auth": self.headers.get("Authorization")}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(context)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    upstream_ca, proxy_ca = trustme.CA(), trustme.CA()
    upstream_ca.cert_pem.write_to_path(str(tmp_path / "upstream-ca.crt"))
    cert = proxy_ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "proxy.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "proxy.key"))
    client = ssl.create_default_context()
    proxy_ca.configure_trust(client)
    return {"upstream_ca": upstream_ca, "client": client, "dir": tmp_path}


@pytest.fixture
def upstream(pki: dict[str, Any]) -> Iterator[Upstream]:
    server = Upstream(pki["upstream_ca"])
    yield server
    server.stop()


def proxy_for(upstream_url: str, pki: dict[str, Any], seed: int) -> FaultProxy:
    d = pki["dir"]
    return FaultProxy(upstream_url, d / "upstream-ca.crt", d / "proxy.crt", d / "proxy.key", seed=seed)


def call(proxy: FaultProxy, pki: dict[str, Any], path: str) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(proxy.url + path, headers={"Authorization": "Bearer t0ken"})
    try:
        with urllib.request.urlopen(req, timeout=10, context=pki["client"]) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_calls_pass_through_unchanged_and_streams_stream(upstream: Upstream, pki: dict[str, Any]) -> None:
    with proxy_for(upstream.url, pki, seed=1) as proxy:
        status, _, body = call(proxy, pki, "/api/v1/pods?watch=0")
        assert status == 200
        assert json.loads(body) == {"method": "GET", "path": "/api/v1/pods?watch=0", "auth": "Bearer t0ken"}
        status, _, body = call(proxy, pki, "/stream")
        assert status == 200 and [json.loads(line)["n"] for line in body.splitlines()] == [0, 1, 2]
        assert proxy.stats() == {"forwarded": 2, "injected": {}}


def test_a_burst_refuses_calls_with_status_bodies_in_the_seeds_order(upstream: Upstream, pki: dict[str, Any]) -> None:
    sequences = []
    for _ in range(2):
        with proxy_for(upstream.url, pki, seed=5) as proxy:
            proxy.burst(600, 1.0)
            answers = [call(proxy, pki, "/api/v1/pods") for _ in range(12)]
            proxy.burst(0, 0.0)  # over
            assert call(proxy, pki, "/api/v1/pods")[0] == 200
            codes = [status for status, _, _ in answers]
            assert set(codes) <= set(FAULT_STATUSES) and len(set(codes)) > 1
            for status, headers, body in answers:
                payload = json.loads(body)
                assert (payload["kind"], payload["code"], payload["status"]) == ("Status", status, "Failure")
                assert (headers.get("Retry-After") == "1") == (status == 429)
            assert proxy.stats()["forwarded"] == 1 and sum(proxy.stats()["injected"].values()) == 12
            sequences.append(codes)
    assert sequences[0] == sequences[1]


def test_an_upstream_that_is_down_is_a_bad_gateway(upstream: Upstream, pki: dict[str, Any]) -> None:
    url = upstream.url
    upstream.stop()
    with proxy_for(url, pki, seed=1) as proxy:
        status, _, body = call(proxy, pki, "/api/v1/pods")
    assert status == 502 and json.loads(body)["reason"] == "BadGateway"
