"""vLLM's Prometheus metrics, with vLLM 0.33's exact names, help texts, labels and bucket edges.

The twin's server records what vLLM's frontend and `PrometheusStatLogger` record, from the same
moments: per engine step (scheduler gauges, token counters, the iteration-tokens histogram) and
per request (TTFT, inter-token gaps, and the request-phase histograms when a request finishes).
Each `VllmMetrics` has its own `CollectorRegistry`, so several twins in one process (tests) never
collide and nothing leaks into prometheus_client's global registry.

Labels are `model_name` and `engine` (the engine index, "0"), plus `finished_reason` on
`vllm:request_success_total`; `vllm:cache_config_info` carries the cache config as labels.
Metrics named `kvpilot_twin_*` are the twin's own, not vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, choose_encoder, generate_latest

from kvpilot.api import vllm, vocabulary

# vLLM serves GET /metrics from prometheus-fastapi-instrumentator's route (`expose()`), registered
# before the prometheus_client ASGI app it mounts at /metrics: `generate_latest` under
# CONTENT_TYPE_LATEST whatever the Accept header, so the `vllm:` names reach any Prometheus as
# declared (`render()`).  Only `/metrics/` and deeper paths reach the mount, which negotiates
# (`exposition()`).  tests/vllm/test_rendered_serve.py holds the twin to real vLLM on both paths.
CONTENT_TYPE = CONTENT_TYPE_LATEST
# vLLM's FinishReason strings (`FINISH_REASON_STRINGS` in vllm/v1/engine): the Prometheus logger
# exports every one from the start, at zero, so a query on any of them finds a series.  The twin
# itself only ever finishes with stop, length or abort.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error", "repetition")
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                               8192, 16384)
REQUEST_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)

METRIC_INFERENCE = "vllm:request_inference_time_seconds"
METRIC_TPOT_REQUEST = "vllm:request_time_per_output_token_seconds"
METRIC_MAX_TOKENS_PARAM = "vllm:request_params_max_tokens"
METRIC_N_PARAM = "vllm:request_params_n"
METRIC_PREFIX_QUERIES = "vllm:prefix_cache_queries"
METRIC_PREFIX_HITS = "vllm:prefix_cache_hits"


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's edges for token-count histograms."""
    edges: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(edges)
            edges.append(value)
        scale *= 10


def _prom_name(name: str) -> str:
    """prometheus_client appends `_total` to counters itself; vLLM declares them without it."""
    return name.removesuffix("_total")


def cache_config_labels(info: Mapping[str, Any]) -> dict[str, str]:
    """Label values as vLLM's `CacheConfig.metrics_info()` renders them: `str()` of each value,
    so None is "None" and booleans are "True"/"False"."""
    return {key: str(value) for key, value in info.items()}


