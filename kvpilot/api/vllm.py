"""Facts about vLLM 0.33 that the API, the operator, the twin and the SLO code all rely on.

Kept in one place so that a vLLM upgrade is one diff.  Sources: vLLM's own CLI parser and
its `vllm/v1/metrics/loggers.py`.  The flags the typed engine fields render to are in `kvpilot.api.engine`.
"""

from __future__ import annotations

VLLM_VERSION = "0.33.0"
DEFAULT_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"

# Histogram bucket edges, seconds.  A latency SLO read from buckets is exact only at an edge.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)
# e2e, queue, prefill, decode and inference times share one set of edges in vLLM.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)

# Every vLLM metric is named `vllm:<name>`.  vLLM's GET /metrics (prometheus-fastapi-instrumentator's
# route, text format) keeps the colon for any Prometheus.  Served through prometheus_client's content
# negotiation instead (the app vLLM mounts under /metrics/, or a build whose /metrics negotiates),
# Prometheus 2.x's Accept header (OpenMetrics 1.0.0 without `escaping=allow-utf-8`) gets OpenMetrics
# with `escaping=underscores` from prometheus_client 0.26: sample names `vllm_<name>`
# (prometheus/client_python#1177; Prometheus 3.x asks for allow-utf-8 and keeps the colon).  A metric
# relabelling puts it back: replace `__name__` matching METRIC_NAME_ESCAPED_REGEX with
# METRIC_NAME_ESCAPED_REPLACEMENT.  No vLLM series is genuinely named `vllm_...`, so where the names
# arrive with the colon the rule changes nothing.
METRIC_PREFIX = "vllm:"
METRIC_NAME_ESCAPED_REGEX = "vllm_(.+)"
METRIC_NAME_ESCAPED_REPLACEMENT = "vllm:$1"

# Metric names (0.11+), and the pre-0.11 names that queries must still understand.
METRIC_TTFT = "vllm:time_to_first_token_seconds"
METRIC_ITL = "vllm:inter_token_latency_seconds"
METRIC_ITL_LEGACY = "vllm:time_per_output_token_seconds"
METRIC_E2E = "vllm:e2e_request_latency_seconds"
METRIC_QUEUE = "vllm:request_queue_time_seconds"
METRIC_PREFILL = "vllm:request_prefill_time_seconds"
METRIC_DECODE = "vllm:request_decode_time_seconds"
METRIC_ITERATION_TOKENS = "vllm:iteration_tokens_total"
METRIC_RUNNING = "vllm:num_requests_running"
METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_KV_USAGE = "vllm:kv_cache_usage_perc"
METRIC_KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
METRIC_CACHE_CONFIG = "vllm:cache_config_info"
METRIC_PREEMPTIONS = "vllm:num_preemptions_total"
METRIC_PROMPT_TOKENS = "vllm:prompt_tokens_total"
METRIC_GENERATION_TOKENS = "vllm:generation_tokens_total"
METRIC_REQUEST_SUCCESS = "vllm:request_success_total"
# Per-request token counts (histograms; edges 1, 2, 5, 10, ... up to max_model_len).
METRIC_REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
METRIC_REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"

# Defaults `vllm serve` resolves at start-up when the flags are not given.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
DEFAULT_BLOCK_SIZE = 16
DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD = 0
# GPUs with >= 70 GiB (not A100) get the larger defaults.
DEFAULT_BATCHED_TOKENS_LARGE_GPU, DEFAULT_MAX_NUM_SEQS_LARGE_GPU = 8192, 1024
DEFAULT_BATCHED_TOKENS_SMALL_GPU, DEFAULT_MAX_NUM_SEQS_SMALL_GPU = 2048, 256

KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
BLOCK_SIZES: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)

# Flags vLLM 0.33 no longer has: passing them makes `vllm serve` exit at start-up.
REMOVED_FLAGS: dict[str, str] = {
    "--max-num-partial-prefills": "removed in vLLM 0.33 (the V1 scheduler only ever allowed 1)",
    "--max-long-partial-prefills": "removed in vLLM 0.33 (the V1 scheduler only ever allowed 1)",
}
