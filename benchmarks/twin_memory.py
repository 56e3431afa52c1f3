"""The twin's memory plan against what vLLM logs at start-up.

    python benchmarks/twin_memory.py [--smoke]

Reads `benchmarks/data/vllm_startup_logs.jsonl`: published vLLM start-up logs, each with its
source, the engine settings it ran with and the figures it printed (weights, activation peak,
non-torch memory, CUDA-graph estimate, free memory at start-up, KV cache GiB and tokens; only what
the log says).  Each row has a fixed `split`: `train` rows fit the memory plan's constants
(`kvpilot.twin.memory.MemoryProfile`), `test` rows only check them.  The split is set when a row is
added, before the twin is run on it: the logs of one source alternate train, test in the order of
the start time vLLM prints in them (the tokenkaki A100 40GB logs: the 14:50 `vllm bench latency`
start train, the 17:21 `vllm serve` start test; the retriva RTX 3060 logs: 17:24 train, 17:49 test).  Then it prints, per log, the
KV cache the twin plans against the one vLLM logged, and the median and max error on the train
and the held-out logs, overall and for vLLM >= 0.17, next to the same figures for the constants
the twin had before they were fitted (`PREVIOUS`).

Terms of the plan and the rows that fit them (train rows only):
- non-torch memory inside the budget: logged `non_torch_gib` at TP 1; its TP > 1 excess;
- memory held before vLLM measures free memory at TP > 1 (NCCL communicators, custom all-reduce
  buffers): logged free memory at start-up, TP 1 against TP > 1 on the same GPU;
- the sampler warm-up of model runner V1: logged activation peaks where the sampler outweighs the
  forward pass (vLLM's PyTorch top-k/top-p sampler); for logs that say FlashInfer samples, the
  activation left over once weights, KV cache and non-torch memory are taken from the budget.
  Model runner V1 since vLLM 0.17 masks top-k/top-p in a Triton kernel instead of sorting the
  vocabulary, and model runner V2 (vLLM's default for dense models since 0.25; Qwen3 since 0.22,
  Llama and Mistral since 0.23) warms up without top-k/top-p: both terms come from vLLM's source,
  not from a fit, and their logs do not feed the sort-based fit;
- the CUDA-graph estimate per decoder layer: logged `Estimated CUDA graph memory` of vLLM >= 0.21,
  the releases that subtract it from the budget (0.19's opt-in estimate is measured differently).
Which of these terms a log's vLLM release uses is `kvpilot.twin.memory.profile_for_vllm`, the same
function that gives the twin its own default (`DEFAULT_PROFILE`, the release it stands for).
Rows whose model the twin cannot size (quantized weights) or whose GPU is unnamed only feed the
terms they log, and so do rows marked `excluded`, whose figures break vLLM's own arithmetic (the
row says how); a GPU the twin has no preset for is sized from the row's `gpu_total_gib`.  Every
row says which figures are vLLM defaults rather than logged flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from kvpilot.twin.hardware import GiB, GpuSpec, UnknownGpuError, resolve_gpu  # noqa: E402
from kvpilot.twin.memory import (  # noqa: E402
    CUDA_GRAPH_IN_BUDGET_SINCE,
    DEFAULT_PROFILE,
    FITTED_PROFILE,
    TRITON_TOP_K_TOP_P_SINCE,
    V1_TRITON_SAMPLER_FP32_COPIES,
    EngineStartupError,
    MemoryProfile,
    forward_peak_bytes,
    plan_memory,
    profile_for_vllm,
    runs_model_runner_v2,
    sampler_peak_bytes,
)
from kvpilot.twin.models import ModelSpec, resolve_model  # noqa: E402

DATA = ROOT / "data" / "vllm_startup_logs.jsonl"
GOAL_VERSION = (0, 17)
GOAL_MEDIAN, GOAL_MAX = 0.02, 0.08

# The constants the twin used before this fit: no start-up hold at TP > 1, three fp32 copies of
# the logits for the sampler, no CUDA-graph term.
PREVIOUS = MemoryProfile(non_torch_bytes=int(0.25 * GiB), tp_non_torch_bytes=int(0.35 * GiB), tp_startup_bytes=0,
                         sampler_fp32_copies=3.0, cuda_graph_bytes_per_layer=0, cuda_graph_in_budget=False)

_REQUIRED = ("id", "source_url", "vllm_version", "tp", "gpu_memory_utilization", "max_num_batched_tokens",
             "max_num_seqs", "max_model_len", "block_size", "split", "logged")
_LOGGED = ("free_at_start_gib", "weights_gib", "activation_peak_gib", "non_torch_gib", "cuda_graph_estimate_gib",
           "cuda_graph_post_capture_gib", "kv_cache_gib", "kv_cache_tokens")


class DatasetError(ValueError):
    """A row of the start-up log dataset that is missing a field or has one of the wrong kind."""


@dataclass(frozen=True)
class StartupLog:
    id: str
    source_url: str
    vllm_version: tuple[int, ...]
    model: str | None
    gpu: str | None
    gpu_total_gib: float | None
    tp: int
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    kv_cache_dtype: str
    sampler: str | None  # "flashinfer" where the log says FlashInfer samples
    split: str
    logged: dict[str, float]
    defaults_inferred: tuple[str, ...] = ()
    excluded: str = ""  # why the log's figures cannot be sized as vLLM's formula (kept, not sized)

    @property
    def spec(self) -> ModelSpec | None:
        return resolve_model(self.model) if self.model else None

    @property
    def gpu_spec(self) -> GpuSpec | None:
        if self.gpu is None:
            return None
        total = None if self.gpu_total_gib is None else int(self.gpu_total_gib * GiB)
        try:
            preset = resolve_gpu(self.gpu)
        except UnknownGpuError:
            if total is None:
                raise
            # A GPU the twin has no preset for: the memory plan needs only its total memory (the
            # speed figures stay zero; nothing here times anything).
            return GpuSpec(self.gpu, total, 0.0, 0.0, 0.0)
        return preset if total is None else dataclasses.replace(preset, total_memory_bytes=total)

    @property
    def plannable(self) -> bool:
        """The twin can size this log's KV cache: a preset model, a named GPU, a logged cache."""
        return (self.spec is not None and self.gpu_spec is not None and "kv_cache_gib" in self.logged
                and not self.excluded)

    @property
    def version_label(self) -> str:
        return ".".join(map(str, self.vllm_version))

    @property
    def unplannable_reason(self) -> str:
        """Why the twin cannot size this log's cache ('' where it can)."""
        if self.spec is None:
            return "weights the twin cannot size (not a preset model)"
        if self.gpu_spec is None:
            return "the GPU's total memory is not logged"
        if "kv_cache_gib" not in self.logged:
            return "no KV cache logged"
        return self.excluded

    @property
    def model_runner_v2(self) -> bool:
        return runs_model_runner_v2(self.vllm_version, self.model or "")

    @property
    def terms_label(self) -> str:
        """Which start-up terms this log's vLLM release uses: model runner and sampler, graphs."""
        if self.model_runner_v2:
            sampler = "V2"
        elif self.sampler == "flashinfer":
            sampler = "V1 flashinfer"
        else:
            sampler = "V1 triton" if self.vllm_version >= TRITON_TOP_K_TOP_P_SINCE else "V1 torch"
        graphs = "+graphs" if self.vllm_version >= CUDA_GRAPH_IN_BUDGET_SINCE else ""
        return sampler + graphs


