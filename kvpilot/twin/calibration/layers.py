"""Calibrating the step-time model's linear part on measured per-layer times (Vidur profiles).

A profile CSV (from the Vidur project, MIT licence) holds, per (num_tokens, tensor-parallel
size), the min/max/mean/median/std in milliseconds of each op of one transformer layer
(`time_stats.<op>.median`), plus the model's shape (n_head, n_kv_head, n_embd, n_expanded_embd,
vocab_size, use_gated_mlp).  The GPU is named by the file's prefix (`a100_...`, `h100_...`).

The figure compared is the sum of the op medians of one layer, every op but `emb` (the
embedding runs once per step, not per layer), against `per_layer_linear_time`.

`fit()` fits the linear-part constants of StepTimeParams, shared by every GPU (they are
fractions of each GPU's datasheet peak plus absolute floors), by Nelder-Mead on the log of
the parameters (`kvpilot.twin.calibration.fit`), minimising the mean absolute log error plus a
penalty on errors above 20%.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpilot.twin.calibration.fit import fit_loss, log_error_loss
from kvpilot.twin.hardware import GpuSpec, resolve_gpu
from kvpilot.twin.models import ModelSpec
from kvpilot.twin.steptime import StepTimeParams, per_layer_linear_time

# The linear-part constants `fit` tunes (attention, all-reduce and CPU terms are not profiled here).
FIT_FIELDS: tuple[str, ...] = (
    "gemm_compute_eff", "gemm_memory_eff", "gemm_floor_s", "gemm_sharpness", "gemm_ramp_bytes", "norm_eff",
    "rope_eff", "act_eff", "add_eff", "elementwise_floor_s",
)
EXCLUDED_OPS = ("emb",)


@dataclass(frozen=True)
class Profile:
    """One profile file: the rows, deduplicated by (tokens, tp), median of duplicates."""

    name: str
    gpu: GpuSpec
    model: ModelSpec
    tokens: np.ndarray
    tp: np.ndarray
    measured_s: np.ndarray  # per-layer sum of op medians, seconds
    ops: tuple[str, ...]


_GPU_PREFIX = re.compile(r"^([a-z0-9]+)_")


def load_profile(path: str | Path) -> Profile:
    p = Path(path)
    m = _GPU_PREFIX.match(p.name.lower())
    if not m:
        raise ValueError(f"{p.name}: the file name must start with the GPU, e.g. a100_...")
    gpu = resolve_gpu(m.group(1))
    with p.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{p.name}: no rows")
    ops = tuple(
        c[len("time_stats."):-len(".median")]
        for c in rows[0]
        if c.startswith("time_stats.") and c.endswith(".median") and c.split(".")[1] not in EXCLUDED_OPS
    )
    r0 = rows[0]
    heads = int(r0["n_head"])
    hidden = int(r0["n_embd"])
    model = ModelSpec(
        name=p.name.split("_", 1)[1].removesuffix(".csv"),
        hidden_size=hidden,
        intermediate_size=int(r0["n_expanded_embd"]),
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=int(r0["n_kv_head"]),
        head_dim=hidden // heads,
        vocab_size=int(r0["vocab_size"]),
        gated_mlp=r0["use_gated_mlp"].strip().lower() == "true",
        dtype="float16",
    )
    groups: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        key = (int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))
        groups.setdefault(key, []).append(sum(float(r[f"time_stats.{op}.median"]) for op in ops))
    keys = sorted(groups)
    return Profile(
        name=p.name,
        gpu=gpu,
        model=model,
        tokens=np.array([k[0] for k in keys]),
        tp=np.array([k[1] for k in keys]),
        measured_s=np.array([float(np.median(groups[k])) for k in keys]) * 1e-3,
        ops=ops,
    )


def load_profiles(directory: str | Path) -> list[Profile]:
    files = sorted(Path(directory).glob("*.csv"))
    return [load_profile(f) for f in files]


def predict(profile: Profile, params: StepTimeParams) -> np.ndarray:
    return np.asarray(per_layer_linear_time(profile.model, profile.gpu, profile.tp, profile.tokens, params))


def relative_errors(profile: Profile, params: StepTimeParams) -> np.ndarray:
    """|predicted - measured| / measured for every (tokens, tp) of the profile."""
    return np.abs(predict(profile, params) - profile.measured_s) / profile.measured_s


def _objective(profiles: Sequence[Profile], params: StepTimeParams) -> float:
    pred = np.concatenate([predict(prof, params) for prof in profiles])
    meas = np.concatenate([prof.measured_s for prof in profiles])
    return log_error_loss(pred, meas)


def fit(profiles: Sequence[Profile], start: StepTimeParams | None = None,
        names: Iterable[str] = FIT_FIELDS, iters: int = 800) -> StepTimeParams:
    """Fit the named constants to the profiles."""
    return fit_loss(lambda p: _objective(profiles, p), start or StepTimeParams(), names, iters)


# The constants that differ between GPU generations (kernel efficiency and launch latency);
# the rest (shape of the roofline, element-wise efficiencies) are shared by all GPUs.
CLASS_FIELDS: tuple[str, ...] = ("gemm_compute_eff", "gemm_memory_eff", "gemm_floor_s", "elementwise_floor_s")


def fit_by_class(profiles: Sequence[Profile], start: StepTimeParams | None = None,
                 iters: int = 800) -> tuple[StepTimeParams, dict[str, StepTimeParams]]:
    """(generic, {architecture: params}): generic fits every constant on every profile and is
    what GPUs of an unmeasured architecture get; each measured architecture then refits the
    CLASS_FIELDS on its own profiles, starting from generic."""
    generic = fit(profiles, start, FIT_FIELDS, iters)
    by_class: dict[str, StepTimeParams] = {}
    for arch in sorted({p.gpu.architecture for p in profiles}):
        mine = [p for p in profiles if p.gpu.architecture == arch]
        by_class[arch] = fit(mine, generic, CLASS_FIELDS, iters)
    return generic, by_class
