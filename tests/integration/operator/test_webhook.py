"""The validating admission webhook over real HTTPS: the server bound on 127.0.0.1 (a free port),
a throwaway CA and serving certificate from trustme, clients that verify them, AdmissionReview
admission.k8s.io/v1 bodies as the API server sends them.  One test runs it inside a real
`kvpilot operator` process (against KMock), as the chart deploys it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kvpilot.api.vocabulary import WEBHOOK_PATH
from kvpilot.operator.reviews import MAX_REVIEW_VALUES, Reviewer
from kvpilot.operator.webhook import MAX_REVIEW_BYTES, WebhookServer

trustme = pytest.importorskip("trustme", reason="trustme is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
FULL = yaml.safe_load((ROOT / "examples" / "full.yaml").read_text())


@dataclass
class Pki:
    ca: Any
    cert_file: Path
    key_file: Path

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


def _issue(ca: Any, directory: Path) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key_file.write_bytes(cert.private_key_pem.bytes())
    return cert_file, key_file


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    ca = trustme.CA()
    cert_file, key_file = _issue(ca, tmp_path_factory.mktemp("webhook-tls"))
    return Pki(ca, cert_file, key_file)


@dataclass
class StubPrediction:
    failure: str | None = None
    warnings: Sequence[str] = field(default_factory=list)


@asynccontextmanager
async def serving(pki: Pki, reviewer: Reviewer | None = None, **kwargs: Any) -> AsyncIterator[WebhookServer]:
    server = WebhookServer(reviewer or Reviewer(), cert_file=pki.cert_file, key_file=pki.key_file,
                           host="127.0.0.1", port=0, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def url(server: WebhookServer) -> str:
    return f"https://127.0.0.1:{server.bound_port}{WEBHOOK_PATH}"


def review(obj: Any, operation: str = "CREATE", old: Any = None, **request: Any) -> dict[str, Any]:
    meta = obj.get("metadata", {}) if isinstance(obj, dict) else {}
    req: dict[str, Any] = {
        "uid": str(uuid.uuid4()),
        "kind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"},
        "resource": {"group": "kvpilot.dev", "version": "v1alpha1", "resource": "inferenceservices"},
        "requestKind": {"group": "kvpilot.dev", "version": "v1alpha1", "kind": "InferenceService"},
        "requestResource": {"group": "kvpilot.dev", "version": "v1alpha1", "resource": "inferenceservices"},
        "name": meta.get("name", ""), "namespace": meta.get("namespace", "inference"),
        "operation": operation,
        "userInfo": {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]},
        "object": obj, "oldObject": old, "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": f"{operation.title()}Options"},
    }
    req.update(request)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def with_engine(**engine: Any) -> dict[str, Any]:
    obj = copy.deepcopy(FULL)
    obj["spec"]["engine"].update(engine)
    if 0.95 < engine.get("gpuMemoryUtilization", 0) < 1:  # keep it inside the tuning space (a rule of its own)
        obj["spec"]["tuning"]["space"]["gpuMemoryUtilization"] = [0.7, max(0.95, engine["gpuMemoryUtilization"])]
    return obj


async def post(session: aiohttp.ClientSession, server: WebhookServer, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with session.post(url(server), data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, json.loads(await resp.read())


def run_with(pki: Pki, scenario: Callable[[aiohttp.ClientSession, WebhookServer], Any],
             reviewer: Reviewer | None = None, **kwargs: Any) -> Any:
    async def main() -> Any:
        async with serving(pki, reviewer, **kwargs) as server, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=pki.client_context())) as session:
            return await scenario(session, server)

    return asyncio.run(main())


def response_of(status: int, answer: dict[str, Any], sent: dict[str, Any]) -> dict[str, Any]:
    assert status == 200, answer
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == sent["request"]["uid"]
    return dict(answer["response"])


# --- CREATE and UPDATE ----------------------------------------------------------------------------


def test_create_of_a_valid_service_is_allowed(pki: Pki) -> None:
    minimal = yaml.safe_load((ROOT / "examples" / "minimal.yaml").read_text())
    # generateName: validating admission runs after the API server has generated the name.
    generated = {**FULL, "metadata": {"generateName": "llama-", "name": "llama-x7k2p", "namespace": "inference"}}
    sent = [review(FULL), review(minimal), review(generated)]

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> list[Any]:
        return [await post(session, server, s) for s in sent]

    for s, (status, answer) in zip(sent, run_with(pki, scenario), strict=True):
        assert response_of(status, answer, s) == {"uid": s["request"]["uid"], "allowed": True}


def test_create_of_an_invalid_service_is_denied_naming_the_field(pki: Pki) -> None:
    bad = with_engine(gpuMemoryUtilization=1.5)
    bad["spec"]["replicas"] = "2"
    typo = copy.deepcopy(FULL)
    typo["spec"]["engine"]["maxNumSeq"] = 8
    sent = [review(bad), review(typo)]

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> list[Any]:
        return [await post(session, server, s) for s in sent]

    (s1, a1), (s2, a2) = run_with(pki, scenario)
    r1 = response_of(s1, a1, sent[0])
    assert r1["allowed"] is False
    status = r1["status"]
    assert (status["code"], status["reason"], status["status"]) == (422, "Invalid", "Failure")
    assert status["message"].startswith('InferenceService.kvpilot.dev "llama-8b-chat" is invalid: [')
    assert "spec.engine.gpuMemoryUtilization: Input should be less than 1" in status["message"]
    assert "spec.replicas: Input should be a valid integer (got '2')" in status["message"]
    assert {c["field"] for c in status["details"]["causes"]} == {"spec.engine.gpuMemoryUtilization",
                                                                   "spec.replicas"}
    r2 = response_of(s2, a2, sent[1])
    assert r2["allowed"] is False
    assert "spec.engine.maxNumSeq: unknown field; allowed here:" in r2["status"]["message"]
    assert "maxNumSeqs" in r2["status"]["message"]


def test_update_is_checked_when_the_spec_changes_and_never_blocks_metadata_only_writes(pki: Pki) -> None:
    good, bad = FULL, with_engine(maxNumBatchedTokens=-1)
    relabelled = copy.deepcopy(bad)
    relabelled["metadata"]["finalizers"] = []
    deleting = copy.deepcopy(bad)
    deleting["metadata"]["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    deleting["spec"]["replicas"] = 3
    cases = [
        (review(bad, "UPDATE", old=good), False),  # a spec change to an invalid engine
        (review(with_engine(maxNumSeqs=128), "UPDATE", old=good), True),  # a valid change
        (review(relabelled, "UPDATE", old=bad), True),  # metadata only, on an object admitted before the webhook
        (review(deleting, "UPDATE", old=bad), True),  # a deletion in progress (finalizers coming off)
        (review(None, "DELETE", old=bad), True),
        (review(bad, "UPDATE", old=good, subResource="status"), True),
    ]

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> list[Any]:
        return [await post(session, server, sent) for sent, _ in cases]

    for (sent, allowed), (status, answer) in zip(cases, run_with(pki, scenario), strict=True):
        response = response_of(status, answer, sent)
        assert response["allowed"] is allowed, (sent["request"]["operation"], response)
    first = run_with(pki, lambda s, srv: post(s, srv, cases[0][0]))[1]["response"]
    assert "spec.engine.maxNumBatchedTokens" in first["status"]["message"]


def test_warnings_come_back_on_an_allowed_review(pki: Pki) -> None:
    seen: list[Any] = []

    def predict(service: Any) -> StubPrediction:
        seen.append(service)
        return StubPrediction(warnings=["spec.engine.gpuMemoryUtilization 0.97 is above 0.95: little\nheadroom",
                                        "x" * 400])

    sent = review(with_engine(gpuMemoryUtilization=0.97))
    status, answer = run_with(pki, lambda s, srv: post(s, srv, sent), Reviewer(predictor=predict))
    response = response_of(status, answer, sent)
    assert response["allowed"] is True
    # One line each (the API server sends them in a Warning header), at most 256 characters.
    assert response["warnings"] == ["spec.engine.gpuMemoryUtilization 0.97 is above 0.95: little headroom",
                                    "x" * 253 + "..."]
    assert seen[0].spec.engine.gpu_memory_utilization == 0.97  # the typed object reached the predictor


def test_a_predicted_start_up_failure_is_denied_in_vllms_words(pki: Pki) -> None:
    failure = ("ValueError: To serve at least one request with the models's max seq len (8192), (1.0 GiB KV "
               "cache is needed, which is larger than the available KV cache memory (0.5 GiB).")
    sent = review(FULL)
    status, answer = run_with(pki, lambda s, srv: post(s, srv, sent),
                              Reviewer(predictor=lambda _svc: StubPrediction(failure=failure)))
    response = response_of(status, answer, sent)
    assert response["allowed"] is False
    assert (response["status"]["code"], response["status"]["reason"]) == (422, "Invalid")
    assert response["status"]["message"] == (
        f'InferenceService.kvpilot.dev "llama-8b-chat" is invalid: spec.engine: vLLM would refuse to start '
        f'this engine: {failure}')
    assert response["status"]["details"]["causes"] == [{
        "reason": "FieldValueInvalid", "field": "spec.engine",
        "message": f"vLLM would refuse to start this engine: {failure}"}]


def test_an_invalid_service_never_reaches_the_predictor(pki: Pki) -> None:
    def predict(_svc: Any) -> StubPrediction:
        raise AssertionError("predicted an invalid service")

    sent = review(with_engine(blockSize=7))
    status, answer = run_with(pki, lambda s, srv: post(s, srv, sent), Reviewer(predictor=predict))
    assert response_of(status, answer, sent)["allowed"] is False


# --- the operator's predictor: the twin's start-up prediction (kvpilot.twin.admission) -------------


def on_gpu(obj: dict[str, Any], gpu: str = "NVIDIA-H100-80GB-HBM3", **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["spec"]["resources"]["gpuType"] = gpu
    obj["spec"].update(spec)
    return obj


def test_the_operators_predictor_denies_an_engine_vllm_would_refuse_in_vllms_words(pki: Pki) -> None:
    from kvpilot.api.validation import strict_validate
    from kvpilot.cli import twin_predictor as predictor
    from kvpilot.twin.admission import predict

    too_big = on_gpu(FULL, model="meta-llama/Llama-3.1-70B-Instruct")  # 140 GB of weights on one 80 GB GPU
    failure = predict(strict_validate(too_big)).failure
    assert failure
    sent = review(too_big)
    status, answer = run_with(pki, lambda s, srv: post(s, srv, sent), Reviewer(predictor=predictor()))
    response = response_of(status, answer, sent)
    assert response["allowed"] is False
    assert (response["status"]["code"], response["status"]["reason"]) == (422, "Invalid")
    assert response["status"]["message"].endswith(f"vLLM would refuse to start this engine: {' '.join(failure.split())}")


def test_the_operators_predictor_warns_about_risky_but_legal_engines(pki: Pki) -> None:
    from kvpilot.api.validation import strict_validate
    from kvpilot.cli import twin_predictor as predictor
    from kvpilot.twin.admission import predict

    crowded = on_gpu(with_engine(maxNumSeqs=1024))
    crowded["spec"]["tuning"]["enabled"] = False
    cases = {
        "utilization": on_gpu(with_engine(gpuMemoryUtilization=0.97)),
        "kv cache": crowded,
        "fine": on_gpu(FULL),
        "not predicted (no gpuType)": FULL,
    }
    sent = {name: review(obj) for name, obj in cases.items()}

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> dict[str, Any]:
        return {name: response_of(*await post(session, server, s), s) for name, s in sent.items()}

    responses = run_with(pki, scenario, Reviewer(predictor=predictor()))
    assert all(r["allowed"] for r in responses.values())
    assert responses["utilization"]["warnings"] == list(predict(strict_validate(cases["utilization"])).warnings)
    assert "gpuMemoryUtilization 0.97 is above 0.95" in responses["utilization"]["warnings"][0]
    (kv,) = responses["kv cache"]["warnings"]
    assert "fewer than engine.maxNumSeqs 1024" in kv
    assert "warnings" not in responses["fine"] and "warnings" not in responses["not predicted (no gpuType)"]


# --- malformed reviews: a 400-class answer, never a crash or a hang --------------------------------


def _good() -> dict[str, Any]:
    return review(FULL)


def _without(path: str) -> dict[str, Any]:
    sent = _good()
    node: Any = sent
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    del node[last]
    return sent


def _with(path: str, value: Any) -> dict[str, Any]:
    sent = _good()
    node: Any = sent
    *parents, last = path.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return sent


MALFORMED: list[tuple[str, Any, str]] = [
    ("empty body", b"", "not JSON"),
    ("not JSON", b"apiVersion: admission.k8s.io/v1\n", "not JSON"),
    ("truncated JSON", json.dumps(_good()).encode()[:-5], "not JSON"),
    ("not UTF-8", b'{"apiVersion": "\xff\xfe"}', "not JSON: invalid unicode code point"),
    ("NaN", b'{"apiVersion": NaN}', "not JSON: expected value at line 1 column 16"),
    ("nested too deeply", b"[" * 100_000 + b"]" * 100_000, "not JSON: recursion limit exceeded"),
    ("trailing garbage", json.dumps(_good()).encode() + b" {}", "not JSON: trailing characters"),
    ("a JSON array", b"[]", "must be a JSON object (got an array)"),
    ("JSON null", b"null", "must be a JSON object (got null)"),
    ("v1beta1", _with("apiVersion", "admission.k8s.io/v1beta1"), "apiVersion must be admission.k8s.io/v1"),
    ("no apiVersion", _without("apiVersion"), "apiVersion must be admission.k8s.io/v1 (got None)"),
    ("another kind", _with("kind", "TokenReview"), "kind must be AdmissionReview (got 'TokenReview')"),
    ("no request", _without("request"), "request must be an object (got missing)"),
    ("request not a mapping", _with("request", ["uid"]), "request must be an object (got an array)"),
    ("no uid", _without("request.uid"), "request.uid must be a non-empty string (got None)"),
    ("empty uid", _with("request.uid", ""), "request.uid must be a non-empty string"),
    ("numeric uid", _with("request.uid", 7), "request.uid must be a non-empty string (got 7)"),
    ("no operation", _without("request.operation"), "request.operation must be one of CREATE, UPDATE"),
    ("unknown operation", _with("request.operation", "PATCH"), "(got 'PATCH')"),
    ("no request.kind", _without("request.kind"), "request.kind must be an object (got missing)"),
    ("another resource", _with("request.kind", {"group": "", "version": "v1", "kind": "Pod"}),
     "reviews kvpilot.dev InferenceService objects only"),
    ("another plural", _with("request.resource", {"group": "kvpilot.dev", "version": "v1alpha1",
                                                  "resource": "pods"}), "reviews inferenceservices only"),
    ("no object", _without("request.object"), "request.object must be an object (got missing)"),
    ("object a list", _with("request.object", [FULL]), "request.object must be an object (got an array)"),
    ("object null", _with("request.object", None), "request.object must be an object (got null)"),
    ("object a string", _with("request.object", json.dumps(FULL)), "request.object must be an object (got a string)"),
    ("update without oldObject", {**_good(), "request": {**_good()["request"], "operation": "UPDATE"}},
     "request.oldObject must be an object (got null)"),
]


@pytest.mark.parametrize(("body", "complaint"), [(b, c) for _, b, c in MALFORMED], ids=[i for i, _, _ in MALFORMED])
def test_a_malformed_review_gets_400_saying_why_and_the_server_goes_on(
        pki: Pki, body: Any, complaint: str) -> None:
    good = _good()

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        return await post(session, server, body), await post(session, server, good)

    (status, answer), after = run_with(pki, scenario)
    assert status == 400, answer
    assert (answer["kind"], answer["apiVersion"], answer["code"], answer["reason"]) == (
        "Status", "v1", 400, "BadRequest")
    assert answer["message"].startswith("malformed AdmissionReview: ")
    assert complaint in answer["message"], answer["message"]
    assert response_of(*after, good)["allowed"] is True  # the same keep-alive connection still serves


def test_wrong_method_and_path_are_refused(pki: Pki) -> None:
    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        async with session.get(url(server)) as get:
            got = get.status
        async with session.post(url(server).replace(WEBHOOK_PATH, "/mutate"), data=b"{}") as wrong:
            return got, wrong.status

    assert run_with(pki, scenario) == (405, 404)


def _raw_tls(pki: Pki, port: int, timeout: float = 10.0) -> ssl.SSLSocket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return pki.client_context().wrap_socket(sock, server_hostname="127.0.0.1")


def _read_response(tls: ssl.SSLSocket) -> tuple[int, dict[str, Any]]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = tls.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        chunk = tls.recv(65536)
        assert chunk, "connection closed inside the response body"
        rest += chunk
    return int(lines[0].split()[1]), json.loads(rest[:length])


def test_a_huge_body_is_refused_with_413_before_it_is_read(pki: Pki) -> None:
    async def scenario(_session: aiohttp.ClientSession, server: WebhookServer) -> tuple[int, dict[str, Any]]:
        def client() -> tuple[int, dict[str, Any]]:
            with _raw_tls(pki, server.bound_port) as tls:
                tls.sendall(f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {MAX_REVIEW_BYTES + 1}\r\n\r\n".encode() + b"{" * 4096)
                return _read_response(tls)

        return await asyncio.to_thread(client)

    status, answer = run_with(pki, scenario)
    assert (status, answer["code"], answer["reason"]) == (413, 413, "RequestEntityTooLarge")
    assert f"more than the {MAX_REVIEW_BYTES} allowed" in answer["message"]


def test_a_huge_chunked_body_is_refused_with_413(pki: Pki) -> None:
    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(MAX_REVIEW_BYTES // (1 << 20) + 1):
                yield b" " * (1 << 20)

        try:
            async with session.post(url(server), data=chunks()) as resp:
                return resp.status, json.loads(await resp.read())
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            return "closed", str(exc)

    status, answer = run_with(pki, scenario)
    # The server stops reading past the limit and closes: the client sees the 413 or, if it was still
    # writing its last chunk when the connection closed, the close itself.  Never a wait.
    assert status in (413, "closed"), answer
    if status == 413:
        assert answer["reason"] == "RequestEntityTooLarge"


def test_a_review_sent_in_chunks_is_read_whole(pki: Pki) -> None:
    sent = _good()
    data = json.dumps(sent).encode()

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 100):
                yield data[i:i + 100]

        async with session.post(url(server), data=chunks()) as resp:  # Transfer-Encoding: chunked
            return resp.status, json.loads(await resp.read())

    assert response_of(*run_with(pki, scenario), sent)["allowed"] is True


def test_a_body_that_never_arrives_is_answered_408_not_held(pki: Pki) -> None:
    async def scenario(_session: aiohttp.ClientSession, server: WebhookServer) -> tuple[int, dict[str, Any]]:
        def client() -> tuple[int, dict[str, Any]]:
            with _raw_tls(pki, server.bound_port) as tls:
                tls.sendall(f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            "Content-Length: 1000\r\n\r\n{".encode())
                return _read_response(tls)

        return await asyncio.to_thread(client)

    status, answer = run_with(pki, scenario, read_timeout_seconds=0.3)
    assert (status, answer["reason"]) == (408, "Timeout")
    assert "did not arrive within 0.3 s" in answer["message"]


def test_a_client_that_does_not_trust_the_ca_is_refused_the_handshake(pki: Pki) -> None:
    async def scenario(_session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        async with aiohttp.ClientSession() as plain:  # the system's trust store only
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await plain.post(url(server), data=b"{}")

    run_with(pki, scenario)


def test_a_renewed_certificate_is_served_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    first = trustme.CA()
    cert_file, key_file = _issue(first, tmp_path)
    own = Pki(first, cert_file, key_file)
    renewed_ca = trustme.CA()

    async def main() -> None:
        async with serving(own, reload_seconds=3600) as server:
            trusting_renewed = Pki(renewed_ca, cert_file, key_file).client_context()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=own.client_context())) as s:
                assert (await post(s, server, _good()))[0] == 200
            assert not server.reload_certificates()  # nothing changed
            key_file.write_text("half-written")  # a renewal caught midway keeps the old certificate
            assert not server.reload_certificates()
            _issue(renewed_ca, tmp_path)
            assert server.reload_certificates()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trusting_renewed)) as s:
                assert (await post(s, server, _good()))[0] == 200
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=own.client_context())) as s:
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await post(s, server, _good())

    asyncio.run(main())


def test_a_predictor_that_raises_fails_open_with_a_warning_and_validation_still_holds(pki: Pki) -> None:
    def broken(_svc: Any) -> StubPrediction:
        raise ZeroDivisionError("bug")

    good, bad = review(FULL), review(with_engine(maxNumSeqs=0))

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        return await post(session, server, good), await post(session, server, bad)

    a_good, a_bad = run_with(pki, scenario, Reviewer(predictor=broken))
    response = response_of(*a_good, good)
    assert response["allowed"] is True
    assert response["warnings"] == ["start-up not predicted: the prediction failed (ZeroDivisionError: bug)"]
    assert response_of(*a_bad, bad)["allowed"] is False


# --- inside the operator process --------------------------------------------------------------------


@pytest.fixture
def kmock_api() -> Iterator[Any]:
    from harness.kmock_api import KMockAPI

    with KMockAPI() as server:
        yield server


def test_the_operator_process_serves_the_webhook_and_counts_its_answers(
        pki: Pki, kmock_api: Any, tmp_path: Path) -> None:
    from harness.kmock_api import free_port, kopf_operator

    port = free_port()
    with kopf_operator(kmock_api, tmp_path, "--webhook-port", str(port), "--webhook-host", "127.0.0.1",
                       "--webhook-cert-file", str(pki.cert_file), "--webhook-key-file", str(pki.key_file)) as op:
        async def main() -> Any:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=pki.client_context())) as s:
                target = f"https://127.0.0.1:{port}{WEBHOOK_PATH}"
                out = []
                too_big = on_gpu(FULL, model="meta-llama/Llama-3.1-70B-Instruct")
                for body in (review(FULL), review(with_engine(maxNumSeqs=0)), b"[]", review(too_big)):
                    data = body if isinstance(body, bytes) else json.dumps(body).encode()
                    async with s.post(target, data=data) as resp:
                        out.append((resp.status, json.loads(await resp.read())))
                return out

        (s1, a1), (s2, a2), (s3, _), (s4, a4) = asyncio.run(main())
        assert (s1, a1["response"]["allowed"]) == (200, True)
        assert (s2, a2["response"]["allowed"]) == (200, False)
        assert s3 == 400
        # The process wires the twin's prediction in.
        assert (s4, a4["response"]["allowed"]) == (200, False)
        assert "vLLM would refuse to start this engine" in a4["response"]["status"]["message"]
        status, metrics = op.http_get("/metrics")
        assert status == 200
        for result, count in (("allowed", 1), ("invalid", 1), ("bad_review", 1), ("predicted_failure", 1),
                              ("warned", 0)):
            assert f'kvpilot_admission_reviews_total{{result="{result}"}} {count}.0' in metrics, result
        assert "admission webhook on https://127.0.0.1:" in op.log()


# --- abuse: every connection, body and review bounded ----------------------------------------------


def _closed_by_server(sock: socket.socket | ssl.SSLSocket) -> bool:
    """True once the server closes `sock` (recv returns nothing or the connection is reset); the
    socket's own timeout is the deadline, far past the server's."""
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_an_idle_or_half_sent_connection_is_closed_after_the_idle_timeout(pki: Pki) -> None:
    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        def clients() -> tuple[bool, bool, bool]:
            with _raw_tls(pki, server.bound_port) as idle, _raw_tls(pki, server.bound_port) as loris, \
                    socket.create_connection(("127.0.0.1", server.bound_port), timeout=10) as no_tls:
                loris.sendall(f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ".encode())
                return _closed_by_server(idle), _closed_by_server(loris), _closed_by_server(no_tls)

        closed = await asyncio.to_thread(clients)
        return closed, await post(session, server, good)  # the server goes on

    good = _good()
    (idle, loris, no_handshake), answered = run_with(
        pki, scenario, idle_timeout_seconds=0.3, handshake_timeout_seconds=0.3)
    assert (idle, loris, no_handshake) == (True, True, True)
    assert response_of(*answered, good)["allowed"] is True


def _wait_for(predicate: Callable[[], bool], seconds: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_connections_past_the_cap_wait_for_a_free_slot(pki: Pki) -> None:
    body = json.dumps(_good()).encode()

    async def scenario(_session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        def clients() -> tuple[int, int, tuple[int, dict[str, Any]]]:
            import concurrent.futures

            first, second = _raw_tls(pki, server.bound_port), _raw_tls(pki, server.bound_port)
            _wait_for(lambda: server.open_connections == 2)

            def third() -> tuple[int, dict[str, Any]]:
                with _raw_tls(pki, server.bound_port) as tls:
                    tls.sendall(f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
                    return _read_response(tls)

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(third)
                with pytest.raises(concurrent.futures.TimeoutError):
                    waiting.result(timeout=0.5)  # not accepted while two are open
                at_cap = server.open_connections
                first.close()
                answer = waiting.result(timeout=10)
            second.close()
            return at_cap, server.max_connections, answer

        return await asyncio.to_thread(clients)

    at_cap, cap, (status, answer) = run_with(pki, scenario, max_connections=2)
    assert at_cap == cap == 2
    assert status == 200 and answer["response"]["allowed"] is True


def _lists(size: int) -> bytes:
    """A review whose spec holds `size` bytes of empty lists: cheap to send, millions of objects to build."""
    head, tail = json.dumps(_good()).encode().split(b'"spec": {', 1)
    filler = b"[]," * (size // 3)
    return head + b'"spec": {"x": [' + filler + b'[]], ' + tail


def test_reviews_of_millions_of_values_are_refused_without_building_them_while_others_are_answered(pki: Pki) -> None:
    import time

    hostile = _lists(MAX_REVIEW_BYTES - 4096)
    assert len(hostile) <= MAX_REVIEW_BYTES
    good = _good()

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        cpu = time.process_time()
        answers = await asyncio.gather(*(post(session, server, hostile) for _ in range(4)),
                                       post(session, server, good))
        return answers, time.process_time() - cpu

    answers, cpu_s = run_with(pki, scenario)
    for status, answer in answers[:4]:
        assert (status, answer["reason"]) == (413, "RequestEntityTooLarge"), answer
        assert f"more than the {MAX_REVIEW_VALUES} allowed" in answer["message"]
    assert response_of(*answers[4], good)["allowed"] is True
    # Client and server together, four 8 MiB reviews sent over TLS and refused: the issue's bound per
    # hostile request is 2 CPU-s; parsing them used 0.5-1.5 CPU-s each.
    assert cpu_s < 2.0, f"{cpu_s:.2f} CPU-s"


def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data, compresslevel=6, mtime=0)


async def _post_encoded(session: aiohttp.ClientSession, server: WebhookServer, data: bytes,
                        encoding: str) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    async with session.post(url(server), data=data, headers=headers) as resp:
        return resp.status, json.loads(await resp.read())


def test_a_compressed_review_is_inflated_whole_and_one_that_inflates_past_the_limit_gets_413(pki: Pki) -> None:
    import zlib

    large = _good()  # ~3 MiB inflated: an UPDATE of a 1.5 MiB object comes near that
    large["request"]["object"]["metadata"]["annotations"] = {"example.com/notes": "n" * (3 << 20)}
    plain = json.dumps(large).encode()
    bomb = _gzip(b" " * (MAX_REVIEW_BYTES + 1))  # ~8 KiB that inflates past the limit
    cut = _gzip(plain)[:-100]

    async def scenario(session: aiohttp.ClientSession, server: WebhookServer) -> Any:
        return [await _post_encoded(session, server, data, encoding) for data, encoding in (
            (_gzip(plain), "gzip"), (zlib.compress(plain), "deflate"), (bomb, "gzip"), (cut, "gzip"),
            (plain, "br"))] + [await post(session, server, _good())]

    (s_gzip, a_gzip), (s_deflate, a_deflate), (s_bomb, a_bomb), (s_cut, a_cut), (s_br, a_br), after = run_with(
        pki, scenario)
    assert response_of(s_gzip, a_gzip, large)["allowed"] is True
    assert response_of(s_deflate, a_deflate, large)["allowed"] is True
    assert (s_bomb, a_bomb["reason"]) == (413, "RequestEntityTooLarge")
    assert f"inflates to more than the {MAX_REVIEW_BYTES} bytes allowed" in a_bomb["message"]
    assert s_cut == 400 and "gzip body is cut short" in a_cut["message"]
    assert (s_br, a_br["reason"]) == (415, "UnsupportedMediaType")
    assert "allowed: deflate, gzip, identity" in a_br["message"]
    assert after[0] == 200


@pytest.mark.parametrize(("bound", "complaint"), [
    ({"max_connections": 0}, r"max_connections must be at least 1 \(got 0\)"),
    ({"idle_timeout_seconds": 0}, r"idle_timeout_seconds must be a positive number of seconds \(got 0\)"),
    ({"handshake_timeout_seconds": -1}, r"handshake_timeout_seconds must be a positive number of seconds \(got -1\)"),
])
def test_bounds_that_would_bound_nothing_are_refused_naming_the_field(pki: Pki, bound: dict[str, Any],
                                                                      complaint: str) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match=complaint):
            async with serving(pki, **bound):
                pass

    asyncio.run(main())
