"""Read the signals the tuner steers by from Prometheus: one call, one consistent snapshot.

    snap = read_signals(selector, window="600s", prometheus_url="http://prometheus:9090",
                        slo=SloTarget(...), at=trial_end_unix_seconds)
    snap.ttft_p99_seconds, snap.itl_burn_rate_1h, snap.samples, ...

Every query of a snapshot is evaluated at the same instant (`at`, default: now), so the
numbers describe the same window.  Errors are typed so the caller can act on them:

* `PrometheusUnreachable`: no HTTP answer (connection refused, DNS, timeout);
* `PrometheusQueryError`: Prometheus answered with an error (bad query, overload, 5xx);
* `NoData`: Prometheus answered, but the window holds no requests for the selector.
  No traffic is not zero latency: the tuner must not score a trial from an empty window.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from kvpilot.slo import promql
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.promql import Selector


class SignalsError(Exception):
    """Base of the signals reader's errors."""


class PrometheusUnreachable(SignalsError):
    """No answer from Prometheus (connection refused, name not resolved, timed out)."""


class PrometheusQueryError(SignalsError):
    """Prometheus answered a query with an error."""

    def __init__(self, message: str, query: str | None = None, status: int | None = None):
        super().__init__(message)
        self.query = query
        self.status = status


class NoData(SignalsError):
    """The window holds no requests for the selector (no traffic, wrong labels, or not scraped yet)."""


