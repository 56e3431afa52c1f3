"""PromQL builders: safe selectors and the latency, throughput and KV-cache queries kvpilot reads.

Every function here is pure and returns a PromQL string.  Label values are never pasted
into a query as they are: `quote()` writes them as PromQL string literals, so a namespace or
a name holding quotes, backslashes, newlines or braces stays a value and cannot change the
shape of the query.

vLLM renamed two metrics in 0.11 (`vllm:time_per_output_token_seconds` ->
`vllm:inter_token_latency_seconds`, `vllm:gpu_cache_usage_perc` -> `vllm:kv_cache_usage_perc`).
Queries read the new name and fall back to the old one with `or`: both sides are aggregated
to the same label set, so where the new series exist the old ones are ignored (vLLM emitted
both during the deprecation window, and summing them would count every token twice).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from kvpilot.api import vllm, vocabulary
from kvpilot.api.slo import MIN_ERROR_BUDGET

# The series label of the pod label `kvpilot.dev/inferenceservice`.
ISVC_POD_LABEL = vocabulary.SERIES_LABEL_INFERENCESERVICE

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# prometheus/common model.ParseDuration: each unit at most once, largest first (`1h30m`, not `30m1h`
# nor `5m5m`); the total must fit Go's time.Duration (int64 nanoseconds, about 292 years).
_DURATION = re.compile(
    r"^(?:([0-9]+)y)?(?:([0-9]+)w)?(?:([0-9]+)d)?(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?(?:([0-9]+)ms)?$"
)
_DURATION_UNITS_MS = (365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1)
_MAX_DURATION_NS = (1 << 63) - 1
# Grafana fills these in before a query reaches Prometheus (dashboards only).
GRAFANA_RANGES = ("$__rate_interval", "$__interval", "$__range")

MatchOp = Literal["=", "!=", "=~", "!~"]
_OPS: tuple[str, ...] = ("=", "!=", "=~", "!~")


# Characters `quote` must escape (or refuse); a value without any is quoted as it is.
_NEEDS_ESCAPE = re.compile("[\\\\\"\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


@functools.lru_cache(maxsize=4096)
def quote(value: str) -> str:
    """A PromQL double-quoted string literal holding exactly `value`.

    PromQL strings use Go's escapes.  Backslash and double quote are escaped; control
    characters (newline, tab, NUL, DEL...) are written as escapes so the query stays one line
    and the lexer never sees a raw control byte.  Everything else, braces and non-ASCII
    letters included, is safe inside the quotes.  (Cached: a rule file quotes the same
    namespace and name hundreds of times.)
    """
    if _NEEDS_ESCAPE.search(value) is None:
        return f'"{value}"'
    out: list[str] = ['"']
    for ch in value:
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif 0xD800 <= ord(ch) <= 0xDFFF:
            # A lone surrogate is not a character; Prometheus would reject the query.
            raise ValueError(f"label value {value!r} is not valid Unicode (lone surrogate)")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F or 0x80 <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


@functools.lru_cache(maxsize=256)
def _duration_ms(window: str) -> int:
    """Milliseconds in a Prometheus duration, or ValueError saying what Prometheus would say."""
    match = _DURATION.match(window) if isinstance(window, str) and window else None
    if match is None:
        shown = repr(window[:40]) if isinstance(window, str) else type(window).__name__
        raise ValueError(
            f"window {shown} is not a Prometheus duration: use numbers with units, largest first and each "
            "unit once (y, w, d, h, m, s, ms), e.g. '5m', '600s' or '1h30m'"
        )
    total_ns = 0
    for digits, unit_ms in zip(match.groups(), _DURATION_UNITS_MS, strict=True):
        if digits is None:
            continue
        # Python ints do not overflow; Go's do, and Prometheus says "out of range" instead.
        if len(digits) > 30:
            total_ns = _MAX_DURATION_NS + 1
        else:
            total_ns += int(digits) * unit_ms * 1_000_000
        if total_ns > _MAX_DURATION_NS:
            raise ValueError(f"window {window[:40]!r} is out of range: Prometheus durations end at about 292 years")
    return total_ns // 1_000_000


def validate_duration(window: str, *, grafana: bool = True) -> str:
    """Return `window` if Prometheus accepts it as a range (`5m`, `600s`, `1h30m`; positive, at
    most ~292 years), else raise ValueError.  With `grafana`, Grafana's range variables pass too
    (they are filled in before the query reaches Prometheus)."""
    if grafana and window in GRAFANA_RANGES:
        return window
    if _duration_ms(window) <= 0:
        raise ValueError(f"window {window!r} must be longer than 0 (Prometheus refuses an empty range)")
    return window


def duration_seconds(window: str) -> float:
    """Seconds in a Prometheus duration string (`1h30m` -> 5400.0)."""
    validate_duration(window, grafana=False)
    return _duration_ms(window) / 1000.0


def seconds_duration(seconds: float) -> str:
    """A Prometheus duration for a number of seconds (whole seconds; at least 1s)."""
    return f"{max(1, round(seconds))}s"


@dataclass(frozen=True)
class Matcher:
    """One label matcher: `name op "value"`."""

    name: str
    value: str
    op: MatchOp = "="

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _LABEL_NAME.match(self.name):
            shown = repr(self.name[:60]) if isinstance(self.name, str) else type(self.name).__name__
            raise ValueError(f"label name {shown} is not a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)")
        if self.name == "__name__":
            raise ValueError(
                "label __name__ is the metric name, which each query sets itself; select series by other labels"
            )
        if self.name.startswith("__"):
            raise ValueError(
                f"label name {self.name!r} begins with __, which Prometheus reserves for its own use; "
                "stored series never carry such labels"
            )
        if self.op not in _OPS:
            raise ValueError(f"matcher operator {self.op!r} is not one of {', '.join(_OPS)}")
        if not isinstance(self.value, str):
            raise ValueError(f"label {self.name}: value must be a string, got {type(self.value).__name__}")

    def render(self) -> str:
        return f"{self.name}{self.op}{quote(self.value)}"


@dataclass(frozen=True)
class Selector:
    """Which series belong to one serving target: a small typed set of label matchers.

    Build one for an InferenceService in a cluster (`for_inferenceservice`), or for a local
    process the tuner started (`for_job`, `for_model`, `of`).  `render()` gives the text
    inside `{...}`, with every value quoted.
    """

    matchers: tuple[Matcher, ...]

    def __post_init__(self) -> None:
        if not self.matchers:
            # An empty selector would read every vLLM in the Prometheus: never what is meant.
            raise ValueError("a selector needs at least one label matcher")

    @classmethod
    def of(cls, labels: Mapping[str, str] | None = None, /, **more: str) -> Selector:
        """Equality matchers from a mapping and/or keywords: `Selector.of(job="twin")`."""
        merged = {**(labels or {}), **more}
        return cls(tuple(Matcher(k, v) for k, v in merged.items()))

    @classmethod
    def for_inferenceservice(cls, namespace: str, name: str) -> Selector:
        """The pods of one InferenceService, as Prometheus labels them in a cluster."""
        return cls((Matcher("namespace", namespace), Matcher(ISVC_POD_LABEL, name)))

    @classmethod
    def for_job(cls, job: str) -> Selector:
        return cls((Matcher("job", job),))

    @classmethod
    def for_model(cls, model_name: str, namespace: str | None = None) -> Selector:
        """Series by vLLM's own `model_name` label (the served model name)."""
        ms = [Matcher("model_name", model_name)]
        if namespace is not None:
            ms.insert(0, Matcher("namespace", namespace))
        return cls(tuple(ms))

    def with_matchers(self, extra: Iterable[Matcher]) -> Selector:
        return Selector(self.matchers + tuple(extra))

    def render(self) -> str:
        return ",".join(m.render() for m in self.matchers)

    def __str__(self) -> str:
        return "{" + self.render() + "}"


