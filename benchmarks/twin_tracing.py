"""What request tracing costs the engine twin, per request: tracing off vs on.

    .venv/bin/python benchmarks/twin_tracing.py [--requests 400] [--rounds 5] [--smoke]
    PYTHONPATH=<a checkout without tracing> .venv/bin/python benchmarks/twin_tracing.py --off-only   # a baseline

One TwinServer in this process (the real engine, Qwen2.5-0.5B on an H100 preset), driven over real HTTP
on 127.0.0.1 by sequential non-streaming completions of one output token; the figure is this process's
CPU time per request (client and server together, the same client both ways), the median of
alternating rounds.  "off" is the server as it runs without --otlp-traces-endpoint (no tracer: the
OpenTelemetry SDK is not even imported); "on" builds the tracer as `kvpilot twin serve
--otlp-traces-endpoint` does and exports every span over OTLP/HTTP to a receiver in this process that
answers 200 (its CPU time is counted too, so "on" is an upper bound).  Needs kvpilot[tracing].
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import aiohttp
from aiohttp import web

from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.models import resolve_model
from kvpilot.twin.server.app import ServingInfo, TwinServer

MODEL = "Qwen2.5-0.5B"
BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 1, "ignore_eos": True}


def server(tracer: object | None) -> TwinServer:
    engine = Engine(EngineConfig.resolve(resolve_model(MODEL), resolve_gpu("H100-80GB"), max_model_len=4096))
    info = ServingInfo(served_model_name=MODEL, model=MODEL, max_model_len=4096)
    if tracer is None:  # as a checkout from before tracing builds it too (the --off-only baseline)
        return TwinServer(engine, info)
    return TwinServer(engine, info, tracer)  # type: ignore[arg-type]


async def receiver() -> tuple[web.AppRunner, str, list[int]]:
    received = [0]

    async def traces(request: web.Request) -> web.Response:
        received[0] += len(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces", received


async def cpu_per_request(srv: TwinServer, n: int) -> float:
    await srv.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.port}/v1/completions"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(20):  # warm-up: connections, first-call caches
                async with session.post(url, json=BODY) as resp:
                    await resp.read()
            start = time.process_time()
            for _ in range(n):
                async with session.post(url, json=BODY) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            return (time.process_time() - start) / n
    finally:
        await srv.shutdown(0)


async def main(requests: int, rounds: int, off_only: bool) -> None:
    if off_only:
        off = [await cpu_per_request(server(None), requests) for _ in range(rounds)]
        print(f"twin per-request CPU time, tracing off, {requests} requests x {rounds} rounds (median): "
              f"{statistics.median(off) * 1e6:.1f} us/request (rounds: {', '.join(f'{x * 1e6:.0f}' for x in off)})")
        return
    from kvpilot.twin.server.tracing import RequestTracer

    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    runner, url, received = await receiver()
    off: list[float] = []
    on: list[float] = []
    try:
        for _ in range(rounds):
            off.append(await cpu_per_request(server(None), requests))
            on.append(await cpu_per_request(server(RequestTracer(url)), requests))
    finally:
        await runner.cleanup()
    off_us, on_us = statistics.median(off) * 1e6, statistics.median(on) * 1e6
    print(f"twin per-request CPU time, {requests} requests x {rounds} rounds (median), Python {sys.version.split()[0]}:")
    print(f"  tracing off: {off_us:8.1f} us/request   (rounds: {', '.join(f'{x * 1e6:.0f}' for x in off)})")
    print(f"  tracing on:  {on_us:8.1f} us/request   (rounds: {', '.join(f'{x * 1e6:.0f}' for x in on)}; "
          f"{received[0] / 1024:.0f} KiB of OTLP exported)")
    print(f"  on / off:    {on_us / off_us:8.2f}       (span building and export: {on_us - off_us:+.1f} us/request)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--off-only", action="store_true", help="only the tracing-off figure (runs on older checkouts)")
    parser.add_argument("--smoke", action="store_true", help="40 requests x 1 round: the same lines in seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.rounds = 40, 1
    asyncio.run(main(args.requests, args.rounds, args.off_only))
