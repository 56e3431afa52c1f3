"""GPU presets for the engine twin.

Figures are the vendors' datasheet numbers for the SXM / standard boards: dense (no sparsity)
bf16 tensor-core FLOP/s, HBM/GDDR bandwidth, and NVLink bandwidth per GPU (one direction,
0 where the board has none and talks over PCIe).  `total_memory_bytes` is what CUDA reports as
the device's total memory (somewhat below the marketing figure), because that is what vLLM
multiplies `--gpu-memory-utilization` by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpilot.api import engine as engine_codec
from kvpilot.api import gpus

GiB = 1 << 30

# The GPU the twin's commands simulate when `--gpu` is not given (they also read $KVPILOT_TWIN_GPU).
DEFAULT_GPU = "H100-80GB"


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    total_memory_bytes: int
    bf16_flops: float  # dense bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per direction; 0 -> PCIe only
    pcie_bandwidth: float = 32e9  # bytes/s per direction (gen4 x16 ~ 32 GB/s, gen5 ~ 64 GB/s)
    # What the CUDA context and the driver take before vLLM allocates anything: memory that is
    # "used by other processes" from vLLM's point of view when it checks free memory at start-up.
    cuda_context_bytes: int = int(0.5 * GiB)
    architecture: str = ""
    # The value NVIDIA's GPU feature discovery gives the node label nvidia.com/gpu.product for this
    # board (what spec.resources.gpuType renders to as a node selector).
    product_label: str = ""
    # Dense FP8 tensor-core FLOP/s (Hopper, Ada); 0 where the GPU has no FP8 tensor cores (Ampere:
    # vLLM runs FP8 checkpoints there as weight-only FP8, Marlin kernels computing in 16 bits).
    fp8_flops: float = 0.0

    @property
    def total_memory_gib(self) -> float:
        return self.total_memory_bytes / GiB

    @property
    def interconnect_bandwidth(self) -> float:
        return self.nvlink_bandwidth or self.pcie_bandwidth


def _gib(x: float) -> int:
    return int(x * GiB)


# Each preset carries its board's node label from the GPU catalog (kvpilot.api.gpus).
GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: replace(g, product_label=gpus.PRODUCT_LABELS[g.name])
    for g in (
        GpuSpec("A100-80GB", _gib(79.15), 312e12, 2.039e12, 300e9, architecture="ampere"),
        GpuSpec("H100-80GB", _gib(79.19), 989e12, 3.35e12, 450e9, 64e9, architecture="hopper", fp8_flops=1979e12),
        GpuSpec("H200", _gib(139.80), 989e12, 4.8e12, 450e9, 64e9, architecture="hopper", fp8_flops=1979e12),
        GpuSpec("L40S", _gib(44.39), 362e12, 0.864e12, 0.0, architecture="ada", fp8_flops=733e12),
        GpuSpec("L4", _gib(22.03), 121e12, 0.300e12, 0.0, architecture="ada", fp8_flops=242e12),
        # A workstation board (dense bf16 with fp32 accumulation, as cuBLAS runs vLLM's GEMMs).
        GpuSpec("RTX4090", 25250627584, 165.2e12, 1.008e12, 0.0, architecture="ada", fp8_flops=330.3e12),
        GpuSpec("A10G", _gib(22.19), 70e12, 0.600e12, 0.0, architecture="ampere"),
    )
}


class UnknownGpuError(ValueError):
    """A GPU name that is neither a preset nor a known alias."""


def resolve_gpu(name: str) -> GpuSpec:
    """The preset for `name` (case-insensitive; the catalog's aliases, kvpilot.api.gpus)."""
    board = gpus.canonical_name(name)
    if board is None or board not in GPU_PRESETS:
        raise UnknownGpuError(f"unknown GPU {name!r}; the twin knows: {', '.join(GPU_PRESETS)}")
    return GPU_PRESETS[board]


# The nvidia.com/gpu.product value for a spec.resources.gpuType (the catalog's, kept here for the twin's users).
product_label = gpus.product_label


def serve_defaults(gpu: GpuSpec) -> engine_codec.ServeDefaults:
    """What `vllm serve` resolves on this GPU when the flags are absent."""
    return engine_codec.serve_defaults(gpu.name, gpu.total_memory_bytes)