def _version(text: object, row: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in str(text).split("."))
    except ValueError:
        raise DatasetError(f"{row}: vllm_version {text!r} must be dotted integers such as 0.11.0") from None
    if len(parts) < 2:
        raise DatasetError(f"{row}: vllm_version {text!r} must have at least major.minor")
    return parts


def parse_row(raw: dict[str, Any], lineno: int) -> StartupLog:
    row = f"line {lineno}"
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise DatasetError(f"{row}: missing {', '.join(missing)}")
    row = f"line {lineno} ({raw['id']})"
    url = raw["source_url"]
    if not isinstance(url, str) or not url.startswith("https://"):
        raise DatasetError(f"{row}: source_url must be an https:// address of the published log")
    if raw["split"] not in ("train", "test"):
        raise DatasetError(f"{row}: split must be 'train' or 'test', not {raw['split']!r}")
    logged = raw["logged"]
    if not isinstance(logged, dict) or not logged:
        raise DatasetError(f"{row}: logged must be an object with at least one figure")
    unknown = sorted(set(logged) - set(_LOGGED))
    if unknown:
        raise DatasetError(f"{row}: logged has unknown figures {unknown}; allowed: {', '.join(_LOGGED)}")
    for key, value in logged.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DatasetError(f"{row}: logged.{key} must be a number")
    for key in ("tp", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
        if isinstance(raw[key], bool) or not isinstance(raw[key], int) or raw[key] < 1:
            raise DatasetError(f"{row}: {key} must be a positive integer")
    util = raw["gpu_memory_utilization"]
    if not isinstance(util, int | float) or not 0 < util <= 1:
        raise DatasetError(f"{row}: gpu_memory_utilization must be in (0, 1]")
    inferred = raw.get("defaults_inferred", [])
    if not isinstance(inferred, list) or not set(inferred) <= set(_REQUIRED) | {"kv_cache_dtype"}:
        raise DatasetError(f"{row}: defaults_inferred must list engine settings")
    log = StartupLog(
        id=str(raw["id"]), source_url=url, vllm_version=_version(raw["vllm_version"], row),
        model=raw.get("model"), gpu=raw.get("gpu"), gpu_total_gib=raw.get("gpu_total_gib"), tp=raw["tp"],
        gpu_memory_utilization=float(util), max_num_batched_tokens=raw["max_num_batched_tokens"],
        max_num_seqs=raw["max_num_seqs"], max_model_len=raw["max_model_len"], block_size=raw["block_size"],
        kv_cache_dtype=str(raw.get("kv_cache_dtype", "auto")), sampler=raw.get("sampler"), split=raw["split"],
        logged={k: float(v) for k, v in logged.items()}, defaults_inferred=tuple(inferred),
        excluded=str(raw.get("excluded", "")),
    )
    try:  # resolve the names now, so a typo fails here
        _ = (log.spec, log.gpu_spec)
    except ValueError as exc:
        raise DatasetError(f"{row}: {exc}") from None
    return log


def load_logs(path: Path = DATA) -> list[StartupLog]:
    logs: list[StartupLog] = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"line {lineno}: not JSON: {exc.msg}") from None
        logs.append(parse_row(raw, lineno))
    ids = [log.id for log in logs]
    if len(set(ids)) != len(ids):
        raise DatasetError(f"duplicate ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    return logs


def _median(values: Iterable[float], what: str) -> float:
    vals = list(values)
    if not vals:
        raise DatasetError(f"no training log gives {what}")
    return statistics.median(vals)


@dataclass(frozen=True)
class Fit:
    profile: MemoryProfile  # vLLM's PyTorch sampler
    flashinfer_sampler_fp32_copies: float

    def profile_for(self, log: StartupLog) -> MemoryProfile:
        """The fitted constants, with the terms of the log's vLLM release (as the twin picks them)."""
        return profile_for_vllm(log.vllm_version, log.model or "", flashinfer_sampler=log.sampler == "flashinfer",
                                base=self.profile, flashinfer_fp32_copies=self.flashinfer_sampler_fp32_copies)


def fit(logs: Sequence[StartupLog]) -> Fit:
    """The memory plan's constants from the training logs (see the module docstring)."""
    train = [log for log in logs if log.split == "train"]
    tp1 = [log for log in train if log.tp == 1]
    tpn = [log for log in train if log.tp > 1]
    non_torch = _median((log.logged["non_torch_gib"] for log in tp1 if "non_torch_gib" in log.logged),
                        "non-torch memory at TP 1")
    tp_extra = _median((log.logged["non_torch_gib"] - non_torch for log in tpn if "non_torch_gib" in log.logged),
                       "non-torch memory at TP > 1")
    held: list[float] = []
    for log in tpn:
        if "free_at_start_gib" not in log.logged:
            continue
        same_gpu = [o.logged["free_at_start_gib"] for o in tp1
                    if "free_at_start_gib" in o.logged and o.gpu_total_gib == log.gpu_total_gib]
        if same_gpu:
            held.append(statistics.median(same_gpu) - log.logged["free_at_start_gib"])
    tp_startup = _median(held, "free memory at start-up at TP 1 and TP > 1 on one GPU")
    torch_copies: list[float] = []
    flashinfer_copies: list[float] = []
    for log in train:
        model = log.spec
        if model is None or log.model_runner_v2:
            continue  # model runner V2's warm-up is read from vLLM's source, not fitted
        if log.sampler != "flashinfer" and log.vllm_version >= TRITON_TOP_K_TOP_P_SINCE:
            continue  # so is model runner V1's Triton top-k/top-p (vLLM >= 0.17)
        per_copy = sampler_peak_bytes(model, log.max_num_batched_tokens, log.max_num_seqs, 1.0)
        forward = forward_peak_bytes(model, log.tp, log.max_num_batched_tokens)
        if "activation_peak_gib" in log.logged:
            activation = log.logged["activation_peak_gib"] * GiB
        elif log.plannable and "weights_gib" in log.logged:
            gpu = log.gpu_spec
            assert gpu is not None
            budget = log.gpu_memory_utilization * gpu.total_memory_bytes
            nt = (non_torch + (tp_extra if log.tp > 1 else 0)) * GiB
            activation = budget - (log.logged["weights_gib"] + log.logged["kv_cache_gib"]) * GiB - nt
        else:
            continue
        if activation <= forward:
            continue  # the forward pass is the peak: says nothing about the sampler
        (flashinfer_copies if log.sampler == "flashinfer" else torch_copies).append(activation / per_copy)
    # Only releases that take the estimate out of the budget: before 0.21 it was an opt-in preview
    # measured differently (vLLM 0.19 logs 2.35 GiB for Qwen3-8B where 0.21 logs 0.52 GiB for the
    # same capture sizes) and never reached the KV cache.
    graph = _median((log.logged["cuda_graph_estimate_gib"] / log.spec.num_hidden_layers
                     for log in train if "cuda_graph_estimate_gib" in log.logged and log.spec is not None
                     and log.vllm_version >= CUDA_GRAPH_IN_BUDGET_SINCE),
                    "a CUDA-graph estimate from vLLM >= 0.21")
    profile = MemoryProfile(
        non_torch_bytes=int(non_torch * GiB), tp_non_torch_bytes=int(tp_extra * GiB),
        tp_startup_bytes=int(tp_startup * GiB), sampler_fp32_copies=round(_median(torch_copies, "a sampler peak"), 1),
        cuda_graph_bytes_per_layer=int(graph * GiB), cuda_graph_in_budget=True,
    )
    return Fit(profile, round(_median(flashinfer_copies, "a FlashInfer sampler peak"), 1))


def planned_kv_bytes(log: StartupLog, profile: MemoryProfile) -> int | None:
    model, gpu = log.spec, log.gpu_spec
    assert model is not None and gpu is not None
    try:
        plan = plan_memory(model, gpu, tensor_parallel_size=log.tp, max_num_batched_tokens=log.max_num_batched_tokens,
                           max_num_seqs=log.max_num_seqs, max_model_len=log.max_model_len, block_size=log.block_size,
                           kv_cache_dtype=log.kv_cache_dtype, gpu_memory_utilization=log.gpu_memory_utilization,
                           profile=profile)
    except EngineStartupError:
        return None
    return plan.kv_cache_bytes


def error(log: StartupLog, profile: MemoryProfile) -> float:
    """Relative KV-cache error, twin against log (positive: the twin plans a bigger cache).
    A start-up the twin refuses counts as -100%."""
    kv = planned_kv_bytes(log, profile)
    logged = log.logged["kv_cache_gib"] * GiB
    return (kv - logged) / logged if kv is not None else -1.0


def _summary(errors: Sequence[float]) -> str:
    if not errors:
        return "no logs"
    abs_errors = [abs(e) for e in errors]
    return f"{len(errors):2d} logs, median {statistics.median(abs_errors):6.1%}, max {max(abs_errors):6.1%}"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--smoke", action="store_true",
                    help="the same run: it reads committed data only and takes about a second (CI)")
    args = ap.parse_args(argv)
    logs = load_logs(args.data)
    fitted = fit(logs)
    p, d = fitted.profile, FITTED_PROFILE
    print(f"{len(logs)} logs ({sum(1 for log in logs if log.plannable)} the twin can size), "
          f"{sum(1 for log in logs if log.vllm_version >= GOAL_VERSION)} from vLLM >= 0.17")
    print("fitted on the train logs        (kvpilot.twin.memory.FITTED_PROFILE):")
    rows = [("non-torch memory, TP 1", p.non_torch_bytes / GiB, d.non_torch_bytes / GiB, "GiB"),
            ("non-torch excess at TP > 1", p.tp_non_torch_bytes / GiB, d.tp_non_torch_bytes / GiB, "GiB"),
            ("held before the free-memory check", p.tp_startup_bytes / GiB, d.tp_startup_bytes / GiB, "GiB"),
            ("sampler fp32 logit copies", p.sampler_fp32_copies, d.sampler_fp32_copies, ""),
            ("  the same, FlashInfer sampler", fitted.flashinfer_sampler_fp32_copies, None, ""),
            ("  V1, Triton top-k/top-p (source)", V1_TRITON_SAMPLER_FP32_COPIES, None, ""),
            ("  model runner V2 (vLLM source)", DEFAULT_PROFILE.sampler_fp32_copies, None, ""),
            ("CUDA-graph estimate per layer", p.cuda_graph_bytes_per_layer / 2**20,
             d.cuda_graph_bytes_per_layer / 2**20, "MiB")]
    for name, value, default, unit in rows:
        note = "" if default is None else f"   (default {default:.2f}{unit and ' ' + unit})"
        print(f"  {name:36s} {value:6.2f} {unit:3s}{note}")
    print()
    print("terms: the model runner whose profiling run sizes the sampler warm-up (V1 torch: PyTorch top-k/top-p "
          "sort; V1 triton: vLLM >= 0.17's Triton top-k/top-p; V1 flashinfer; V2), +graphs: the CUDA-graph "
          "estimate comes out of the budget")
    print(f"{'log':34s} {'vLLM':9s} {'model':12s} {'gpu':14s} tp {'split':5s} {'terms':17s} {'logged':>8s} "
          f"{'twin':>8s} {'error':>7s} {'before':>7s}")
    groups: dict[tuple[str, bool], list[float]] = {}
    before: dict[tuple[str, bool], list[float]] = {}
    for log in logs:
        if not log.plannable:
            continue
        profile = fitted.profile_for(log)
        err, old = error(log, profile), error(log, PREVIOUS)
        kv = planned_kv_bytes(log, profile)
        recent = log.vllm_version >= GOAL_VERSION
        for key in ((log.split, False), (log.split, True)) if recent else ((log.split, False),):
            groups.setdefault(key, []).append(err)
            before.setdefault(key, []).append(old)
        twin = f"{kv / GiB:8.2f}" if kv is not None else "  refuse"
        print(f"{log.id:34s} {log.version_label:9s} {log.model or '-':12s} {log.gpu or '-':14s} {log.tp:2d} "
              f"{log.split:5s} {log.terms_label:17s} {log.logged['kv_cache_gib']:8.2f} {twin} {err:+7.1%} "
              f"{old:+7.1%}")
    for log in logs:
        if not log.plannable:
            print(f"{log.id:34s} {log.version_label:9s} not sized: {log.unplannable_reason}; feeds only the terms "
                  "it logs")
    print()
    print("KV-cache error |twin - logged| / logged (before: the constants the twin had before the fit)")
    for split in ("train", "test"):
        for recent in (False, True):
            label = f"{split:5s} {'vLLM >= 0.17' if recent else 'all versions'}"
            print(f"  {label:20s} fitted: {_summary(groups.get((split, recent), []))}   "
                  f"before: {_summary(before.get((split, recent), []))}")
    held_out = [abs(e) for e in groups.get(("test", True), [])]
    if held_out:
        met = statistics.median(held_out) <= GOAL_MEDIAN and max(held_out) <= GOAL_MAX
        verdict = "met" if met else "not met"
    else:
        verdict = "not evaluable: no held-out log from vLLM >= 0.17 that the twin can size"
    print(f"goal on held-out vLLM >= 0.17 logs (median <= {GOAL_MEDIAN:.0%}, max <= {GOAL_MAX:.0%}): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
