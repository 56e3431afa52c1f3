# Over 500 lines: the InferenceService's models are the CRD's one source, read top to bottom in spec order.
"""The InferenceService resource: pydantic models for its spec and status.

These models are the single source of truth: the CRD schema is generated from them
(`kvpilot crd`), `kvpilot validate` and the operator validate with them, and the tuner
reads the tuning space from them.  camelCase on the wire, snake_case in Python.

Cross-field rules live in `rules.py` as plain functions; each model's after-validator
calls them and raises every finding at once with its own field path.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator
from pydantic.alias_generators import to_camel, to_snake

from kvpilot.api import kube, rules, tracing, tuned, vllm, vocabulary
from kvpilot.api.engine import (
    MAX_BATCHED_TOKENS_LIMIT,
    MAX_KV_CACHE_MEMORY_BYTES,
    MAX_MODEL_LEN_LIMIT,
    NOT_A_FLAG_PATTERN,
)
from kvpilot.api.slo import MIN_ERROR_BUDGET


class _Wire(BaseModel):
    """Base: camelCase aliases, unknown fields refused (a typo must not be silently ignored)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class TwinSpec(_Wire):
    gpu: str = Field(
        "H100-80GB",
        min_length=1,
        max_length=64,
        description="GPU preset the engine twin simulates (A100-80GB, H100-80GB, H200, L40S, L4, A10G).",
    )
    startup_delay_seconds: float = Field(
        0.0, ge=0, le=3600, description="Seconds the twin waits before opening its port, mimicking model load."
    )


def _tuned_field(declared: tuned.TunedField, description: str) -> Any:
    """spec.engine.<declared.name>: its default and legal limits as kvpilot.api.tuned declares them."""
    if declared.exclusive:
        return Field(declared.default, gt=declared.low, lt=declared.high, description=description)
    return Field(declared.default, ge=declared.low, le=declared.high, description=description)


class EngineSpec(_Wire):
    kind: Literal["vllm", "twin"] = Field(
        "vllm", description="vllm runs the vLLM image; twin runs kvpilot's GPU-less engine twin with the same flags."
    )
    image: kube.ImageReference = Field(vllm.DEFAULT_IMAGE, description="vLLM container image (engine.kind vllm).")
    max_num_batched_tokens: int = _tuned_field(
        tuned.MAX_NUM_BATCHED_TOKENS,
        description="--max-num-batched-tokens: the per-step token budget, i.e. the chunked-prefill chunk size. Tuned.",
    )
    gpu_memory_utilization: float | None = _tuned_field(
        tuned.GPU_MEMORY_UTILIZATION,
        description=(
            "--gpu-memory-utilization: fraction of GPU memory vLLM may use (weights, activations, KV cache). "
            f"Unset means vLLM's default {vllm.DEFAULT_GPU_MEMORY_UTILIZATION}. Not together with kvCacheMemoryBytes. Tuned."
        ),
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        le=MAX_KV_CACHE_MEMORY_BYTES,
        description="--kv-cache-memory-bytes: a fixed KV-cache size per GPU (at most 1 TiB); overrides "
        "gpuMemoryUtilization, so not both.",
    )
    max_num_seqs: int = _tuned_field(
        tuned.MAX_NUM_SEQS, description="--max-num-seqs: most sequences running at once. Tuned."
    )
    max_model_len: int | None = Field(
        None, ge=1, le=MAX_MODEL_LEN_LIMIT, description="--max-model-len: longest prompt plus output; unset = model's own."
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="--tensor-parallel-size: GPUs per replica.")
    block_size: Literal[1, 8, 16, 32, 64, 128, 256] = Field(
        16, description="--block-size: tokens per KV-cache block."
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"] = Field(
        "auto", description="--kv-cache-dtype: data type of the KV cache."
    )
    long_prefill_token_threshold: int = Field(
        0, ge=0, le=MAX_BATCHED_TOKENS_LIMIT, description="--long-prefill-token-threshold: cap on one request's chunk (0 = none)."
    )
    extra_args: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list,
        max_length=256,
        description="More `vllm serve` arguments, passed through after the typed flags. Read as vLLM reads them "
        "(any unambiguous prefix of a flag, `_` for `-`): none may land on a typed flag, one kvpilot sets "
        "(--port, --host, --model, --served-model-name) or one that breaks what it relies on (--config, --help, "
        "--uds, --headless, --disable-log-stats), nor be an ambiguous prefix.",
    )
    twin: TwinSpec = Field(default_factory=TwinSpec, description="Settings for engine.kind twin only.")

    def in_force(self, declared: tuned.TunedField) -> int | float | None:
        """A tuned field as vLLM runs it: vLLM's value when the field is unset, None when another
        field overrides it (gpuMemoryUtilization under kvCacheMemoryBytes)."""
        if declared.overridden_by is not None and getattr(self, to_snake(declared.overridden_by)) is not None:
            return None
        value: int | float | None = getattr(self, declared.attr)
        return declared.unset_means if value is None else value

    @property
    def effective_gpu_memory_utilization(self) -> float | None:
        return self.in_force(tuned.GPU_MEMORY_UTILIZATION)

    @model_validator(mode="after")
    def _cross_fields(self) -> EngineSpec:
        rules.raise_issues("EngineSpec", rules.engine_issues(self))
        return self