def series(metric: str, selector: Selector, *extra: Matcher) -> str:
    """`metric{selector,extra...}`."""
    inner = selector.with_matchers(extra).render()
    return f"{metric}{{{inner}}}"


def num(value: float) -> str:
    """A number as PromQL text: shortest exact form, no trailing `.0` (0.5, 14.4, 6, 1e-05)."""
    text = repr(float(value))
    return text[:-2] if text.endswith(".0") else text


def le_matcher(edge: float) -> Matcher:
    """Match the bucket whose upper bound is `edge`, however the exposition wrote it.

    Python's prometheus_client writes `le="1.0"`, Go clients and Prometheus 3 (which
    normalises `le` on ingestion) write `le="1"`: match both for whole numbers.
    """
    text = repr(float(edge))
    if text.endswith(".0"):
        return Matcher("le", f"{text[:-2]}(\\.0)?", "=~")
    return Matcher("le", text)


# --- latency histograms ------------------------------------------------------------------

Histogram = Literal["ttft", "itl", "e2e", "queue", "prefill", "decode"]

# (current name, pre-0.11 name or None)
HISTOGRAMS: dict[str, tuple[str, str | None]] = {
    "ttft": (vllm.METRIC_TTFT, None),
    "itl": (vllm.METRIC_ITL, vllm.METRIC_ITL_LEGACY),
    "e2e": (vllm.METRIC_E2E, None),
    "queue": (vllm.METRIC_QUEUE, None),
    "prefill": (vllm.METRIC_PREFILL, None),
    "decode": (vllm.METRIC_DECODE, None),
}