@dataclass(frozen=True)
class SignalSnapshot:
    """What the tuner reads after a trial.  Latencies in seconds, rates per second, usage 0..1.

    Fields are None where the window holds no observations of that kind (for instance no
    second token yet, so no inter-token latency): never 0, which would read as perfect.
    """

    time: float  # unix seconds the queries were evaluated at
    window: str  # the Prometheus range the rates and quantiles cover
    selector: str
    samples: int  # requests (TTFT observations) in the window
    itl_samples: int  # inter-token gaps in the window
    ttft_p99_seconds: float | None
    itl_p99_seconds: float | None
    ttft_error_ratio: float | None  # over `window`
    itl_error_ratio: float | None
    ttft_burn_rate: float | None  # over `window`
    itl_burn_rate: float | None
    ttft_burn_rate_5m: float | None
    ttft_burn_rate_1h: float | None
    itl_burn_rate_5m: float | None
    itl_burn_rate_1h: float | None
    request_rate: float | None
    prompt_token_rate: float | None
    generation_token_rate: float | None
    kv_cache_usage: float | None
    preemption_rate: float | None

    @property
    def worst_burn_rate_5m(self) -> float | None:
        return _worst(self.ttft_burn_rate_5m, self.itl_burn_rate_5m)

    @property
    def worst_burn_rate_1h(self) -> float | None:
        return _worst(self.ttft_burn_rate_1h, self.itl_burn_rate_1h)

    @property
    def timestamp(self) -> datetime:
        return datetime.fromtimestamp(self.time).astimezone()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worst(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def signal_queries(selector: Selector, slo: SloTarget, window: str = "5m") -> dict[str, str]:
    """The PromQL behind each snapshot field (also what `kvpilot slo query` prints)."""
    promql.validate_duration(window, grafana=False)  # these queries go to Prometheus as they are
    q: dict[str, str] = {
        "samples": promql.observations("ttft", selector, window),
        "itl_samples": promql.observations("itl", selector, window),
        "ttft_p99_seconds": promql.quantile("ttft", 0.99, selector, window),
        "itl_p99_seconds": promql.quantile("itl", 0.99, selector, window),
        "ttft_error_ratio": promql.error_ratio("ttft", slo.ttft_seconds, selector, window),
        "itl_error_ratio": promql.error_ratio("itl", slo.itl_seconds, selector, window),
        "ttft_burn_rate": promql.burn_rate("ttft", slo.ttft_seconds, slo.objective, selector, window),
        "itl_burn_rate": promql.burn_rate("itl", slo.itl_seconds, slo.objective, selector, window),
    }
    for w in ("5m", "1h"):
        q[f"ttft_burn_rate_{w}"] = promql.burn_rate("ttft", slo.ttft_seconds, slo.objective, selector, w)
        q[f"itl_burn_rate_{w}"] = promql.burn_rate("itl", slo.itl_seconds, slo.objective, selector, w)
    q["request_rate"] = promql.request_rate(selector, window)
    q["prompt_token_rate"] = promql.prompt_token_rate(selector, window)
    q["generation_token_rate"] = promql.generation_token_rate(selector, window)
    q["kv_cache_usage"] = promql.kv_cache_usage(selector, "avg", window)
    q["preemption_rate"] = promql.preemption_rate(selector, window)
    return q


def _retry_policy(retries: int) -> Any:
    from urllib3.util.retry import Retry

    # Retry connection failures and gateway errors briefly; let Prometheus's own error
    # statuses (400 bad_data, 422 execution, 503 timeout) through so their message is read.
    return Retry(
        total=retries,
        connect=retries,
        read=0,
        status=retries,
        backoff_factor=0.2,
        status_forcelist=(502, 504),
        allowed_methods=frozenset({"GET", "POST"}),
        raise_on_status=False,
    )


class PrometheusReader:
    """A thin, typed-error wrapper over prometheus-api-client's `PrometheusConnect`."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        retries: int = 1,
        headers: dict[str, str] | None = None,
        disable_ssl: bool = False,
    ) -> None:
        from prometheus_api_client import PrometheusConnect

        if not url.startswith(("http://", "https://")):
            raise ValueError(f"Prometheus URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._prom = PrometheusConnect(
            url=self.url,
            headers=headers,
            disable_ssl=disable_ssl,
            retry=_retry_policy(retries),
            timeout=timeout,  # requests takes floats too
            method="POST",  # long selectors stay out of URLs
        )

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Run an instant query; return Prometheus's `result` list, or raise a typed error."""
        import requests
        from prometheus_api_client.exceptions import PrometheusApiClientException

        params: dict[str, Any] = {}
        if at is not None:
            params["time"] = f"{at:.3f}"
        params["timeout"] = f"{self.timeout:g}s"
        try:
            result: list[dict[str, Any]] = self._prom.custom_query(expr, params=params)
            return result
        except (requests.JSONDecodeError, KeyError, TypeError) as exc:  # something else answers there
            raise PrometheusQueryError(f"{self.url} did not answer like Prometheus: {_short(exc)}", query=expr) from exc
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise PrometheusUnreachable(
                f"Prometheus at {self.url} did not answer within {self.timeout:g}s: {_reason(exc)}"
            ) from exc
        except requests.RequestException as exc:
            raise PrometheusUnreachable(f"request to Prometheus at {self.url} failed: {_reason(exc)}") from exc
        except PrometheusApiClientException as exc:
            raise PrometheusQueryError(
                f"Prometheus at {self.url} refused the query: {_api_error(exc)}", query=expr
            ) from exc

    def scalar(self, expr: str, at: float | None = None) -> float | None:
        """The single value of an aggregated query; None when empty or NaN."""
        result = self.query(expr, at)
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusQueryError(
                f"expected one series, got {len(result)} (labels: {[r.get('metric') for r in result][:3]})",
                query=expr,
            )
        try:
            value = float(result[0]["value"][1])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusQueryError(f"unexpected result shape {result[0]!r}", query=expr) from exc
        return None if math.isnan(value) else value


def _reason(exc: BaseException) -> str:
    """The useful part of a requests connection error ('[Errno 111] Connection refused', 'timed out')."""
    import re

    text = str(exc)
    m = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    if m:
        return m.group(0).strip()
    if "timed out" in text.lower() or "timeout" in type(exc).__name__.lower():
        return "timed out"
    return _short(exc)


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 300 else text[:300] + "..."


def _api_error(exc: Exception) -> str:
    """Pull Prometheus's `errorType: error` out of the client's 'HTTP Status Code N (b'...')' text."""
    import json
    import re

    text = str(exc)
    m = re.search(r"\(b'(.*)'\)$", text, re.S)
    if m:
        try:
            body = json.loads(m.group(1).encode().decode("unicode_escape"))
            code = re.search(r"HTTP Status Code (\d+)", text)
            return f"HTTP {code.group(1) if code else '?'} {body.get('errorType')}: {body.get('error')}"
        except (ValueError, UnicodeDecodeError):
            pass
    return _short(exc)


def read_signals(
    selector: Selector,
    window: str = "5m",
    *,
    slo: SloTarget,
    prometheus_url: str | None = None,
    reader: PrometheusReader | None = None,
    at: float | datetime | None = None,
    timeout: float = 10.0,
    min_samples: int = 1,
    clock: Callable[[], float] = time.time,
) -> SignalSnapshot:
    """One snapshot of the signals for `selector` over `window`, evaluated at `at` (default now).

    Raises NoData when the window holds fewer than `min_samples` requests.
    """
    if reader is None:
        if prometheus_url is None:
            raise ValueError("read_signals needs prometheus_url or reader")
        reader = PrometheusReader(prometheus_url, timeout=timeout)
    if isinstance(at, datetime):
        at = at.timestamp()
    when = float(at) if at is not None else clock()
    queries = signal_queries(selector, slo, window)

    # The sample count first: without requests, every other number is meaningless.
    samples = reader.scalar(queries["samples"], when)
    if samples is None or round(samples) < min_samples:
        raise NoData(
            f"no requests in the last {window} for {selector} at {datetime.fromtimestamp(when).astimezone():%Y-%m-%dT%H:%M:%S%z} "
            f"({0 if samples is None else round(samples)} < {min_samples}): no traffic, a selector that "
            "matches nothing, or metrics not scraped yet"
        )
    values = {name: reader.scalar(expr, when) for name, expr in queries.items() if name != "samples"}
    return SignalSnapshot(
        time=when,
        window=window,
        selector=str(selector),
        samples=int(round(samples)),
        itl_samples=int(round(values.pop("itl_samples") or 0)),
        **values,
    )