class SecretKeyRef(_Wire):
    name: kube.SecretName = Field(..., description="Name of a Secret in the same namespace (a DNS-1123 subdomain).")
    key: kube.SecretKey = Field("HF_TOKEN", description="Key in that Secret.")


class ConfigMapKeyRef(_Wire):
    name: kube.ConfigMapName = Field(..., description="Name of a ConfigMap in the same namespace (a DNS-1123 subdomain).")
    key: kube.ConfigMapKey = Field("config.json", description="Key in that ConfigMap.")


class ModelConfigSpec(_Wire):
    config_map_ref: ConfigMapKeyRef = Field(
        ..., description="A ConfigMap key holding the model's Hugging Face config.json."
    )


class ResourcesSpec(_Wire):
    gpus: int = Field(1, ge=0, le=64, description="GPUs per replica; at least engine.tensorParallelSize for vllm.")
    gpu_resource: kube.ExtendedResourceName = Field(
        "nvidia.com/gpu", description="Extended resource name of the GPU (domain/name, e.g. nvidia.com/gpu, amd.com/gpu)."
    )
    cpu: kube.CpuQuantity | None = Field(
        None, description="CPU request and limit per replica (a Kubernetes quantity, 1m to 4096)."
    )
    memory: kube.ByteQuantity = Field(
        "32Gi", description="Memory request and limit per replica (a Kubernetes quantity, whole bytes up to 1Pi)."
    )
    shm_size: kube.ByteQuantity = Field(
        "8Gi", description="Size of the memory-backed /dev/shm volume (whole bytes up to 1Pi)."
    )
    gpu_type: kube.LabelValue | None = Field(
        None,
        description="The GPU model the pods run on: a value of NVIDIA's node label nvidia.com/gpu.product (e.g. "
        "NVIDIA-H100-80GB-HBM3, NVIDIA-A100-SXM4-80GB, NVIDIA-H200, NVIDIA-L4) or a GPU name of the engine twin "
        "(H100-80GB, A100-80GB, H200, L40S, L4, A10G). The pods get the node selector "
        f"{vocabulary.LABEL_GPU_PRODUCT}=<product>, and `kvpilot validate --predict` sizes vLLM's memory for it. "
        "GPUs the twin does not model are allowed; the prediction then says the GPU is unknown.",
    )