BUCKET_EDGES: dict[str, tuple[float, ...]] = {
    "ttft": vllm.TTFT_BUCKETS,
    "itl": vllm.ITL_BUCKETS,
    "e2e": vllm.REQUEST_LATENCY_BUCKETS,
    "queue": vllm.REQUEST_LATENCY_BUCKETS,
    "prefill": vllm.REQUEST_LATENCY_BUCKETS,
    "decode": vllm.REQUEST_LATENCY_BUCKETS,
}


def _names(hist: str) -> tuple[str, ...]:
    try:
        new, old = HISTOGRAMS[hist]
    except KeyError:
        raise ValueError(f"unknown histogram {hist!r}; one of {', '.join(HISTOGRAMS)}") from None
    return (new,) if old is None else (new, old)


def _either(parts: Iterable[str]) -> str:
    """`(a) or (b)`: the first alternative that has data, in label sets that line up."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    return " or ".join(f"({p})" for p in parts)


def quantile(hist: Histogram, q: float, selector: Selector, window: str = "5m") -> str:
    """The q-quantile of a vLLM latency histogram over `window`, all matching series pooled."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    validate_duration(window)
    buckets = _either(
        f"sum by (le) (rate({series(name + '_bucket', selector)}[{window}]))" for name in _names(hist)
    )
    return f"histogram_quantile({q:g}, {buckets})"


def observations_rate(hist: Histogram, selector: Selector, window: str = "5m") -> str:
    """Observations per second of a histogram (requests/s for TTFT, tokens/s for ITL)."""
    validate_duration(window)
    return _either(f"sum(rate({series(name + '_count', selector)}[{window}]))" for name in _names(hist))


def histogram_mean(hist: Histogram, selector: Selector, window: str = "5m") -> str:
    """The mean of a histogram's observations over `window` (its sum over its count)."""
    validate_duration(window)
    return _either(f"sum(rate({series(name + '_sum', selector)}[{window}])) / "
                   f"sum(rate({series(name + '_count', selector)}[{window}]))" for name in _names(hist))


def observations(hist: Histogram, selector: Selector, window: str = "5m") -> str:
    """How many observations a histogram took in `window` (the sample count behind a quantile)."""
    validate_duration(window)
    return _either(f"sum(increase({series(name + '_count', selector)}[{window}]))" for name in _names(hist))


def good_rate(hist: Histogram, threshold: float, selector: Selector, window: str = "5m") -> str:
    """Observations per second at or under `threshold` (a bucket edge)."""
    validate_duration(window)
    check_bucket_edge(hist, threshold)
    le = le_matcher(threshold)
    return _either(
        f"sum(rate({series(name + '_bucket', selector, le)}[{window}]))" for name in _names(hist)
    )


def error_ratio(hist: Histogram, threshold: float, selector: Selector, window: str = "5m") -> str:
    """Fraction of observations slower than `threshold` over `window`: `1 - good / all`.

    NaN when nothing was observed (0/0): no traffic is not a perfect SLI.
    """
    return f"1 - ({good_rate(hist, threshold, selector, window)}) / ({observations_rate(hist, selector, window)})"


def burn_rate(hist: Histogram, threshold: float, objective: float, selector: Selector, window: str = "5m") -> str:
    """How fast the error budget burns: error ratio / (1 - objective); 1 spends it exactly in the period."""
    budget = error_budget(objective)
    return f"({error_ratio(hist, threshold, selector, window)}) / {num(budget)}"


def error_budget(objective: float) -> float:
    if not 0.0 < objective < 1.0:
        raise ValueError(f"objective {objective} must be strictly between 0 and 1 (e.g. 0.99)")
    # Round away float noise: 1 - 0.999 is 0.0010000000000000009.
    budget = round(1.0 - objective, 12)
    if budget < MIN_ERROR_BUDGET:
        raise ValueError(
            f"objective {objective} leaves an error budget below one in a million; use at most 0.999999"
        )
    return budget


