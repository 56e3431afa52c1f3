"""GPU presets for the engine twin.

Figures are the vendors' datasheet numbers for the SXM / standard boards: dense (no sparsity)
bf16 tensor-core FLOP/s, HBM/GDDR bandwidth, and NVLink bandwidth per GPU (one direction,
0 where the board has none and talks over PCIe).  `total_memory_bytes` is what CUDA reports as
the device's total memory (somewhat below the marketing figure), because that is what vLLM
multiplies `--gpu-memory-utilization` by.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.api import engine as engine_codec

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


GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("A100-80GB", _gib(79.15), 312e12, 2.039e12, 300e9, architecture="ampere",
                product_label="NVIDIA-A100-SXM4-80GB"),
        GpuSpec("H100-80GB", _gib(79.19), 989e12, 3.35e12, 450e9, 64e9, architecture="hopper",
                product_label="NVIDIA-H100-80GB-HBM3", fp8_flops=1979e12),
        GpuSpec("H200", _gib(139.80), 989e12, 4.8e12, 450e9, 64e9, architecture="hopper",
                product_label="NVIDIA-H200", fp8_flops=1979e12),
        GpuSpec("L40S", _gib(44.39), 362e12, 0.864e12, 0.0, architecture="ada", product_label="NVIDIA-L40S",
                fp8_flops=733e12),
        GpuSpec("L4", _gib(22.03), 121e12, 0.300e12, 0.0, architecture="ada", product_label="NVIDIA-L4",
                fp8_flops=242e12),
        # A workstation board (dense bf16 with fp32 accumulation, as cuBLAS runs vLLM's GEMMs).
        GpuSpec("RTX4090", 25250627584, 165.2e12, 1.008e12, 0.0, architecture="ada",
                product_label="NVIDIA-GeForce-RTX-4090", fp8_flops=330.3e12),
        GpuSpec("A10G", _gib(22.19), 70e12, 0.600e12, 0.0, architecture="ampere", product_label="NVIDIA-A10G"),
    )
}

# Other spellings people type (and that `nvidia-smi` prints) -> preset name.
_ALIASES: dict[str, str] = {
    "a100": "A100-80GB",
    "a100-80g": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB",
    "nvidia-a100-80gb": "A100-80GB",
    "nvidia-a100-sxm4-80gb": "A100-80GB",
    "h100": "H100-80GB",
    "h100-80g": "H100-80GB",
    "h100-sxm": "H100-80GB",
    "h100-sxm5-80gb": "H100-80GB",
    "nvidia-h100-80gb-hbm3": "H100-80GB",
    "h200-141gb": "H200",
    "nvidia-h200": "H200",
    "l40s-48gb": "L40S",
    "nvidia-l40s": "L40S",
    "l4-24gb": "L4",
    "nvidia-l4": "L4",
    "a10g-24gb": "A10G",
    "nvidia-a10g": "A10G",
    "rtx-4090": "RTX4090",
    "geforce-rtx-4090": "RTX4090",
    "nvidia-geforce-rtx-4090": "RTX4090",
}


class UnknownGpuError(ValueError):
    """A GPU name that is neither a preset nor a known alias."""


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def resolve_gpu(name: str) -> GpuSpec:
    """The preset for `name` (case-insensitive; common aliases)."""
    key = _norm(name)
    for preset in GPU_PRESETS.values():
        if _norm(preset.name) == key:
            return preset
    if key in _ALIASES:
        return GPU_PRESETS[_ALIASES[key]]
    raise UnknownGpuError(f"unknown GPU {name!r}; the twin knows: {', '.join(GPU_PRESETS)}")


def product_label(gpu_type: str) -> str:
    """The nvidia.com/gpu.product value a node selector for `gpu_type` (spec.resources.gpuType) uses:
    a GPU the twin knows, under any of its names, becomes its board's product label; anything else is
    taken as a product label already and kept as written (clusters have GPUs the twin does not model)."""
    if any(g.product_label == gpu_type for g in GPU_PRESETS.values()):
        return gpu_type
    try:
        return resolve_gpu(gpu_type).product_label or gpu_type
    except UnknownGpuError:
        return gpu_type


def serve_defaults(gpu: GpuSpec) -> engine_codec.ServeDefaults:
    """What `vllm serve` resolves on this GPU when the flags are absent."""
    return engine_codec.serve_defaults(gpu.name, gpu.total_memory_bytes)