class RolloutSpec(_Wire):
    max_surge: int = Field(
        1, ge=0, le=64, description="Extra replicas during a rollout; 0 with one replica means downtime (see allowDowntime)."
    )
    shutdown_timeout_seconds: int = Field(
        30, ge=0, le=3600, description="--shutdown-timeout: seconds vLLM drains in-flight requests after SIGTERM."
    )
    pre_stop_seconds: int = Field(
        10, ge=0, le=600, description="preStop sleep so endpoints drop the pod before it gets SIGTERM."
    )
    startup_timeout_seconds: int = Field(
        1800, ge=10, le=86400, description="Longest a model may take to load before the startup probe gives up."
    )
    progress_deadline_seconds: int = Field(
        3600,
        ge=30,
        le=172800,
        description="Deployment progressDeadlineSeconds; past it the operator rolls back to lastGoodEngine.",
    )
    allow_downtime: bool = Field(
        False, description="Accept rollouts that take the service down (one replica and maxSurge 0)."
    )

    @model_validator(mode="after")
    def _deadline(self) -> RolloutSpec:
        rules.raise_issues("RolloutSpec", rules.rollout_issues(self))
        return self


# ---- autoscaling: HorizontalPodAutoscaler v2's shape (minReplicas, maxReplicas, behavior), a subset ----------


class ScalingPolicy(_Wire):
    type: Literal["Pods", "Percent"] = Field(
        ..., description="Pods: at most `value` replicas per period; Percent: at most `value` percent of the "
        "current replicas per period (as in a HorizontalPodAutoscaler's behavior)."
    )
    value: int = Field(..., ge=1, le=100000, description="How many replicas (Pods) or percent (Percent); at least 1.")
    period_seconds: int = Field(
        ..., ge=1, le=1800, description="The window the policy holds over, 1 to 1800 seconds (30 minutes), as HPA's."
    )


def _policies(*policies: dict[str, int | str]) -> Any:
    # default_factory keeps instances from sharing a list; the schema default is for the API server.
    default: list[JsonValue] = [dict(p) for p in policies]
    return Field(
        default_factory=lambda: [ScalingPolicy.model_validate(p) for p in default],
        json_schema_extra={"default": default},
        min_length=1,
        max_length=10,
        description="The most the count may change per period; selectPolicy says which one applies when "
        "several allow different changes.",
    )


_STABILIZATION = "Seconds of past recommendations considered: {which} (0 to 3600)."
_SELECT_POLICY = ("Max: the policy allowing the largest change applies; Min: the smallest; Disabled: never "
                  "scale in this direction.")


class ScaleUpRules(_Wire):
    stabilization_window_seconds: int = Field(
        0, ge=0, le=3600, description=_STABILIZATION.format(
            which="scale up to the lowest count recommended over the window; 0 (HPA's default) acts at once")
    )
    select_policy: Literal["Max", "Min", "Disabled"] = Field("Max", description=_SELECT_POLICY)
    policies: list[ScalingPolicy] = _policies(
        {"type": "Percent", "value": 100, "periodSeconds": 15}, {"type": "Pods", "value": 4, "periodSeconds": 15}
    )


class ScaleDownRules(_Wire):
    stabilization_window_seconds: int = Field(
        300, ge=0, le=3600, description=_STABILIZATION.format(
            which="scale down only to the highest count recommended over the window (HPA's default 300)")
    )
    select_policy: Literal["Max", "Min", "Disabled"] = Field("Max", description=_SELECT_POLICY)
    policies: list[ScalingPolicy] = _policies({"type": "Percent", "value": 100, "periodSeconds": 15})


class ScalingBehavior(_Wire):
    scale_up: ScaleUpRules = Field(
        default_factory=ScaleUpRules,
        description="How fast the count may rise (HPA's defaults: double, or 4 replicas more, per 15 s).",
    )
    scale_down: ScaleDownRules = Field(
        default_factory=ScaleDownRules,
        description="How fast the count may fall (HPA's defaults: after 5 minutes of lower recommendations, "
        "to any count within [minReplicas, maxReplicas]).",
    )


