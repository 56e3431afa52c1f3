"""Signals from Prometheus: p99 TTFT/ITL, SLO burn rate and offered load over a window.

Queries come from `kvpilot.slo.promql`.  Any failure to read (connection refused, timeout, a
query error, an empty or NaN answer, no requests in the window) raises SignalsUnavailable, which
makes the loop pause: the tuner never judges, or changes, an engine on signals it cannot trust.

Per track (canary trials): the same queries with `kvpilot_dev_track="stable"|"canary"` added to the
selector, the series label the operator's monitor (and `kvpilot tune --local`'s scrape configs) put
on each track's engines.  No window is read shorter than `min_window_s` (a few scrape intervals:
a rate() needs two samples in its range), so a canary's short polls still read.
"""

from __future__ import annotations

import logging
import math

from kvpilot.api.vocabulary import SERIES_LABEL_TRACK, Track
from kvpilot.slo import promql
from kvpilot.slo.promql import Matcher, Selector
from kvpilot.slo.rules import worst_budget_left
from kvpilot.slo.signals import PrometheusReader, SignalsError
from kvpilot.tuner.core.loop import SignalsUnavailable
from kvpilot.tuner.core.objective import SLO, Measurement
from kvpilot.tuner.core.warmstart import WorkloadEstimate, lognormal_from_mean, lognormal_from_quantiles

log = logging.getLogger(__name__)


def parse_selector(text: str) -> Selector:
    """`job="twin",namespace="x"` -> Selector; empty -> every series with a job label."""
    text = text.strip().strip("{}")
    if not text:
        return Selector((Matcher("job", ".+", "=~"),))
    ms = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        for op in ("=~", "!~", "!=", "="):
            name, sep, value = part.partition(op)
            if sep:
                ms.append(Matcher(name.strip(), value.strip().strip('"'), op))
                break
        else:
            raise ValueError(f"--selector: expected name=\"value\", got {part!r}")
    return Selector(tuple(ms))


class PrometheusSignals:
    def __init__(self, url: str, *, selector: Selector | str = "", slo: SLO, objective: float = 0.99,
                 timeout_s: float = 5.0, min_window_s: float = 0.0) -> None:
        self.url = url.rstrip("/")
        self.min_window_s = min_window_s
        self.selector = parse_selector(selector) if isinstance(selector, str) else selector
        self.slo, self.objective, self.timeout_s = slo, objective, timeout_s
        self._reader = PrometheusReader(self.url, timeout=timeout_s)
        promql.check_bucket_edge("ttft", slo.ttft_seconds)
        promql.check_bucket_edge("itl", slo.itl_seconds)

    @classmethod
    def for_inferenceservice(cls, url: str, namespace: str, name: str, *, slo: SLO, objective: float = 0.99,
                             timeout_s: float = 5.0, min_window_s: float = 0.0) -> PrometheusSignals:
        """The signals of one InferenceService's pods in a cluster: the series its monitor labels with
        the namespace and kvpilot_dev_inferenceservice, the same selector the SLO rules use."""
        return cls(url, selector=Selector.for_inferenceservice(namespace, name), slo=slo, objective=objective,
                   timeout_s=timeout_s, min_window_s=min_window_s)

    # -- HTTP ----------------------------------------------------------------------------
    def query(self, expr: str) -> float | None:
        """A scalar from an instant query; None when the answer is empty or NaN.

        The HTTP side is the SLO reader's (prometheus-api-client, typed errors); any failure
        becomes SignalsUnavailable, with the error's class as the reason, so the loop pauses.
        """
        try:
            return self._reader.scalar(expr)
        except SignalsError as exc:
            raise SignalsUnavailable(type(exc).__name__, str(exc)[:300]) from None

    def _need(self, expr: str, what: str) -> float:
        v = self.query(expr)
        if v is None:
            raise SignalsUnavailable("NoData", f"no {what} in the window")
        return v

    # -- SignalSource ----------------------------------------------------------------------
    def _sel(self, track: Track | None) -> Selector:
        if track is None:
            return self.selector
        return self.selector.with_matchers((Matcher(SERIES_LABEL_TRACK, Track(track).value),))

    def _window(self, window_s: float) -> str:
        return promql.seconds_duration(max(window_s, self.min_window_s))

    def request_rate(self, window_s: float, track: Track | None = None) -> float:
        rate = self.query(promql.observations_rate("ttft", self._sel(track), self._window(window_s)))
        if not rate:
            where = f" on the {Track(track).value} track" if track is not None else ""
            raise SignalsUnavailable("NoTraffic", f"no requests{where} in the last {window_s:g}s")
        return rate

    def burn_rate(self, window_s: float, track: Track | None = None) -> float:
        """The faster-burning of the TTFT and ITL SLOs over the window (of one track, or all)."""
        self.request_rate(window_s, track)
        w, sel = self._window(window_s), self._sel(track)
        ttft = self._need(promql.burn_rate("ttft", self.slo.ttft_seconds, self.objective, sel, w), "TTFT")
        itl = self.query(promql.burn_rate("itl", self.slo.itl_seconds, self.objective, sel, w))
        return max(ttft, itl or 0.0)

    def measure(self, window_s: float, track: Track | None = None) -> Measurement:
        w, sel = self._window(window_s), self._sel(track)
        rate = self.request_rate(window_s, track)
        ttft = self._need(promql.quantile("ttft", 0.99, sel, w), "p99 TTFT")
        itl = self.query(promql.quantile("itl", 0.99, sel, w))
        burn = self.burn_rate(window_s, track)
        count = self.query(promql.observations("ttft", sel, w))
        return Measurement(ttft_p99=ttft, itl_p99=itl or 0.0, request_rate=rate, burn_rate=burn,
                           sample_count=int(count or 0))

    def measure_tracks(self, window_s: float) -> tuple[Measurement, Measurement]:
        """(stable, canary) over the same last `window_s` (one evaluation time would be tighter; the
        two reads are a few milliseconds apart, against windows of seconds)."""
        return self.measure(window_s, Track.STABLE), self.measure(window_s, Track.CANARY)


