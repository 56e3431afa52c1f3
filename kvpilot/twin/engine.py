"""The engine twin: vLLM's scheduler, paged KV cache and a step-time model, one step at a time.

`EngineConfig.resolve(...)`, then `Engine(config)` with `add_request`, `abort_request` and `step()`
(a `StepOutput`); the engine holds no clock.  The interface in full: docs/architecture.md, "The twin's
engine interface".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any

from kvpilot.api import vllm as vllm_facts
from kvpilot.api.engine import resolve as resolve_engine
from kvpilot.api.engine import serve_defaults
from kvpilot.twin.hardware import GpuSpec
from kvpilot.twin.memory import EngineStartupError, MemoryPlan, kv_dtype_bytes, plan_memory
from kvpilot.twin.models import ModelSpec
from kvpilot.twin.scheduler import Request, Scheduler, StepOutcome
from kvpilot.twin.steptime import StepTimeModel, StepTimeParams

__all__ = [
    "Engine", "EngineConfig", "EngineStartupError", "RequestOutput", "StepOutcome", "StepOutput",
]

JITTER_SEED = 20261202  # the step-time jitter's stream (StepTimeParams.step_jitter)


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides the engine's behaviour, resolved: build one with `EngineConfig.resolve`,
    which fills what a `vllm serve` command leaves out the way vLLM does on that GPU.  Exactly one
    of `gpu_memory_utilization` and `kv_cache_memory_bytes` sizes the KV cache; the other is None."""

    model: ModelSpec
    gpu: GpuSpec
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float | None
    kv_cache_memory_bytes: int | None = None
    tensor_parallel_size: int = 1
    block_size: int = vllm_facts.DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"
    long_prefill_token_threshold: int = vllm_facts.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD
    long_prefill_token_threshold_adaptive: bool = False
    enable_prefix_caching: bool = True  # V1's default
    served_model_name: str | None = None
    seed: int = 0
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    prefill_schedule_interval: int = 1  # as vLLM's data-parallel (MoE) engine core applies it
    # vLLM's default on GPUs (AsyncScheduler: the next step is scheduled while one runs); the
    # CPU build and `--no-async-scheduling` schedule synchronously.
    async_scheduling: bool = True
    step_time_params: StepTimeParams | None = None  # None: calibrated for the GPU's architecture

    @classmethod
    def resolve(cls, model: ModelSpec, gpu: GpuSpec, *, max_num_batched_tokens: int | None = None,
                max_num_seqs: int | None = None, max_model_len: int | None = None,
                gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                **knobs: Any) -> EngineConfig:
        """A config with every knob `vllm serve` would resolve at start-up filled in (None = the
        flag was not given): the token budget and sequence cap from vLLM's defaults for this GPU,
        the context length from the model, the memory fraction unless a KV-cache size is fixed."""
        effective = resolve_engine(
            {"maxNumBatchedTokens": max_num_batched_tokens, "maxNumSeqs": max_num_seqs,
             "gpuMemoryUtilization": gpu_memory_utilization, "kvCacheMemoryBytes": kv_cache_memory_bytes},
            serve_defaults(gpu.name, gpu.total_memory_bytes))
        return cls(
            model=model, gpu=gpu,
            max_num_batched_tokens=effective["maxNumBatchedTokens"], max_num_seqs=effective["maxNumSeqs"],
            max_model_len=model.max_position_embeddings if max_model_len is None else max_model_len,
            gpu_memory_utilization=effective.get("gpuMemoryUtilization"),
            kv_cache_memory_bytes=kv_cache_memory_bytes, **knobs,
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    def with_(self, **changes: Any) -> EngineConfig:
        """A copy with some knobs changed; a knob set to None is resolved again as vLLM would."""
        knobs = {f.name: getattr(self, f.name) for f in fields(self)}
        if changes.get("kv_cache_memory_bytes") is not None:
            knobs["gpu_memory_utilization"] = None
        elif "kv_cache_memory_bytes" in changes or changes.get("gpu_memory_utilization") is not None:
            knobs["kv_cache_memory_bytes"] = None
        knobs.update(changes)
        return EngineConfig.resolve(knobs.pop("model"), knobs.pop("gpu"), **knobs)

    def validate(self) -> None:
        """Raise EngineStartupError for a configuration `vllm serve` refuses before loading."""
        m = self.model
        tp = self.tensor_parallel_size
        if tp < 1:
            raise EngineStartupError(f"tensor_parallel_size ({tp}) must be >= 1")
        if m.num_attention_heads % tp:
            raise EngineStartupError(
                f"Total number of attention heads ({m.num_attention_heads}) must be divisible by tensor "
                f"parallel size ({tp})."
            )
        if self.block_size not in vllm_facts.BLOCK_SIZES:
            raise EngineStartupError(
                f"block_size ({self.block_size}) must be one of {list(vllm_facts.BLOCK_SIZES)}")
        if self.kv_cache_dtype not in vllm_facts.KV_CACHE_DTYPES:
            raise EngineStartupError(
                f"kv_cache_dtype ({self.kv_cache_dtype!r}) must be one of {list(vllm_facts.KV_CACHE_DTYPES)}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise EngineStartupError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineStartupError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater than or equal to "
                f"max_num_seqs ({self.max_num_seqs})."
            )
        if self.max_model_len < 1:
            raise EngineStartupError(f"max_model_len ({self.max_model_len}) must be >= 1")
        if self.max_model_len > m.max_position_embeddings:
            raise EngineStartupError(
                f"User-specified max_model_len ({self.max_model_len}) is greater than the derived max_model_len "
                f"(max_position_embeddings={m.max_position_embeddings} in model's config.json). This may lead "
                "to incorrect model outputs or CUDA errors."
            )
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise EngineStartupError(f"gpu_memory_utilization ({util}) must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise EngineStartupError("kv_cache_memory_bytes must be positive")
        if self.long_prefill_token_threshold < 0:
            raise EngineStartupError("long_prefill_token_threshold must be >= 0")
        if not 0.0 <= self.watermark < 1.0:
            raise EngineStartupError("watermark must be in [0, 1)")
        if self.prefill_schedule_interval < 1:
            raise EngineStartupError("prefill_schedule_interval must be >= 1")

    def memory_plan(self) -> MemoryPlan:
        self.validate()
        return plan_memory(
            self.model, self.gpu,
            tensor_parallel_size=self.tensor_parallel_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model.name, "gpu": self.gpu.name, "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs, "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size, "block_size": self.block_size,
            "kv_cache_dtype": self.kv_cache_dtype, "long_prefill_token_threshold": self.long_prefill_token_threshold,
            "long_prefill_token_threshold_adaptive": self.long_prefill_token_threshold_adaptive,
            "enable_prefix_caching": self.enable_prefix_caching, "watermark": self.watermark,
            "prefill_schedule_interval": self.prefill_schedule_interval,
            "async_scheduling": self.async_scheduling,
        }


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_count: int
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_computed_prompt_tokens: int


@dataclass(slots=True)
class StepOutput:
    duration_s: float
    outputs: list[RequestOutput]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_scheduled_tokens: int
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.memory = config.memory_plan()  # raises EngineStartupError
        self.num_gpu_blocks = self.memory.num_gpu_blocks
        self.scheduler = Scheduler(
            num_gpu_blocks=self.num_gpu_blocks,
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
            enable_prefix_caching=config.enable_prefix_caching,
            reserve_full_isl=config.scheduler_reserve_full_isl,
            watermark=config.watermark,
            prefill_schedule_interval=config.prefill_schedule_interval,
            async_scheduling=config.async_scheduling,
        )
        self.step_model = StepTimeModel(
            config.model, config.gpu, config.tensor_parallel_size, config.step_time_params,
            kv_dtype_bytes(config.kv_cache_dtype, config.model),
        )
        self.max_model_len: int = config.max_model_len
        self.num_steps = 0
        # Step-time jitter (StepTimeParams.step_jitter): a lognormal factor of mean 1 per step, from a
        # stream seeded alike in every engine, so two configs see the same draws step for step.
        sigma = self.step_model.params.step_jitter
        self._jitter = (random.Random(JITTER_SEED), -sigma * sigma / 2, sigma) if sigma > 0 else None
        # StepTimeParams.engine_request_s: requests added since the last step are taken in before it.
        self._intake_s = self.step_model.params.engine_request_s
        self._taken_in = 0
        self._step_time = self.step_model.step_time  # bound once: run_step is the simulation's hot loop

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_tokens: int, max_tokens: int, arrival_time: float = 0.0, *,
                    prefix_key: str | None = None, prefix_tokens: int = 0) -> None:
        """Queue a request.  ValueError (with vLLM's wording) when it cannot be served."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"Request id {request_id} already running.")
        if prompt_tokens < 1:
            raise ValueError("The prompt must contain at least one token.")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion."
            )
        prefix_blocks = min(prefix_tokens, prompt_tokens) // self.config.block_size if prefix_key else 0
        self.scheduler.add(Request(request_id, prompt_tokens, max_tokens, arrival_time,
                                   prefix_key if prefix_blocks else None, prefix_blocks))

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        s = self.scheduler
        return bool(s.running or s.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage()

    # -- the step -------------------------------------------------------------------------------
    def run_step(self) -> StepOutcome:
        """Schedule, apply and price one step: its `StepOutcome`, `duration_s` set.  The fast path
        for a driver that keeps its own clock and reads the requests (offline.drive); `step()` is
        the same step as vLLM's engine reports it."""
        k = self.num_steps + 1  # step indices start at 1 (the scheduler relies on it)
        self.num_steps = k
        scheduler = self.scheduler
        outcome = scheduler.step(k)
        if outcome.finished and scheduler.only_finishing():  # (only a step that finished some can leave those)
            # Async scheduling: vLLM's next schedule() would be empty and run no batch; the
            # engine goes idle as soon as this step's output is processed.
            scheduler.flush()
        # vLLM computes logits for every scheduled request (a partial prefill's are discarded).
        num_reqs = len(outcome.scheduled)
        duration = self._step_time(outcome.total_num_scheduled_tokens, num_reqs, num_reqs, outcome.prefill_pairs,
                                   outcome.decode_kv_tokens)
        if self._jitter is not None:
            rng, mu, sigma = self._jitter
            duration *= rng.lognormvariate(mu, sigma)
        if self._intake_s:
            num_added = scheduler.num_added
            duration += (num_added - self._taken_in) * self._intake_s
            self._taken_in = num_added
        outcome.duration_s = duration
        return outcome

    def step(self) -> StepOutput:
        s = self.scheduler
        queries, hits = s.prefix_query_tokens, s.prefix_hit_tokens
        outcome = self.run_step()
        outputs = []
        for req in outcome.scheduled:
            sampled = req.sched < 0
            outputs.append(RequestOutput(
                req.request_id, 1 if sampled else 0, req.finish_reason is not None,
                req.finish_reason, req.prompt_tokens, min(req.num_computed, req.prompt_tokens),
            ))
        return StepOutput(outcome.duration_s, outputs, len(s.running), len(s.waiting), s.kv_cache_usage(),
                          outcome.num_preemptions, outcome.total_num_scheduled_tokens,
                          s.prefix_query_tokens - queries, s.prefix_hit_tokens - hits)