class AutoscalingSpec(_Wire):
    actor: Literal["kvpilot", "external"] = Field(
        "kvpilot",
        description="Who writes spec.replicas. kvpilot: kvpilot's planner, within these bounds and behavior. "
        "external: a HorizontalPodAutoscaler or KEDA ScaledObject targets this InferenceService through its "
        "scale subresource (kvpilot publishes its desired count as a metric and writes no replicas); that "
        "autoscaler's own minReplicas, maxReplicas and behavior govern, so set them alike.",
    )
    min_replicas: int = Field(
        1, ge=0, le=1000, description="Fewest replicas the autoscaler may set (0 to 1000; 0 lets it scale to zero)."
    )
    max_replicas: int = Field(
        ..., ge=1, le=1000, description="Most replicas the autoscaler may set (1 to 1000); at least minReplicas."
    )
    behavior: ScalingBehavior = Field(
        default_factory=ScalingBehavior,
        description="How fast the count may change, as a HorizontalPodAutoscaler's spec.behavior.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        rules.raise_issues("AutoscalingSpec", rules.autoscaling_issues(self))
        return self


class SLOSpec(_Wire):
    ttft_seconds: float = Field(
        0.5, description="Time-to-first-token target; must be a bucket edge of vllm:time_to_first_token_seconds."
    )
    itl_seconds: float = Field(
        0.05, description="Inter-token latency target; must be a bucket edge of vllm:inter_token_latency_seconds."
    )
    objective: float = Field(
        0.99,
        gt=0,
        le=1 - MIN_ERROR_BUDGET,
        description="Fraction of requests that must meet both targets; at most 0.999999 (an error budget of "
        "at least one in a million).",
    )
    period: str = Field(
        "30d",
        pattern=r"^[1-9][0-9]{0,3}[dhw]$",
        description="SLO period for the error budget, e.g. 30d, 4w, 720h.",
    )

    @model_validator(mode="after")
    def _edges(self) -> SLOSpec:
        rules.raise_issues("SLOSpec", rules.slo_issues(self))
        return self


def _range(declared: tuned.TunedField) -> Any:
    # default_factory keeps instances from sharing a list; the schema default is for the API server.
    default: list[Any] = list(declared.space)
    field = declared.name
    return Field(
        default_factory=lambda: list(default),
        json_schema_extra={"default": default},
        min_length=2,
        max_length=2,
        description=f"[min, max] of engine.{field} the tuner may try.",
    )


class TuningSpace(_Wire):
    # A [min, max] range for each tuned field (kvpilot.api.tuned); no docstring, the CRD would print it.
    max_num_batched_tokens: list[int] = _range(tuned.MAX_NUM_BATCHED_TOKENS)
    gpu_memory_utilization: list[float] = _range(tuned.GPU_MEMORY_UTILIZATION)
    max_num_seqs: list[int] = _range(tuned.MAX_NUM_SEQS)


Weekday = Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]
WEEKDAYS: tuple[Weekday, ...] = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_HH_MM = r"^([01][0-9]|2[0-3]):[0-5][0-9]$|^24:00$"


class MaintenanceWindow(_Wire):
    days: list[Weekday] = Field(
        default_factory=lambda: list(WEEKDAYS),
        json_schema_extra={"default": list(WEEKDAYS)},
        min_length=1,
        max_length=7,
        description="Days the window opens on (Mon..Sun); every day when unset.",
    )
    start: str = Field(..., max_length=5, pattern=_HH_MM, description="Opening time, HH:MM (24-hour) in the gate's timeZone.")
    end: str = Field(
        ...,
        max_length=5,
        pattern=_HH_MM,
        description="Closing time, HH:MM or 24:00; earlier than start means the window runs past midnight "
        "(into the next day); must differ from start.",
    )


class BudgetGate(_Wire):
    min_remaining: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Start a trial only while at least this share of the SLO period's error budget is left "
        "(the worse of TTFT and ITL, from the kvpilot:slo_*_error_budget_remaining:ratio recordings).",
    )
    windows: list[MaintenanceWindow] = Field(
        default_factory=list,
        max_length=32,
        description="Maintenance windows: trials start only inside one of them. Empty: any time.",
    )
    time_zone: str = Field(
        "UTC",
        min_length=1,
        max_length=64,
        description="IANA time zone of the windows, e.g. Europe/Berlin (daylight saving followed).",
    )


