"""How far the twin's figures are from real vLLM on GPUs, as measured: `measured_error(gpu)` for
a GPU class, and `step_scale_multipliers(factor)` to re-price a study's configs within that error."""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.twin.hardware import GpuSpec
from kvpilot.twin.models import ModelSpec
from kvpilot.twin.steptime import StepTimeParams


@dataclass(frozen=True)
class MeasuredError:
    """Median absolute errors (%) of the twin against real `vllm serve` runs, and where from."""

    e2e_mean: float
    ttft_mean: float
    ttft_p99: float
    itl_mean: float
    runs: int
    source: str

    @property
    def step_time(self) -> float:
        """The step model's error as a fraction: decode steps set the time per output token."""
        return self.itl_mean / 100.0

    def describe(self) -> str:
        return (f"median error E2E {self.e2e_mean:.1f}%, TTFT {self.ttft_mean:.1f}% (p99 {self.ttft_p99:.1f}%), "
                f"time per output token {self.itl_mean:.1f}% ({self.source})")


# Printed by `python benchmarks/twin_vs_gpu_serving.py --fit` (leave-one-model-out: each model judged
# by serving constants chosen without its runs; every row of the 13 experiments, stages included).
_H100 = MeasuredError(e2e_mean=6.4, ttft_mean=15.0, ttft_p99=17.1, itl_mean=8.8, runs=13,
                      source="13 vLLM 0.15 runs on H100, 6 models, each judged by constants fitted without it")
MEASURED: dict[str, MeasuredError] = {"H100-80GB": _H100}


def measured_error(gpu: GpuSpec) -> tuple[MeasuredError, bool]:
    """The twin's measured error for this GPU, and whether it was measured on this GPU (False: no
    serving runs on it, so the H100's figures stand in, and the error may be larger)."""
    if gpu.name in MEASURED:
        return MEASURED[gpu.name], True
    return _H100, False


@dataclass(frozen=True)
class MemoryPlanError:
    """How far the memory plan's KV-cache size is from what vLLM logged at start-up."""

    median: float  # % of the logged size
    max: float
    logs: int
    source: str

    def describe(self, model: ModelSpec) -> str:
        text = (f"the twin's KV-cache size was within {self.median:.1f}% of vLLM's (median; max {self.max:.1f}%) "
                f"on {self.logs} {self.source}")
        if model.is_moe:
            text += ("; not validated for mixture-of-experts models (Llama 4 Scout FP8, a multimodal checkpoint "
                     f"whose vision encoder's profiling the twin does not model, came out {MOE_MEMORY_ERROR:+.0f}%)")
        return text


# Printed by `python benchmarks/twin_vs_gpu_serving.py` (memory plan: the KV-cache blocks of the
# shared GPU serving runs at vLLM's default utilisation against the blocks each run logged).
MEMORY_PLAN = MemoryPlanError(median=2.9, max=4.4, logs=8,
                              source="dense-model configs of published vLLM 0.15 runs on H100")
MOE_MEMORY_ERROR = 68.0


def step_scale_multipliers(factor: float) -> tuple[tuple[str, float], ...]:
    """Multipliers of the step-time constants that make every step `factor` times as long:
    efficiencies divided by it, per-step floors and overheads multiplied (the frontend's latencies
    are not a step's and stay)."""
    out = []
    for name in StepTimeParams.__dataclass_fields__:
        if name.endswith("_eff"):
            out.append((name, 1.0 / factor))
        elif name.endswith("_s") and not name.startswith("frontend") and name != "engine_request_s":
            out.append((name, factor))
    return tuple(out)


__all__ = ["MEASURED", "MEMORY_PLAN", "MOE_MEMORY_ERROR", "MeasuredError", "MemoryPlanError", "measured_error", "step_scale_multipliers"]