def check_bucket_edge(hist: str, threshold: float) -> float:
    """Return `threshold` if it is a bucket edge of the histogram, else raise ValueError naming the edges.

    An SLO read from buckets is exact only at an edge; between edges it silently moves.
    """
    edges = BUCKET_EDGES.get(hist)
    if edges is None:
        raise ValueError(f"unknown histogram {hist!r}")
    if not any(abs(threshold - e) <= 1e-9 * max(1.0, e) for e in edges):
        name = HISTOGRAMS[hist][0]
        raise ValueError(
            f"{threshold:g}s is not a bucket edge of {name}; allowed: {', '.join(f'{e:g}' for e in edges)}"
        )
    return threshold


# --- rates, gauges -------------------------------------------------------------------------

def request_rate(selector: Selector, window: str = "5m") -> str:
    """Finished requests per second (every finish reason)."""
    validate_duration(window)
    return f"sum(rate({series(vllm.METRIC_REQUEST_SUCCESS, selector)}[{window}]))"


TokenCount = Literal["prompt", "generation"]
_TOKEN_HISTOGRAMS: dict[str, str] = {
    "prompt": vllm.METRIC_REQUEST_PROMPT_TOKENS,
    "generation": vllm.METRIC_REQUEST_GENERATION_TOKENS,
}


def token_quantile(kind: TokenCount, q: float, selector: Selector, window: str = "5m") -> str:
    """The q-quantile of the tokens per request (prompt or generated) over `window`."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    validate_duration(window)
    name = _TOKEN_HISTOGRAMS[kind]
    return f"histogram_quantile({q:g}, sum by (le) (rate({series(name + '_bucket', selector)}[{window}])))"


def token_mean(kind: TokenCount, selector: Selector, window: str = "5m") -> str:
    """The mean tokens per request (prompt or generated) over `window`: the histogram's sum over its
    count, exact where a quantile is interpolated inside a bucket."""
    validate_duration(window)
    name = _TOKEN_HISTOGRAMS[kind]
    return (f"sum(rate({series(name + '_sum', selector)}[{window}])) / "
            f"sum(rate({series(name + '_count', selector)}[{window}]))")


def prompt_token_rate(selector: Selector, window: str = "5m") -> str:
    validate_duration(window)
    return f"sum(rate({series(vllm.METRIC_PROMPT_TOKENS, selector)}[{window}]))"


def generation_token_rate(selector: Selector, window: str = "5m") -> str:
    validate_duration(window)
    return f"sum(rate({series(vllm.METRIC_GENERATION_TOKENS, selector)}[{window}]))"


def preemption_rate(selector: Selector, window: str = "5m") -> str:
    """Preemptions per second: requests evicted from the KV cache to be recomputed later."""
    validate_duration(window)
    return f"sum(rate({series(vllm.METRIC_PREEMPTIONS, selector)}[{window}]))"


Agg = Literal["avg", "max", "min", "sum"]


def kv_cache_usage(selector: Selector, agg: Agg = "avg", window: str | None = None) -> str:
    """KV-cache usage, 0..1, across replicas (`avg` for the tuner, `max` for saturation).

    With `window`, the gauge is first averaged over time in each replica.
    """
    if agg not in ("avg", "max", "min", "sum"):
        raise ValueError(f"aggregation {agg!r} is not avg, max, min or sum")
    parts = []
    for name in (vllm.METRIC_KV_USAGE, vllm.METRIC_KV_USAGE_LEGACY):
        inner = series(name, selector)
        if window is not None:
            inner = f"avg_over_time({inner}[{validate_duration(window)}])"
        parts.append(f"{agg}({inner})")
    return _either(parts)


def requests_running(selector: Selector) -> str:
    return f"sum({series(vllm.METRIC_RUNNING, selector)})"


def requests_waiting(selector: Selector) -> str:
    return f"sum({series(vllm.METRIC_WAITING, selector)})"


def up(selector: Selector) -> str:
    """Scrape health of the matching targets (1 per target that answered its last scrape)."""
    return f"sum(up{{{selector.render()}}})"


def metrics_present(selector: Selector) -> str:
    """The series every healthy vLLM exports; `absent()` of this fires when none are scraped."""
    return series(vllm.METRIC_RUNNING, selector)


def cache_config(selector: Selector) -> str:
    """`vllm:cache_config_info`: the KV-cache config in force, in its labels."""
    return series(vllm.METRIC_CACHE_CONFIG, selector)
