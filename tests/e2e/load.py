"""Steady load for the e2e rollout test: standard library only, so it runs inside the cluster
from the kvpilot image (`python -c "$(cat load.py)"`), or anywhere else.

Why inside the cluster: `kubectl port-forward svc/NAME` pins one pod for the life of the
forward, so the first pod the rollout replaces breaks the tunnel; that tests kubectl, not the
rollout. Through the Service's cluster IP, kube-proxy spreads requests over ready endpoints
exactly as real clients see them.

Environment:
  LOAD_URL          base URL of the OpenAI-compatible server (e.g. http://svc.ns.svc:8000)
  LOAD_MODEL        model name to send
  LOAD_CONCURRENCY  parallel clients (default 4)
  LOAD_MAX_TOKENS   tokens per completion (default 16)
  LOAD_TIMEOUT      seconds per request (default 60)
  LOAD_MAX_SECONDS  stop after this long even without a signal (default 1800)

Prints one JSON line a second, {"ok": N, "failed": N, "in_flight": N}, and on SIGTERM or SIGINT
stops sending, waits for the requests in flight, and prints a last line
"SUMMARY {...}" with the counts and the first errors. Exit status 0 when nothing failed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = 0
        self.failed = 0
        self.in_flight = 0
        self.errors: list[str] = []

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"ok": self.ok, "failed": self.failed, "in_flight": self.in_flight}


def one_request(url: str, body: bytes, timeout: float) -> None:
    request = urllib.request.Request(
        url + "/v1/completions", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        payload = json.loads(response.read())
    if not payload.get("choices"):
        raise ValueError(f"no choices in the response: {str(payload)[:200]}")


def client(url: str, body: bytes, timeout: float, stop: threading.Event, counters: Counters) -> None:
    while not stop.is_set():
        with counters.lock:
            counters.in_flight += 1
        error = None
        try:
            one_request(url, body, timeout)
        except urllib.error.HTTPError as exc:
            error = f"HTTP {exc.code}: {exc.read()[:200]!r}"
        except Exception as exc:  # connection refused/reset, timeout, bad JSON: all are failures
            error = f"{type(exc).__name__}: {exc}"
        with counters.lock:
            counters.in_flight -= 1
            if error is None:
                counters.ok += 1
            else:
                counters.failed += 1
                if len(counters.errors) < 20:
                    counters.errors.append(f"{time.strftime('%H:%M:%S')} {error}")


def main() -> int:
    url = os.environ["LOAD_URL"].rstrip("/")
    model = os.environ["LOAD_MODEL"]
    concurrency = int(os.environ.get("LOAD_CONCURRENCY", "4"))
    max_tokens = int(os.environ.get("LOAD_MAX_TOKENS", "16"))
    timeout = float(os.environ.get("LOAD_TIMEOUT", "60"))
    max_seconds = float(os.environ.get("LOAD_MAX_SECONDS", "1800"))
    body = json.dumps(
        {
            "model": model,
            "prompt": "Tell me about chunked prefill in vLLM.",
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    ).encode()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    counters = Counters()
    threads = [
        threading.Thread(target=client, args=(url, body, timeout, stop, counters), daemon=True)
        for _ in range(concurrency)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + max_seconds
    while not stop.wait(1.0):
        print(json.dumps(counters.snapshot()), flush=True)
        if time.monotonic() > deadline:
            stop.set()
    for t in threads:
        t.join(timeout + 5)
    summary = counters.snapshot()
    summary["errors"] = counters.errors
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
