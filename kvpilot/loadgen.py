"""An asyncio load generator for OpenAI-compatible servers (the twin, or vLLM itself).

    from kvpilot.loadgen import run_load_sync

    result = run_load_sync(twin.base_url, num_requests=40, rate=20.0, seed=7, max_tokens=16)
    result.fraction_ttft_at_most(0.5)          # Fraction(39, 40): exact, from every request
    result.fraction_itl_at_most(0.05)          # over every inter-token gap
    result.summary()                           # counts and p50/p90/p99 of TTFT, ITL, e2e

Two modes:
* open loop: `rate=R` sends requests at Poisson arrivals (exponential gaps, seeded), whether or
  not earlier ones finished - what a real service sees;
* closed loop: `concurrency=C` keeps C requests in flight, each worker sending the next request
  as soon as its last one ends (or `think_s` seconds after: C users who read each answer, so a
  fast engine is not driven flat out while a slow one still has every user waiting on it).

Every request streams (with `stream_options.include_usage`), and the client clocks, like vLLM's
own `vllm bench serve`: TTFT at the first chunk carrying text, every gap between text chunks,
and end-to-end latency at `[DONE]`.  Where chunks name their tokens (vLLM's `return_token_ids`, in
`extra_body`), the client clocks tokens rather than chunks: a chunk carrying k tokens (vLLM merges
the outputs of several engine steps into one chunk when its HTTP side lags) gives its gap to the
first and 0 s to the other k - 1, which reached the client at the same moment, and a chunk whose
token has no text yet (a byte of a multi-byte character) still counts as that token's arrival.
So there is one gap per token after the first, as vLLM's ITL histogram counts them.  A request
fails if the status is not 200, the stream breaks,
or it ends without `[DONE]`.  Runs are bounded: `num_requests` requests at most, and whatever is
still running after `max_duration_s` is cancelled and recorded as failed.

Times are `time.monotonic()` seconds; `RequestRecord.start` is relative to the run's start, so
windows (`start_s`/`end_s` arguments) select requests by when they were sent.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

import aiohttp

Endpoint = Literal["completions", "chat"]

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def make_prompt(index: int, words: int) -> str:
    """A deterministic prompt of `words` short words (about one token each), different per index."""
    rng = random.Random(index)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class RequestRecord:
    index: int
    start: float                      # seconds after the run started
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_chunks: int = 0            # chunks that carried tokens (one token each from the twin)
    prompt_tokens: int | None = None  # from the usage chunk
    completion_tokens: int | None = None
    finish_reason: str | None = None
    response_id: str | None = None    # the chunks' `id` (vLLM's request id: `cmpl-...`)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    deadline_hit: bool = False

    def window(self, start_s: float | None = None, end_s: float | None = None) -> list[RequestRecord]:
        """Records of requests SENT in [start_s, end_s) seconds after the run started."""
        return [r for r in self.records
                if (start_s is None or r.start >= start_s) and (end_s is None or r.start < end_s)]

    def succeeded(self, start_s: float | None = None, end_s: float | None = None) -> list[RequestRecord]:
        return [r for r in self.window(start_s, end_s) if r.ok]

    def failed(self, start_s: float | None = None, end_s: float | None = None) -> list[RequestRecord]:
        return [r for r in self.window(start_s, end_s) if not r.ok]

    def ttfts(self, start_s: float | None = None, end_s: float | None = None) -> list[float]:
        return [r.ttft for r in self.succeeded(start_s, end_s) if r.ttft is not None]

    def itls(self, start_s: float | None = None, end_s: float | None = None) -> list[float]:
        return [gap for r in self.succeeded(start_s, end_s) for gap in r.itls]

    def e2es(self, start_s: float | None = None, end_s: float | None = None) -> list[float]:
        return [r.e2e for r in self.succeeded(start_s, end_s) if r.e2e is not None]

    @staticmethod
    def _fraction(values: Iterable[float], threshold: float) -> Fraction | None:
        values = list(values)
        if not values:
            return None
        return Fraction(sum(1 for v in values if v <= threshold), len(values))

    def fraction_ttft_at_most(self, threshold_s: float, start_s: float | None = None,
                              end_s: float | None = None, *, failures_count: bool = True) -> Fraction | None:
        """Exact share of requests in the window whose TTFT was <= threshold.  A failed request
        counts as a miss unless `failures_count=False` (an SLO counts errors as bad events)."""
        window = self.window(start_s, end_s)
        if not failures_count:
            window = [r for r in window if r.ok]
        if not window:
            return None
        good = sum(1 for r in window if r.ok and r.ttft is not None and r.ttft <= threshold_s)
        return Fraction(good, len(window))

    def fraction_itl_at_most(self, threshold_s: float, start_s: float | None = None,
                             end_s: float | None = None) -> Fraction | None:
        """Exact share of inter-token gaps (of successful requests in the window) <= threshold."""
        return self._fraction(self.itls(start_s, end_s), threshold_s)

    def summary(self) -> dict[str, Any]:
        def stats(values: list[float]) -> dict[str, float | None]:
            return {"p50": percentile(values, 50), "p90": percentile(values, 90),
                    "p99": percentile(values, 99), "max": max(values) if values else None}

        return {"requests": len(self.records), "succeeded": len(self.succeeded()),
                "failed": len(self.failed()), "duration_s": self.duration_s,
                "deadline_hit": self.deadline_hit,
                "output_tokens": sum(r.completion_tokens or r.output_chunks for r in self.succeeded()),
                "ttft_s": stats(self.ttfts()), "itl_s": stats(self.itls()), "e2e_s": stats(self.e2es())}


def _chunk_text(chunk: dict[str, Any], endpoint: Endpoint) -> tuple[str, str | None, int]:
    """(text, finish reason, tokens carried): the tokens are the chunk's `token_ids` where it names
    them, else one if it carries text."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None, 0
    choice = choices[0]
    if endpoint == "completions":
        text = choice.get("text") or ""
    else:
        text = (choice.get("delta") or {}).get("content") or ""
    token_ids = choice.get("token_ids")
    tokens = len(token_ids) if token_ids is not None else (1 if text else 0)
    return text, choice.get("finish_reason"), tokens


