"""TwinServer in-process, on the real engine, over real HTTP on 127.0.0.1: stream details, the
"model" stopping on its own, draining from the inside, and an engine that dies mid-run."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from kvpilot.twin import text
from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.server import protocol as proto
from kvpilot.twin.server.app import ServingInfo, TwinServer

MODEL = "Qwen2.5-0.5B"


def make_config() -> EngineConfig:
    return EngineConfig.resolve(resolve_model(MODEL), resolve_gpu("H100-80GB"), max_model_len=4096)


def make_server(engine: Engine | None = None) -> TwinServer:
    engine = engine or Engine(make_config())
    return TwinServer(engine, ServingInfo(served_model_name=MODEL, model=MODEL, max_model_len=4096,
                                          cache_config={"block_size": 16, "num_gpu_blocks": engine.num_gpu_blocks}))


def run_with_server(body: Callable[[TwinServer, aiohttp.ClientSession, str], Awaitable[Any]],
                    server: TwinServer | None = None) -> Any:
    async def main() -> Any:
        srv = server or make_server()
        await srv.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as session:
                return await asyncio.wait_for(body(srv, session, f"http://127.0.0.1:{srv.port}"), 30)
        finally:
            if not srv.draining:
                await srv.shutdown(0)

    return asyncio.run(main())


async def read_stream(resp: aiohttp.ClientResponse) -> list[dict | str]:
    events: list[dict | str] = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_continuous_usage_stats_count_up_on_every_chunk():
    async def body(srv, session, url):
        async with session.post(url + "/v1/completions", json={
                "prompt": "count with me", "max_tokens": 4, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return await read_stream(resp)

    events = run_with_server(body)
    assert events[-1] == "[DONE]"
    token_chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == [1, 2, 3, 4]
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    final = events[-2]
    assert isinstance(final, dict) and final["choices"] == [] and final["usage"]["completion_tokens"] == 4


def test_without_ignore_eos_the_model_stops_at_its_natural_length():
    prompt = "why is the sky blue"
    natural = text.natural_output_length(text.prompt_seed(prompt))

    async def body(srv, session, url):
        async with session.post(url + "/v1/completions",
                                json={"prompt": prompt, "max_tokens": 600}) as resp:
            return resp.status, await resp.json()

    status, reply = run_with_server(body)
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == natural
    assert len(reply["choices"][0]["text"].split()) == natural


def test_drain_lets_a_non_streaming_request_finish_and_refuses_new_ones():
    async def body(srv, session, url):
        pending = asyncio.create_task(session.post(url + "/v1/completions", json={
            "prompt": "finish me", "max_tokens": 30, "ignore_eos": True}))
        while not srv.engine_loop.tracked:  # until the request is in the engine
            await asyncio.sleep(0.005)
        shutdown = asyncio.create_task(srv.shutdown(30))
        while not srv.draining:
            await asyncio.sleep(0.001)
        async with session.get(url + "/health") as health:
            health_status = health.status
        async with session.post(url + "/v1/completions", json={"prompt": "late", "max_tokens": 1}) as late:
            late_status, late_body = late.status, await late.json()
        resp = await pending
        reply = await resp.json()
        await shutdown
        return health_status, late_status, late_body, resp.status, reply

    health, late, late_body, status, reply = run_with_server(body)
    assert health == 503
    assert late == 503 and late_body["error"]["type"] == "ServiceUnavailableError"
    assert status == 200 and reply["usage"]["completion_tokens"] == 30


def test_zero_shutdown_timeout_aborts_a_non_streaming_request_with_503():
    async def body(srv, session, url):
        pending = asyncio.create_task(session.post(url + "/v1/completions", json={
            "prompt": "abort me", "max_tokens": 3000, "ignore_eos": True}))
        while not srv.engine_loop.tracked:
            await asyncio.sleep(0.005)
        await asyncio.gather(srv.shutdown(0), pending)
        resp = pending.result()
        return resp.status, await resp.json()

    status, reply = run_with_server(body)
    assert status == 503 and "aborted" in reply["error"]["message"]


class DyingEngine(Engine):
    """The real engine, until its fifth step raises (an engine bug, or a lost GPU)."""

    def step(self):  # type: ignore[override]
        if self.num_steps >= 4:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().step()


def test_a_dead_engine_ends_streams_and_turns_unhealthy():
    async def body(srv, session, url):
        async with session.post(url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}) as resp:
            events = await read_stream(resp)
        async with session.get(url + "/health") as health:
            health_status = health.status
        async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as again:
            again_status, again_body = again.status, await again.json()
        return events, health_status, again_status, again_body

    events, health, again, again_body = run_with_server(body, make_server(DyingEngine(make_config())))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"  # type: ignore[index]
    assert health == 503
    assert again == 503 and "engine is dead" in again_body["error"]["message"]


def test_openai_error_body_shape():
    assert proto.OpenAIError("nope", status=503).body() == {
        "error": {"message": "nope", "type": "ServiceUnavailableError", "param": None, "code": 503}}


def test_api_key_guards_the_openai_routes_only():
    engine = Engine(make_config())
    server = TwinServer(engine, ServingInfo(served_model_name=MODEL, model=MODEL, max_model_len=4096,
                                            api_key="s3cret"))

    async def body(srv, session, url):
        statuses = {}
        for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                              ("right", {"Authorization": "Bearer s3cret"})):
            async with session.get(url + "/v1/models", headers=headers) as resp:
                statuses[name] = resp.status
        async with session.get(url + "/health") as resp:
            statuses["health"] = resp.status
        async with session.get(url + "/metrics") as resp:
            statuses["metrics"] = resp.status
        return statuses

    assert run_with_server(body, server) == {"none": 401, "wrong": 401, "right": 200, "health": 200,
                                             "metrics": 200}


def test_prefix_cache_counters_count_a_shared_system_prompt():
    from prometheus_client.parser import text_string_to_metric_families

    system = " ".join(["You are a careful assistant who answers in short sentences."] * 20)

    async def body(srv, session, url):
        for question in ("first question", "second question"):
            async with session.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                    "max_tokens": 2, "ignore_eos": True}) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
        async with session.get(url + "/metrics") as resp:
            return usage["prompt_tokens"], await resp.text()

    prompt_tokens, exposition = run_with_server(body)
    samples = {s.name: s.value for f in text_string_to_metric_families(exposition) for s in f.samples}
    queries, hits = samples["vllm:prefix_cache_queries_total"], samples["vllm:prefix_cache_hits_total"]
    assert queries >= 2 * prompt_tokens - 10  # both lookups (the prompts differ by a word or two)
    assert 0 < hits < prompt_tokens  # the second request found the system prompt's full blocks
    assert hits % 16 == 0


def test_metrics_ignores_accept_and_metrics_slash_negotiates_as_vllm_does():
    """vLLM's GET /metrics is the instrumentator's route (text, names as declared, whatever the
    Accept header); /metrics/ reaches its prometheus_client mount, which negotiates and gzips."""
    from harness.prometheus import PROMETHEUS_2_ACCEPT

    async def body(srv, session, url):
        out = {}
        for path in ("/metrics", "/metrics/"):
            async with session.get(url + path, headers={"Accept": PROMETHEUS_2_ACCEPT,
                                                        "Accept-Encoding": "gzip"}) as resp:
                text = await resp.text()
                out[path] = (resp.status, resp.headers["Content-Type"], resp.headers.get("Content-Encoding"),
                             "\nvllm:num_requests_running{" in text, "\nvllm_num_requests_running{" in text)
        return out

    assert run_with_server(body) == {
        "/metrics": (200, "text/plain; version=1.0.0; charset=utf-8", None, True, False),
        "/metrics/": (200, "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores",
                      "gzip", False, True),
    }


def test_compressed_bodies_are_inflated_by_the_server_and_a_full_parse_queue_answers_503(tmp_path):
    """gzip and deflate bodies are read as sent (aiohttp's own inflation, on the event loop, is off)
    and inflated in a parse worker; with every parse slot busy and the queue full, the next
    compressed body is answered 503 with Retry-After at once, in OpenAI's error shape."""
    import gzip
    import zlib

    from kvpilot.twin.server.workers import ParseWorkers
    from tests.support import parse_jobs

    body = json.dumps({"prompt": "hello there", "max_tokens": 2}).encode()

    async def run(srv: TwinServer, session: aiohttp.ClientSession, url: str) -> None:
        for data, coding in ((gzip.compress(body), "gzip"), (zlib.compress(body), "deflate")):
            async with session.post(url + "/v1/completions", data=data, headers={
                    "Content-Type": "application/json", "Content-Encoding": coding}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["usage"]["completion_tokens"] == 2
        srv.parse_workers.close()
        srv.parse_workers = ParseWorkers(1, 0)
        marker = tmp_path / "started"
        busy = asyncio.create_task(srv.parse_workers.run(parse_jobs.spin, str(marker), 120.0))
        try:
            while not marker.exists():
                await asyncio.sleep(0.01)
            async with session.post(url + "/v1/completions", data=gzip.compress(body), headers={
                    "Content-Type": "application/json", "Content-Encoding": "gzip"}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                error = (await resp.json())["error"]
                assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
                assert "busy parsing" in error["message"]
        finally:
            busy.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await busy

    run_with_server(run)
