"""The GPU catalog: the boards kvpilot knows by name, the other spellings of each, and the value
NVIDIA's GPU feature discovery gives the node label nvidia.com/gpu.product for it.

The operator renders spec.resources.gpuType with `product_label`; the twin's presets
(`kvpilot.twin.hardware`) are keyed by the same names and resolve a name with `canonical_name`.
"""

from __future__ import annotations

import difflib

# Board name -> its nvidia.com/gpu.product label value.
PRODUCT_LABELS: dict[str, str] = {
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
    "L40S": "NVIDIA-L40S",
    "L4": "NVIDIA-L4",
    "RTX4090": "NVIDIA-GeForce-RTX-4090",
    "A10G": "NVIDIA-A10G",
}

# Other spellings people type (and that `nvidia-smi` prints) -> board name.
ALIASES: dict[str, str] = {
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


# nvidia.com/gpu.product values GPU feature discovery gives boards the catalog has no twin preset for: valid
# gpuType values that a cluster may well have, so they pass without a warning.
OTHER_PRODUCT_LABELS: frozenset[str] = frozenset({
    "NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB", "NVIDIA-A100-80GB-PCIe", "NVIDIA-A100-PCIE-80GB",
    "NVIDIA-A10", "NVIDIA-A30", "NVIDIA-A40", "NVIDIA-L40", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL",
    "NVIDIA-H100-SXM5-80GB", "NVIDIA-H800", "NVIDIA-H20", "NVIDIA-GH200-480GB", "NVIDIA-B200", "NVIDIA-GB200",
    "NVIDIA-RTX-A6000", "NVIDIA-RTX-6000-Ada-Generation", "NVIDIA-GeForce-RTX-3090", "Tesla-T4",
    "Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB", "Tesla-V100-PCIE-16GB", "Tesla-V100-PCIE-32GB",
})


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def canonical_name(name: str) -> str | None:
    """The board name `name` spells (case-insensitive; common aliases), or None for a board not in the catalog."""
    key = _norm(name)
    for board in PRODUCT_LABELS:
        if _norm(board) == key:
            return board
    return ALIASES.get(key)


def product_label(gpu_type: str) -> str:
    """The nvidia.com/gpu.product value a node selector for `gpu_type` (spec.resources.gpuType) uses:
    a GPU of the catalog, under any of its names, becomes its board's product label; anything else is
    taken as a product label already and kept as written (clusters have GPUs the catalog does not list)."""
    if gpu_type in PRODUCT_LABELS.values():
        return gpu_type
    board = canonical_name(gpu_type)
    return PRODUCT_LABELS[board] if board is not None else gpu_type


def gpu_type_warning(gpu_type: str) -> str | None:
    """A warning for a spec.resources.gpuType that is neither a board of the catalog (under any name) nor a
    product label GPU feature discovery is known to give: most likely a typo, which would leave every pod
    Pending on a node selector no node has. None for a known value."""
    if canonical_name(gpu_type) is not None or gpu_type in PRODUCT_LABELS.values() \
            or gpu_type in OTHER_PRODUCT_LABELS:
        return None
    # Every name a value may have meant, lower-cased as people mistype them, to what to suggest instead.
    meant = {_norm(label): label for label in (*PRODUCT_LABELS.values(), *OTHER_PRODUCT_LABELS)}
    meant.update({_norm(board): board for board in PRODUCT_LABELS})
    meant.update({alias: board for alias, board in ALIASES.items()})
    close = list(dict.fromkeys(meant[m] for m in difflib.get_close_matches(_norm(gpu_type), meant, n=3, cutoff=0.5)))
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return (f"{gpu_type!r} is neither a GPU kvpilot knows nor a known nvidia.com/gpu.product value{hint}: the pods "
            f"select nodes labelled nvidia.com/gpu.product={gpu_type} and stay Pending if none is")
