"""Does the twin stay responsive while clients flood it with oversized requests?

    python benchmarks/twin_flood.py [--clients 8] [--prompt-mb 10] [--seconds 15] [--smoke]

Starts a real `kvpilot twin serve` process on 127.0.0.1 (Llama-3.1-8B on an L4: ~15 tokens/s per
stream, so one stream stays in flight for the whole run), opens one streaming completion, then
lets `--clients` clients send `--prompt-mb` MB prompts back to back for `--seconds` (each is
refused with a 400: it exceeds max_model_len) while a prober GETs /health every 50 ms.

Prints the /health latency (median, p99, max) and the longest gap between two chunks of the
in-flight stream, before and during the flood.  Goals: /health within 100 ms and no stream stall
over 200 ms during the flood (the operator's readiness probe times out after a few seconds; a
stalled stream is a latency spike every client sees).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import live_clients  # noqa: E402
from harness.twin_process import SLOW_TWIN_ARGS, twin_server  # noqa: E402

HEALTH_GOAL_S = 0.100
STALL_GOAL_S = 0.200


def _flood_process(port: int, clients: int, payload: bytes, seconds: float, results: Any) -> None:
    """The flooding clients, in a process of their own so the measuring client's event loop
    never waits on them: `clients` threads, each POSTing `payload` back to back."""

    def client() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", body=payload, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            results.put(resp.status)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _gap(times: list[float], start: float, end: float) -> float:
    inside = [t for t in times if start <= t <= end]
    return max((b - a for a, b in zip(inside, inside[1:], strict=False)), default=float("nan"))


def _latencies(samples: list[tuple[float, float]], start: float, end: float) -> list[float]:
    return sorted(lat for t, lat in samples if start <= t <= end)


async def run(base_url: str, port: int, clients: int, prompt_mb: float, seconds: float) -> int:
    words = "hello world, this is a prompt. "
    payload = json.dumps({"prompt": words * int(prompt_mb * 1e6 / len(words)), "max_tokens": 2}).encode()
    stop_stream, stop_probe = asyncio.Event(), asyncio.Event()
    chunks: list[float] = []
    health: list[tuple[float, float]] = []
    statuses: dict[int, int] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as stream_s, aiohttp.ClientSession(timeout=timeout) as probe_s:
        stream = asyncio.create_task(live_clients.stream_chunks(stream_s, f"{base_url}/v1/completions", chunks, stop_stream))
        probe = asyncio.create_task(live_clients.probe_health(probe_s, f"{base_url}/health", health, stop_probe))
        await asyncio.sleep(3.0)  # a quiet baseline
        queue: Any = multiprocessing.Queue()
        flooder = multiprocessing.Process(target=_flood_process, args=(port, clients, payload, seconds, queue))
        flood_start = time.monotonic()
        flooder.start()
        while flooder.is_alive():
            await asyncio.sleep(0.1)
        flood_end = time.monotonic()
        while not queue.empty():
            status = queue.get()
            statuses[status] = statuses.get(status, 0) + 1
        stop_probe.set()
        stop_stream.set()
        await asyncio.gather(probe, stream)
    quiet = _latencies(health, 0, flood_start)
    busy = _latencies(health, flood_start, flood_end)
    gap_quiet = _gap(chunks, 0, flood_start)
    gap_busy = _gap(chunks, flood_start, flood_end)
    sent = sum(statuses.values())
    print(f"flood: {clients} clients, {len(payload) / 1e6:.1f} MB prompts, {flood_end - flood_start:.1f} s: "
          f"{sent} requests ({sent * len(payload) / 1e6 / (flood_end - flood_start):.0f} MB/s), statuses {statuses}")
    print(f"/health latency before: median {statistics.median(quiet) * 1e3:.1f} ms, max {quiet[-1] * 1e3:.1f} ms "
          f"({len(quiet)} probes)")
    p99 = busy[min(len(busy) - 1, int(0.99 * len(busy)))]
    print(f"/health latency during: median {statistics.median(busy) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
          f"max {busy[-1] * 1e3:.1f} ms ({len(busy)} probes)   goal <= {HEALTH_GOAL_S * 1e3:.0f} ms")
    print(f"stream: longest gap between chunks before {gap_quiet * 1e3:.1f} ms, during {gap_busy * 1e3:.1f} ms"
          f"   goal <= {STALL_GOAL_S * 1e3:.0f} ms")
    ok = busy[-1] <= HEALTH_GOAL_S and gap_busy <= STALL_GOAL_S and set(statuses) == {400}
    print("goals met" if ok else "goals NOT met")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--prompt-mb", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--smoke", action="store_true",
                    help="2 clients, 1 MB prompts, 2 s: the same path in seconds (CI); the goals' verdict is "
                         "printed, not the exit status (a busy CI machine is not the figure)")
    args = ap.parse_args()
    if args.smoke:
        args.clients, args.prompt_mb, args.seconds = 2, 1.0, 2.0
    if not (1 <= args.clients <= 64 and 0 < args.prompt_mb <= 30 and 0 < args.seconds <= 120):
        ap.error("keep the flood bounded: 1-64 clients, prompts up to 30 MB, up to 120 s")
    with twin_server(*SLOW_TWIN_ARGS) as twin:
        code = asyncio.run(run(twin.base_url, twin.port, args.clients, args.prompt_mb, args.seconds))
    return 0 if args.smoke else code


if __name__ == "__main__":
    raise SystemExit(main())