class TuningSpec(_Wire):
    enabled: bool = Field(False, description="Let the tuner change the tuned engine fields of this service.")
    goal: Literal["latency", "capacity"] = Field(
        "latency",
        description="latency: minimise p99 TTFT and ITL against the SLO, live; capacity: maximise the rate within SLO, on the twin.",
    )
    space: TuningSpace = Field(default_factory=TuningSpace, description="Ranges the tuner searches.")
    max_trials: int = Field(30, ge=1, le=1000, description="Trials before the tuner settles on the best.")
    trial_seconds: int = Field(600, ge=10, le=86400, description="Measurement window of one trial.")
    warmup_seconds: int = Field(120, ge=0, le=86400, description="Wait after a rollout before measuring.")
    trial_strategy: Literal["canary", "rolling"] | None = Field(
        None,
        description="Where a live trial's engine runs. canary: a one-replica <name>-canary Deployment beside the "
        "stable one, in the same Service (about 1/(replicas+1) of requests; it needs one replica's resources "
        "beyond the stable replicas, like maxSurge 1); needs replicas >= 2. rolling: the whole fleet rolls to "
        "the trial engine. Unset: canary when replicas >= 2, else rolling.",
    )
    budget_gate: BudgetGate | None = Field(
        None,
        description="Start trials only while enough error budget is left and, if windows are given, inside a "
        "maintenance window; otherwise the tuner keeps the best engine and reports Paused "
        "(BudgetLow, BudgetUnknown or OutsideWindow).",
    )
    # Removed from the resource: a tenant chose where the cluster-wide tuner opened a database (or
    # wrote a SQLite file).  Kept in the schema only so the refusal can say where the setting went.
    storage: str | None = Field(
        None, max_length=2048, description="Removed (must be unset): " + rules.STORAGE_REMOVED
    )

    @model_validator(mode="after")
    def _space(self) -> TuningSpec:
        rules.raise_issues("TuningSpec", rules.tuning_issues(self))
        return self


class TracingSpec(_Wire):
    otlp_traces_endpoint: str = Field(
        ...,
        min_length=1,
        max_length=2048,
        pattern=tracing.OTLP_ENDPOINT_PATTERN,
        description="--otlp-traces-endpoint: where the engine sends its request spans (OTLP). With http/protobuf "
        "the full URL spans are posted to (http://otel-collector.observability:4318/v1/traces); with grpc the "
        "collector's gRPC address (http://otel-collector.observability:4317).",
    )
    otlp_traces_protocol: tracing.Protocol = Field(
        "http/protobuf",
        description="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: http/protobuf or grpc. Always set on the container "
        "(vLLM falls back to grpc when it is unset). The kvpilot image's twin carries only the http exporter.",
    )
    sampling_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Fraction of traces kept, 0 to 1 (OTEL_TRACES_SAMPLER_ARG). Unset: every request is traced.",
    )
    parent_based: bool = Field(
        True,
        description="With samplingRatio: follow the sampling decision of an incoming traceparent header "
        "(OTEL_TRACES_SAMPLER parentbased_traceidratio) or sample every request at the ratio (traceidratio).",
    )
    collect_detailed_traces: list[tracing.DetailedTraceModule] = Field(
        default_factory=list,
        max_length=len(tracing.DETAILED_TRACE_MODULES),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="--collect-detailed-traces: vLLM modules to trace in detail (model, worker, all); each once.",
    )

    @model_validator(mode="after")
    def _protocol_and_modules(self) -> TracingSpec:
        rules.raise_issues("TracingSpec", rules.tracing_issues(self))
        return self