async def _one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any], endpoint: Endpoint,
                       record: RequestRecord, t_run0: float, request_timeout_s: float) -> None:
    sent = time.monotonic()
    record.start = sent - t_run0
    last: float | None = None
    done = False
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as resp:
            record.status = resp.status
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                now = time.monotonic()
                if record.response_id is None and isinstance(chunk.get("id"), str):
                    record.response_id = chunk["id"]
                text, finish, tokens = _chunk_text(chunk, endpoint)
                if finish is not None:
                    record.finish_reason = finish
                if chunk.get("usage") and not chunk.get("choices"):
                    record.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    record.completion_tokens = chunk["usage"].get("completion_tokens")
                if not tokens:
                    continue
                if last is None:
                    record.ttft = now - sent
                    record.itls.extend([0.0] * (tokens - 1))
                else:
                    record.itls.extend([now - last] + [0.0] * (tokens - 1))
                last = now
                record.output_chunks += 1
        record.e2e = time.monotonic() - sent
        record.ok = done
        if not done:
            record.error = "stream ended without [DONE]"
    except asyncio.CancelledError:
        record.error = "cancelled at the run's deadline"
        raise
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


def _request_body(text: str, endpoint: Endpoint, model: str | None, max_tokens: int, ignore_eos: bool,
                  extra_body: dict[str, Any] | None) -> dict[str, Any]:
    """One streaming request's JSON body: `text` as the prompt, or as the user's message."""
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos,
                            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    if endpoint == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    body.update(extra_body or {})
    return body


async def run_load(base_url: str, *, num_requests: int, rate: float | None = None,
                   concurrency: int | None = None, seed: int = 0, endpoint: Endpoint = "completions",
                   model: str | None = None, prompt_words: int = 32,
                   prompt: Callable[[int], str] | None = None, max_tokens: int = 16,
                   ignore_eos: bool = True, max_duration_s: float = 60.0,
                   request_timeout_s: float = 60.0, extra_body: dict[str, Any] | None = None,
                   keepalive: bool = True, stop: Callable[[], bool] | None = None,
                   think_s: float = 0.0) -> LoadResult:
    """Send `num_requests` streaming requests, open loop at Poisson `rate` req/s or closed loop with
    `concurrency` workers (exactly one of the two).  `base_url` is the server root (no /v1).
    `think_s`: closed loop only, each worker's pause between one request's end and its next.
    `keepalive=False`: a connection per request (a forwarder that splits connections then splits
    requests).  `stop`: polled before each request; once true, no more are sent and the run ends
    when those in flight have finished (none is cancelled)."""
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate= (open loop) or concurrency= (closed loop)")
    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    make_text = prompt or (lambda i: make_prompt(seed * 1_000_003 + i, prompt_words))
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    url = base_url.rstrip("/") + path

    records: list[RequestRecord] = []
    # No client-side queueing: it would distort TTFT.
    connector = aiohttp.TCPConnector(limit=0, force_close=not keepalive)
    t0 = time.monotonic()
    deadline_hit = False
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks: list[asyncio.Task[None]] = []

        def launch(i: int) -> asyncio.Task[None]:
            rec = RequestRecord(index=i, start=time.monotonic() - t0)
            records.append(rec)
            body = _request_body(make_text(i), endpoint, model, max_tokens, ignore_eos, extra_body)
            return asyncio.create_task(_one_request(session, url, body, endpoint, rec, t0, request_timeout_s))

        async def open_loop() -> None:
            assert rate is not None
            rng = random.Random(seed)
            next_at = t0
            for i in range(num_requests):
                if stop is not None and stop():
                    break
                next_at += rng.expovariate(rate)
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(launch(i))
            await asyncio.gather(*tasks, return_exceptions=True)

        async def closed_loop() -> None:
            assert concurrency is not None
            counter = iter(range(num_requests))

            async def worker() -> None:
                for i in counter:
                    if stop is not None and stop():
                        break
                    task = launch(i)
                    tasks.append(task)
                    await asyncio.gather(task, return_exceptions=True)
                    if think_s > 0:
                        await asyncio.sleep(think_s)

            await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))

        driver = asyncio.create_task(open_loop() if rate is not None else closed_loop())

        async def cancel_everything() -> None:
            driver.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(driver, *tasks, return_exceptions=True)

        try:
            await asyncio.wait_for(asyncio.shield(driver), max_duration_s)
        except TimeoutError:
            deadline_hit = True
            await cancel_everything()
        except asyncio.CancelledError:
            # Cancelled from outside (a background load being stopped): stop every request
            # before the session closes, so nothing is left running on the loop.
            await cancel_everything()
            raise
    for rec in records:  # requests cancelled before their coroutine first ran
        if not rec.ok and rec.error is None:
            rec.error = "cancelled at the run's deadline"
    return LoadResult(records=records, duration_s=time.monotonic() - t0, deadline_hit=deadline_hit)


def run_load_sync(base_url: str, **kwargs: Any) -> LoadResult:
    """`run_load` from synchronous code (a plain pytest test)."""
    return asyncio.run(run_load(base_url, **kwargs))
