"""The well-behaved clients a flood or a hostile request must not starve: a long completion stream
(its token gaps) and a `/health` probe (its latency), each until told to stop."""

from __future__ import annotations

import asyncio
import time

import aiohttp

STORY = {"prompt": "Tell me a long story.", "max_tokens": 3500, "ignore_eos": True, "stream": True}


async def stream_chunks(session: aiohttp.ClientSession, url: str, chunks: list[float], stop: asyncio.Event) -> None:
    """POST a long streamed completion to `url`; append the arrival time of each chunk to `chunks`."""
    async with session.post(url, json=STORY) as resp:
        if resp.status != 200:
            raise AssertionError(f"the stream was refused: {resp.status} {await resp.text()}")
        async for _ in resp.content:
            chunks.append(time.monotonic())
            if stop.is_set():
                return


async def probe_health(session: aiohttp.ClientSession, url: str, out: list[tuple[float, float]],
                       stop: asyncio.Event, interval_s: float = 0.05) -> None:
    """GET `url` every `interval_s`; append (sent at, seconds to answer) of each; a non-200 raises."""
    while not stop.is_set():
        started = time.monotonic()
        async with session.get(url) as resp:
            await resp.read()
            if resp.status != 200:
                raise AssertionError(f"{url} answered {resp.status}")
        out.append((started, time.monotonic() - started))
        await asyncio.sleep(interval_s)