class ObservabilitySpec(_Wire):
    tracing: TracingSpec | None = Field(
        None,
        description="OpenTelemetry request tracing: vLLM's --otlp-traces-endpoint and --collect-detailed-traces, "
        "and the OTEL_* environment (protocol, sampler, OTEL_SERVICE_NAME = the InferenceService's name). "
        "Unset: no tracing.",
    )
    monitor: Literal["ServiceMonitor", "PodMonitor", "None"] = Field(
        "ServiceMonitor",
        description="How the Prometheus Operator scrapes the engine's /metrics: a ServiceMonitor (through the "
        "Service's endpoints), a PodMonitor (the pods directly, for a Prometheus that selects only PodMonitors), "
        "or None (scrape it yourself, and keep the pod label kvpilot.dev/inferenceservice as the series label "
        "kvpilot_dev_inferenceservice: the SLO rules, the dashboard and the tuner select on it). Both monitors, "
        "and a scrape config of your own, should carry the metric relabelling source_labels [__name__], regex "
        f"{vllm.METRIC_NAME_ESCAPED_REGEX}, target_label __name__, replacement "
        f"{vllm.METRIC_NAME_ESCAPED_REPLACEMENT}, action replace: where vLLM's metrics are served through "
        "prometheus_client's content negotiation (its /metrics/ mount), Prometheus 2.x gets OpenMetrics with "
        "escaping=underscores, vllm: names written vllm_ (prometheus/client_python#1177); where the names "
        "arrive with their colon (vLLM 0.32's GET /metrics, Prometheus 3.x) the rule changes nothing.",
    )