def estimate_workload(signals: PrometheusSignals, window_s: float = 3600.0) -> WorkloadEstimate:
    """The live workload over the window, from vLLM's metrics.

    Prompt and output lengths come from the per-request token histograms
    (`vllm:request_prompt_tokens`, `vllm:request_generation_tokens`) as lognormals whose spread is
    fitted to their p50 and p90 and whose mean is the histogram's own (sum over count); where those
    are missing, from token rates over the request rate.  The quantiles alone would set the median:
    read from buckets, they are interpolated, and lengths that all fall in one bucket read its
    midpoint (prompts of ~590 tokens read a median of 750 in the 500-1000 bucket, and the warm start
    then searched the twin under a 27% heavier load than the one served).
    """
    w = promql.seconds_duration(window_s)
    sel = signals.selector
    rate = signals.request_rate(window_s)
    out: list[tuple[float, float]] = []
    kind: promql.TokenCount
    for kind, total in (("prompt", promql.prompt_token_rate(sel, w)),
                        ("generation", promql.generation_token_rate(sel, w))):
        p50 = signals.query(promql.token_quantile(kind, 0.5, sel, w))
        p90 = signals.query(promql.token_quantile(kind, 0.9, sel, w))
        if p50 and p90 and math.isfinite(p50) and math.isfinite(p90):
            median, sigma = lognormal_from_quantiles(p50, p90)
            mean = signals.query(promql.token_mean(kind, sel, w))
            out.append(lognormal_from_mean(mean, sigma) if mean and math.isfinite(mean) else (median, sigma))
            continue
        tokens = signals.query(total)
        if not tokens:
            raise SignalsUnavailable("NoData", f"no {kind} token counts in the window")
        out.append(lognormal_from_mean(tokens / rate))
    (pm, ps), (om, os_) = out
    return WorkloadEstimate(rate, pm, ps, om, os_)


class BudgetLeft:
    """The share of an InferenceService's error budget left over its SLO period: the worse of its
    TTFT and ITL recordings (`kvpilot:slo_*_error_budget_remaining:ratio`, from the generated SLO
    rules).  None when it cannot be read (Prometheus unreachable, the rules not loaded, no traffic
    yet): the budget gate then holds trials back rather than guess."""

    def __init__(self, url: str, namespace: str, name: str, *, timeout_s: float = 5.0) -> None:
        self._reader = PrometheusReader(url.rstrip("/"), timeout=timeout_s)
        self.expr = worst_budget_left(Selector.of(namespace=namespace, inferenceservice=name))

    def __call__(self) -> float | None:
        try:
            value = self._reader.scalar(self.expr)
        except SignalsError as exc:
            log.warning("reading the error budget left failed: %s", exc)
            return None
        return None if value is None or math.isnan(value) else value
