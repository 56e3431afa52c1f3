"""Start-up and shutdown of `kvpilot twin serve` as vLLM does them: the port opens only once
loaded, a configuration vLLM refuses exits 1 without opening it, and SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from harness.twin_process import (
    FAST_TWIN_ARGS,
    SLOW_TWIN_ARGS,
    free_port,
    port_is_open,
    start_twin,
)

pytestmark = pytest.mark.integration

# With SLOW_TWIN_ARGS a 40-token stream lasts a few seconds: surely in flight when SIGTERM arrives.
STREAM_TOKENS = 40


async def _stream(session: aiohttp.ClientSession, url: str, first_token: asyncio.Event) -> dict:
    """One streamed completion; the result says how it ended."""
    body = {"prompt": "drain me", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"pieces": 0, "finish_reason": None, "done": False, "usage": None}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                out["done"] = True
                break
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                if chunk["choices"][0]["text"]:
                    out["pieces"] += 1
                    first_token.set()
                out["finish_reason"] = chunk["choices"][0]["finish_reason"] or out["finish_reason"]
            elif chunk.get("usage"):
                out["usage"] = chunk["usage"]
    return out


async def _poll_status(session: aiohttp.ClientSession, url: str, want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with session.get(url) as resp:
            if resp.status == want:
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never answered {want}")


async def _sigterm_while_streaming(twin, n_streams: int, *, probe: bool = True, second_signal: bool = False
                                   ) -> tuple[list[dict], int | None, dict | None]:
    async with aiohttp.ClientSession() as session:
        firsts = [asyncio.Event() for _ in range(n_streams)]
        tasks = [asyncio.create_task(_stream(session, twin.base_url, ev)) for ev in firsts]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in firsts)), 30)
        twin.terminate()
        if not probe:  # with nothing to drain the server may be gone before a probe connects
            return await asyncio.wait_for(asyncio.gather(*tasks), 60), None, None
        # /health flips to 503 at the moment the server starts draining ...
        await _poll_status(session, twin.health_url, 503, timeout=10)
        # ... and from then on new requests are refused with an OpenAI-style error.
        async with session.post(twin.base_url + "/v1/completions",
                                json={"prompt": "too late", "max_tokens": 2}) as resp:
            refused_status, refused = resp.status, await resp.json()
        if second_signal:
            twin.terminate()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return results, refused_status, refused


def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_requests(tmp_path):
    twin = start_twin(*SLOW_TWIN_ARGS, "--shutdown-timeout", "60", log_dir=tmp_path)
    try:
        twin.wait_healthy(30)
        results, refused_status, refused = asyncio.run(_sigterm_while_streaming(twin, 3))
        assert refused_status == 503
        assert refused["error"]["code"] == 503 and "shutting down" in refused["error"]["message"]
        for res in results:  # every in-flight stream ran to its end
            assert res == {"pieces": STREAM_TOKENS, "finish_reason": "length", "done": True,
                           "usage": {"prompt_tokens": res["usage"]["prompt_tokens"],
                                     "completion_tokens": STREAM_TOKENS,
                                     "total_tokens": res["usage"]["prompt_tokens"] + STREAM_TOKENS}}
        assert twin.wait(20) == 0
        msgs = [r["msg"] for r in twin.log_records()]
        assert "shutting down" in msgs and "shutdown complete" in msgs
    finally:
        twin.stop()


def test_sigterm_with_zero_shutdown_timeout_aborts_in_flight_streams(tmp_path):
    twin = start_twin(*SLOW_TWIN_ARGS, "--shutdown-timeout", "0", log_dir=tmp_path)
    try:
        twin.wait_healthy(30)
        results, _, _ = asyncio.run(_sigterm_while_streaming(twin, 2, probe=False))
        for res in results:  # ended at once, cleanly, with vLLM's "abort" finish reason
            assert res["done"] and res["finish_reason"] == "abort"
            assert 1 <= res["pieces"] < STREAM_TOKENS
            assert res["usage"]["completion_tokens"] == res["pieces"]
        assert twin.wait(20) == 0
    finally:
        twin.stop()


def test_a_second_sigterm_cuts_the_drain_short(tmp_path):
    twin = start_twin(*SLOW_TWIN_ARGS, "--shutdown-timeout", "600", log_dir=tmp_path)
    try:
        twin.wait_healthy(30)
        results, refused_status, _ = asyncio.run(_sigterm_while_streaming(twin, 2, second_signal=True))
        assert refused_status == 503
        for res in results:
            assert res["done"] and res["finish_reason"] == "abort" and res["pieces"] < STREAM_TOKENS
        assert twin.wait(20) == 0
        assert any(r["msg"].startswith("second signal") for r in twin.log_records())
    finally:
        twin.stop()


def test_startup_failure_exits_1_with_vllm_error_and_never_opens_the_port(tmp_path):
    port = free_port()
    twin = start_twin(*FAST_TWIN_ARGS, "--gpu-memory-utilization", "1.0", port=port, log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while twin.proc.poll() is None and time.monotonic() < deadline:
            assert not port_is_open("127.0.0.1", port)
            time.sleep(0.02)
        assert twin.wait(5) == 1
        assert not port_is_open("127.0.0.1", port)
        log = twin.logs()
        assert "EngineCore failed to start" in log
        assert "less than desired GPU memory utilization (1.0" in log
        assert "Traceback" not in log
    finally:
        twin.stop()


def test_bad_flag_values_are_usage_errors_not_tracebacks(tmp_path):
    twin = start_twin("--model", "no-such-model-7B", log_dir=tmp_path)
    try:
        assert twin.wait(30) == 2
        assert "no-such-model-7B" in twin.logs() and "Traceback" not in twin.logs()
    finally:
        twin.stop()


def test_port_opens_only_after_the_startup_delay(tmp_path):
    delay = 1.5
    port = free_port()
    launched = time.monotonic()
    twin = start_twin(*FAST_TWIN_ARGS, "--startup-delay", str(delay), port=port, log_dir=tmp_path)
    try:
        closed_seen = 0
        deadline = launched + 30
        while not port_is_open("127.0.0.1", port):
            assert twin.proc.poll() is None, twin.logs()
            assert time.monotonic() < deadline, "the port never opened"
            closed_seen += 1
            time.sleep(0.02)
        opened_after = time.monotonic() - launched
        assert closed_seen > 0
        # the delay is a sleep before the listener exists: it cannot open sooner
        assert opened_after >= delay
        twin.wait_healthy(10)
        msgs = [r["msg"] for r in twin.log_records()]
        assert msgs.index("loading engine") < msgs.index("Starting vLLM API server")
    finally:
        assert twin.stop() == 0


def test_sigterm_while_loading_exits_0_without_opening_the_port(tmp_path):
    port = free_port()
    twin = start_twin(*FAST_TWIN_ARGS, "--startup-delay", "30", port=port, log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not any(r.get("msg") == "loading engine" for r in twin.log_records()):
            assert time.monotonic() < deadline and twin.proc.poll() is None, twin.logs()
            time.sleep(0.02)
        twin.terminate()
        assert twin.wait(10) == 0
        assert not port_is_open("127.0.0.1", port)
    finally:
        twin.stop()


def test_a_taken_port_is_a_clear_error_and_exit_1(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        twin = start_twin(*FAST_TWIN_ARGS, port=port, log_dir=tmp_path)
        try:
            assert twin.wait(30) == 1
            assert f"cannot listen on 127.0.0.1:{port}" in twin.logs()
            assert "Traceback" not in twin.logs()
        finally:
            twin.stop()