class VllmMetrics:
    """The /metrics of one engine (index 0) serving one model."""

    def __init__(self, model_name: str, *, max_model_len: int, cache_config: Mapping[str, Any],
                 engine_index: int = 0) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model_name", "engine")
        values = (model_name, str(engine_index))
        reg = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(_prom_name(name), doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*values)

        # Scheduler state, set after every engine step.
        self.running = gauge(vllm.METRIC_RUNNING, "Number of requests in model execution batches.")
        self.waiting = gauge(vllm.METRIC_WAITING, "Number of requests waiting to be processed.")
        self.kv_usage = gauge(vllm.METRIC_KV_USAGE, "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(METRIC_PREFIX_QUERIES,
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter(METRIC_PREFIX_HITS,
                                   "Prefix cache hits, in terms of number of cached tokens.")
        # Counters.
        self.preemptions = counter(vllm.METRIC_PREEMPTIONS,
                                   "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter(vllm.METRIC_PROMPT_TOKENS, "Number of prefill tokens processed.")
        self.generation_tokens = counter(vllm.METRIC_GENERATION_TOKENS,
                                         "Number of generation tokens processed.")
        success = Counter(_prom_name(vllm.METRIC_REQUEST_SUCCESS), "Count of successfully processed requests.",
                          (*labels, "finished_reason"), registry=reg)
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        # Histograms of counts.
        token_edges = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens_request = histogram(vllm.METRIC_REQUEST_PROMPT_TOKENS,
                                               "Number of prefill tokens processed.", token_edges)
        self.generation_tokens_request = histogram(vllm.METRIC_REQUEST_GENERATION_TOKENS,
                                                   "Number of generation tokens processed.", token_edges)
        self.iteration_tokens = histogram(vllm.METRIC_ITERATION_TOKENS,
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKENS_BUCKETS)
        self.max_tokens_param = histogram(METRIC_MAX_TOKENS_PARAM,
                                          "Histogram of the max_tokens request parameter.", token_edges)
        self.n_param = histogram(METRIC_N_PARAM, "Histogram of the n request parameter.", REQUEST_N_BUCKETS)
        # Histograms of timings.
        self.ttft = histogram(vllm.METRIC_TTFT, "Histogram of time to first token in seconds.",
                              vllm.TTFT_BUCKETS)
        self.itl = histogram(vllm.METRIC_ITL, "Histogram of inter-token latency in seconds.",
                             vllm.ITL_BUCKETS)
        self.tpot_request = histogram(METRIC_TPOT_REQUEST,
                                      "Histogram of time_per_output_token_seconds per request.",
                                      vllm.ITL_BUCKETS)
        latency = vllm.REQUEST_LATENCY_BUCKETS
        self.e2e = histogram(vllm.METRIC_E2E, "Histogram of e2e request latency in seconds.", latency)
        self.queue = histogram(vllm.METRIC_QUEUE, "Histogram of time spent in WAITING phase for request.",
                               latency)
        self.inference = histogram(METRIC_INFERENCE,
                                   "Histogram of time spent in RUNNING phase for request.", latency)
        self.prefill = histogram(vllm.METRIC_PREFILL,
                                 "Histogram of time spent in PREFILL phase for request.", latency)
        self.decode = histogram(vllm.METRIC_DECODE, "Histogram of time spent in DECODE phase for request.",
                                latency)
        # The twin's own health (not vLLM metrics): does the real-time loop keep the simulated pace?
        self.twin_steps = Counter(vocabulary.METRIC_TWIN_STEPS_TOTAL, "Engine steps the twin has run.",
                                  labels, registry=reg).labels(*values)
        self.twin_simulated = Counter(vocabulary.METRIC_TWIN_SIMULATED_SECONDS_TOTAL,
                                      "Sum of the simulated durations of the twin's engine steps.",
                                      labels, registry=reg).labels(*values)
        self.twin_behind = Counter(vocabulary.METRIC_TWIN_BEHIND_SECONDS_TOTAL,
                                   "Time the twin's engine loop fell behind the simulated timeline and "
                                   "dropped (CPU too busy to keep real time); 0 when it keeps up.",
                                   labels, registry=reg).labels(*values)
        self.twin_aborted = Counter(vocabulary.METRIC_TWIN_ABORTED_REQUESTS_TOTAL,
                                    "Requests aborted before they finished (client gone, shutdown). vLLM "
                                    "counts these nowhere: its frontend drops an aborted request's stats.",
                                    labels, registry=reg).labels(*values)
        # Info metric emulated as a gauge set to 1, as vLLM does (multiprocess mode has no Info).
        info = cache_config_labels({**cache_config, "engine": str(engine_index)})
        Gauge(vllm.METRIC_CACHE_CONFIG, "Information of the LLMEngine CacheConfig", tuple(info),
              registry=reg).labels(**info).set(1)

    # ------------------------------------------------------------------ recording

    def record_step(self, *, num_running: int, num_waiting: int, kv_cache_usage: float,
                    num_preemptions: int, num_prompt_tokens: int, num_generation_tokens: int,
                    prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        """One engine step.  As in vLLM, `num_prompt_tokens` counts the whole prompt of each
        request that produced its first token in this step, and the iteration-tokens histogram
        observes prompt + generation tokens so counted (not the scheduled chunk sizes)."""
        self.set_scheduler_state(num_running=num_running, num_waiting=num_waiting,
                                 kv_cache_usage=kv_cache_usage)
        if num_preemptions:
            self.preemptions.inc(num_preemptions)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)
        if prefix_queries:
            self.prefix_queries.inc(prefix_queries)
        if prefix_hits:
            self.prefix_hits.inc(prefix_hits)
        self.iteration_tokens.observe(num_prompt_tokens + num_generation_tokens)

    def set_scheduler_state(self, *, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_cache_usage)

    def record_engine_step(self, duration_s: float) -> None:
        self.twin_steps.inc()
        self.twin_simulated.inc(duration_s)

    def record_behind(self, seconds: float) -> None:
        self.twin_behind.inc(seconds)

    def record_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def record_inter_token(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def record_finished(self, *, finish_reason: str, e2e_s: float, queued_s: float, prefill_s: float,
                        decode_s: float, inference_s: float, num_prompt_tokens: int,
                        num_generation_tokens: int, max_tokens_param: int | None) -> None:
        """A request the engine finished (stop or length)."""
        self.request_success[finish_reason].inc()
        self.e2e.observe(e2e_s)
        self.queue.observe(queued_s)
        self.prefill.observe(prefill_s)
        self.decode.observe(decode_s)
        self.inference.observe(inference_s)
        self.prompt_tokens_request.observe(num_prompt_tokens)
        self.generation_tokens_request.observe(num_generation_tokens)
        self.n_param.observe(1)
        if max_tokens_param:
            self.max_tokens_param.observe(max_tokens_param)
        if num_generation_tokens > 1:
            self.tpot_request.observe(decode_s / (num_generation_tokens - 1))

    def record_aborted(self) -> None:
        """A request aborted before it finished (client gone, shutdown).  vLLM's frontend pops an
        aborted request's state without recording it (`OutputProcessor.abort_requests`), so no
        vLLM metric moves, `vllm:request_success_total{finished_reason="abort"}` included; only
        the twin's own counter does."""
        self.twin_aborted.inc()

    def render(self) -> bytes:
        """What vLLM's GET /metrics answers: the text format, names as declared (CONTENT_TYPE)."""
        return generate_latest(self.registry)

    def exposition(self, accept: str | None, names: Sequence[str] = ()) -> tuple[bytes, str]:
        """(body, Content-Type) as prometheus_client's `make_asgi_app` answers, which vLLM mounts under
        /metrics/: the format from the Accept header (several joined by ",") by `choose_encoder`, and
        only the families in `names` (its `name[]` parameter) when some are given.  To Prometheus
        2.x's Accept header (OpenMetrics 1.0.0 without `escaping=allow-utf-8`) prometheus_client 0.26
        answers OpenMetrics with `escaping=underscores`: sample names `vllm_...` instead of `vllm:...`
        (prometheus/client_python#1177)."""
        encoder, content_type = choose_encoder(accept or "")
        registry = self.registry.restricted_registry(list(names)) if names else self.registry
        return encoder(registry), content_type
