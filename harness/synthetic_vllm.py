"""A stand-in for vLLM's /metrics where no engine runs (kwok pods serve nothing): TTFT and ITL
histograms that grow by `rate` observations a second (`set_rate` changes it, the counters carrying on), each in the lowest bucket, so every p99 and
burn rate is the same in any window and well inside any SLO.

`escaped=True` serves the names as vLLM's /metrics does under OpenMetrics negotiation with
`escaping=underscores` (Prometheus 2.x's Accept): `vllm_<name>` for `vllm:<name>`, which the monitors'
metricRelabelings rename back. `host` and `port` place it where a target is (a kwok pod's IP)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvpilot.api import vllm


class SyntheticVllm:
    def __init__(self, rate: float = 10.0, *, escaped: bool = False, host: str = "127.0.0.1", port: int = 0,
                 tokens: tuple[int, int] | None = None) -> None:
        self._lock = threading.Lock()
        self._since, self._before, self._rate = time.monotonic(), 0.0, rate

        def body() -> bytes:
            n = int(self.requests())
            lines: list[str] = []
            for metric, edges in ((vllm.METRIC_TTFT, vllm.TTFT_BUCKETS), (vllm.METRIC_ITL, vllm.ITL_BUCKETS)):
                name = metric.replace(":", "_") if escaped else metric
                lines.append(f"# TYPE {name} histogram")
                lines += [f'{name}_bucket{{le="{edge}"}} {n}' for edge in edges]
                lines += [f'{name}_bucket{{le="+Inf"}} {n}', f"{name}_sum {n * edges[0]}", f"{name}_count {n}"]
            # Every request `tokens` = (prompt, generated) long, in one bucket at that edge.
            for metric, count in zip((vllm.METRIC_REQUEST_PROMPT_TOKENS, vllm.METRIC_REQUEST_GENERATION_TOKENS),
                                     tokens or (), strict=False):
                name = metric.replace(":", "_") if escaped else metric
                lines += [f"# TYPE {name} histogram", f'{name}_bucket{{le="{count}"}} {n}',
                          f'{name}_bucket{{le="+Inf"}} {n}', f"{name}_sum {n * count}", f"{name}_count {n}"]
            return ("\n".join(lines) + "\n").encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                payload = body()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.target = f"{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def requests(self) -> float:
        """Requests served so far (the counters' value)."""
        with self._lock:
            return self._before + (time.monotonic() - self._since) * self._rate

    def set_rate(self, rate: float) -> None:
        """Requests per second from now on; the counters carry on from where they are (no reset)."""
        with self._lock:
            now = time.monotonic()
            self._before += (now - self._since) * self._rate
            self._since, self._rate = now, rate

    def __enter__(self) -> SyntheticVllm:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