class InferenceServiceSpec(_Wire):
    model: str = Field(
        ...,
        min_length=1,
        max_length=512,
        pattern=NOT_A_FLAG_PATTERN,
        description="Model to serve: a Hugging Face id or a path in the image (not starting with '-').",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        pattern=NOT_A_FLAG_PATTERN,
        description="Name clients use in requests (not starting with '-'); defaults to model.",
    )
    replicas: int = Field(
        1,
        ge=0,
        le=1000,
        description="Engine replicas (pods) of the stable engine; the scale subresource's spec.replicas, so "
        "`kubectl scale` and an autoscaler write it.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None,
        description="Bounds and pace for scaling spec.replicas, and who scales (kvpilot or an HPA/KEDA). Unset: "
        "spec.replicas is only what you set. A spec.replicas outside [minReplicas, maxReplicas] is allowed "
        "(with a warning), as with an HPA: the autoscaler brings it inside at its next decision.",
    )
    engine: EngineSpec = Field(default_factory=EngineSpec, description="The inference engine and its flags.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Per-replica resources.")
    model_config_ref: ModelConfigSpec | None = Field(
        None,
        alias="modelConfig",
        description="Where the model's Hugging Face config.json is, for a model the engine twin has no preset of: "
        "`kvpilot validate --predict` reads it (from a ConfigMap document in the same input) to size vLLM's "
        "memory, and engine.kind twin pods mount it and simulate that model.",
    )
    hf_token_secret: SecretKeyRef | None = Field(
        None, description="Secret key holding a Hugging Face token, exposed to the engine as HF_TOKEN."
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="How changes roll out without downtime.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency objectives: alerts page on them, the tuner steers by them.")
    tuning: TuningSpec = Field(default_factory=TuningSpec, description="The closed-loop tuner's settings.")
    observability: ObservabilitySpec = Field(
        default_factory=ObservabilitySpec,
        description="How Prometheus finds the engine's metrics, and where the engine sends request traces.",
    )

    @property
    def effective_trial_strategy(self) -> Literal["canary", "rolling"]:
        """spec.tuning.trialStrategy, or its default: canary when replicas >= 2, else rolling (a schema
        default cannot depend on replicas)."""
        if self.tuning.trial_strategy is not None:
            return self.tuning.trial_strategy
        return "canary" if self.replicas >= 2 else "rolling"

    @model_validator(mode="after")
    def _cross_fields(self) -> InferenceServiceSpec:
        rules.raise_issues("InferenceServiceSpec", rules.spec_issues(self))
        return self


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata kvpilot reads; everything else is kept as given."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, alias_generator=to_camel)

    name: str = Field(
        ...,
        min_length=1,
        max_length=63,
        pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
        description="DNS-1035 label: it names the Deployment and Service too.",
    )
    namespace: str = Field("default", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None


# ---- status ----------------------------------------------------------------------------------


class _Status(_Wire):
    # Status is written by the operator and the tuner; an unknown key from a newer one must not break reads.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class Condition(_Status):
    type: str = Field(..., description="Ready, Progressing, Degraded, SLOBurning, Tuning, Canary or Scaling.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field("", description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable details.")
    last_transition_time: str | None = Field(None, description="RFC 3339 time of the last status change.")
    observed_generation: int | None = None


class BurnRates(_Status):
    # Keys are the PromQL windows, as SREs read them.
    five_minutes: float | None = Field(None, alias="5m")
    one_hour: float | None = Field(None, alias="1h")
    six_hours: float | None = Field(None, alias="6h")


class SLOStatus(_Status):
    ttft_p99_seconds: float | None = None
    itl_p99_seconds: float | None = None
    burn_rate: BurnRates | None = Field(None, description="Worst of the TTFT and ITL burn rates per window.")


class TuningBest(_Status):
    trial: int | None = None
    value: float | None = None
    params: dict[str, float] = Field(default_factory=dict)


class TuningStatus(_Status):
    phase: str | None = Field(None, description="Idle, WarmStart, Applying, WarmingUp, Measuring, Paused, Done or Failed.")
    reason: str | None = Field(None, description="Why the tuner is in this phase, CamelCase (e.g. BudgetLow, "
                               "OutsideWindow, BudgetUnknown while Paused by the budget gate).")
    trial: int | None = Field(None, description="Number of the trial in progress or last finished.")
    study: str | None = None
    best: TuningBest | None = None
    message: str | None = None


class LastFailure(_Status):
    reason: str = Field(..., description="EngineStartupFailed, CrashLoopBackOff or ProgressDeadlineExceeded.")
    message: str = Field("", description="Why, in the engine's own words where it gave them (vLLM's start-up "
                         "error line).")
    config_hash: str | None = Field(None, description="configHash of the pod template that failed.")
    observed_generation: int | None = Field(None, description="The spec generation whose engine failed.")
    pod: str | None = Field(None, description="The pod that showed the failure.")
    time: str | None = Field(None, description="RFC 3339 time the operator saw it.")


class CanaryStatus(_Status):
    trial: int | None = Field(None, description="The tuner's trial the canary runs (from the kvpilot.dev/canary annotation).")
    phase: str | None = Field(None, description="Progressing, Ready or Failed.")
    reason: str | None = Field(None, description="CamelCase: CanaryProgressing, CanaryReady, Unschedulable, "
                               "EngineStartupFailed, CrashLoopBackOff, ProgressDeadlineExceeded or InvalidCanary.")
    ready_replicas: int | None = Field(None, description="Ready pods of the canary Deployment (0 or 1).")
    config_hash: str | None = Field(None, description="configHash of the canary's pod template.")
    message: str | None = Field(None, description="Why, in vLLM's words where the engine failed.")


class InferenceServiceStatus(_Status):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list)
    replicas: int | None = None
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    available_replicas: int | None = None
    selector: str | None = Field(
        None, description="Label selector of the stable engine's pods (the canary's not), as the scale "
        "subresource reports it to kubectl and autoscalers.")
    engine_args: list[str] = Field(default_factory=list, description="The engine command line in force.")
    config_hash: str | None = None
    last_good_engine: dict[str, Any] | None = Field(
        None, description="spec.engine of the last rollout that completed with every replica ready."
    )
    last_failure: LastFailure | None = Field(
        None, description="The last rollout that failed (and was rolled back where a lastGoodEngine existed).")
    slo: SLOStatus | None = None
    tuning: TuningStatus | None = None
    canary: CanaryStatus | None = Field(
        None, description="The canary trial asked for by the kvpilot.dev/canary annotation; absent when none is.")


class InferenceService(_Wire):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    # Literal types must be spelled out; a test checks they equal the vocabulary's API_VERSION and KIND.
    api_version: Literal["kvpilot.dev/v1alpha1"] = Field("kvpilot.dev/v1alpha1", alias="apiVersion")
    kind: Literal["InferenceService"] = "InferenceService"
    metadata: ObjectMeta
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
