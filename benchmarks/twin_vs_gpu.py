"""The engine twin's step-time model against what benchmarks/gpu_probe.py measured on a real GPU.

    python benchmarks/twin_vs_gpu.py PROBE_DIR [--gpu H200] [--no-refit]
    python benchmarks/twin_vs_gpu.py --smoke     # on the committed H200 probe

PROBE_DIR holds the probe's probe.json.  For every model and tensor-parallel size it prints the
relative error |twin - measured| / measured of the per-layer linear time (`linear_layer_breakdown`
/ `per_layer_linear_time` of kvpilot.twin.steptime, with the GPU's calibrated constants) over the
token counts measured: median and max for the whole layer (the ops measured, `emb` left out as in
the calibration), for the four GEMMs alone, and per op with the median ratio twin/measured.  The
probe runs RMSNorm, rotary and SiLU-and-mul as eager PyTorch, slower than vLLM's fused kernels the
twin's constants were fitted on, so the GEMM figures are the fair ones for those ops.

Attention: per shape, the twin's per-layer attention term (StepTimeModel.attention_time with one
layer: floor + pairs x FLOPs / prefill rate, or KV bytes / decode rate) against the measured
`scaled_dot_product_attention`, at the (query, key) pairs the measured kernel computed.

Then, unless --no-refit, what the errors become with constants refitted on this data:
kvpilot.twin.calibration.layers.fit on the per-architecture constants (CLASS_FIELDS) and on every linear
constant (FIT_FIELDS), starting from the GPU's current constants; a GEMM-only refit of the GEMM
constants; and a refit of the three attention constants.  Printed, not stored.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: kvpilot

from kvpilot.twin.calibration.fit import fit_loss, log_error_loss  # noqa: E402
from kvpilot.twin.calibration.layers import CLASS_FIELDS, FIT_FIELDS, Profile, fit  # noqa: E402
from kvpilot.twin.hardware import GPU_PRESETS, GpuSpec, UnknownGpuError, resolve_gpu  # noqa: E402
from kvpilot.twin.models import ModelSpec  # noqa: E402
from kvpilot.twin.steptime import StepTimeModel, StepTimeParams, kernel_params_for, linear_layer_breakdown  # noqa: E402

GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
EAGER = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act")
# The per-GPU GEMM constants (kernel efficiencies and launch floor); the roofline's shape
# (sharpness, ramp) stays shared by every GPU, as in kvpilot.twin.calibration.layers.
GEMM_FIELDS = ("gemm_compute_eff", "gemm_memory_eff", "gemm_floor_s")
ATTN_FIELDS = ("attn_prefill_eff", "attn_decode_eff", "attn_floor_s")


def pick_gpu(name: str | None, device_name: str) -> tuple[GpuSpec, str]:
    """The GpuSpec to compare against: --gpu, else the probe's device name, else H200."""
    if name:
        return resolve_gpu(name), "from --gpu"
    try:
        return resolve_gpu(device_name), f"from the device name {device_name!r}"
    except UnknownGpuError:
        pass
    low = device_name.lower()
    for preset in sorted(GPU_PRESETS, key=len, reverse=True):
        stem = preset.lower().split("-")[0]
        if re.search(rf"(^|[^a-z0-9]){re.escape(stem)}($|[^a-z0-9])", low):
            return GPU_PRESETS[preset], f"matched in the device name {device_name!r}"
    return resolve_gpu("H200"), f"device {device_name!r} is no preset: compared against H200 anyway"


def model_spec(key: str, m: dict[str, Any]) -> ModelSpec:
    return ModelSpec(
        name=key,
        hidden_size=int(m["n_embd"]),
        intermediate_size=int(m["n_expanded_embd"]),
        num_hidden_layers=1,
        num_attention_heads=int(m["n_head"]),
        num_key_value_heads=int(m["n_kv_head"]),
        head_dim=int(m.get("head_dim") or int(m["n_embd"]) // int(m["n_head"])),
        vocab_size=int(m["vocab_size"]),
        gated_mlp=bool(m["use_gated_mlp"]),
        dtype="bfloat16",
    )


class Group:
    """The linear rows of one (model, tp): tokens and per-op measured medians in seconds."""

    def __init__(self, key: str, model: ModelSpec, tp: int, rows: list[dict[str, Any]], twin_ops: tuple[str, ...]):
        rows = sorted(rows, key=lambda r: r["num_tokens"])
        self.key, self.model, self.tp = key, model, tp
        self.tokens = np.array([r["num_tokens"] for r in rows])
        self.ops = tuple(op for op in twin_ops if rows and all(op in r["ops"] for r in rows))
        self.missing = tuple(op for op in twin_ops if op not in self.ops)
        self.measured = {op: np.array([r["ops"][op]["median"] for r in rows]) * 1e-3 for op in self.ops}

    def predicted(self, gpu: GpuSpec, params: StepTimeParams) -> dict[str, np.ndarray]:
        parts = linear_layer_breakdown(self.model, gpu, self.tp, self.tokens, params)
        return {op: np.asarray(parts[op]) for op in self.ops}

    def total(self, values: dict[str, np.ndarray], ops: tuple[str, ...]) -> np.ndarray:
        return np.sum([values[op] for op in ops if op in self.ops], axis=0)


def rel(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred - meas) / meas


def pct(x: float) -> str:
    return f"{x * 100:6.1f} %"


def report_linear(groups: list[Group], gpu: GpuSpec, params: StepTimeParams, per_op: bool) -> None:
    for g in groups:
        pred = g.predicted(gpu, params)
        ops = g.ops
        gemms = tuple(op for op in GEMMS if op in ops)
        if not ops:
            print(f"  {g.key} tp {g.tp}: no op measured at every token count")
            continue
        e_all = rel(g.total(pred, ops), g.total(g.measured, ops))
        worst = int(e_all.argmax())
        line = (f"  {g.key:<28} tp {g.tp}  n={len(g.tokens):<3} layer: median {pct(float(np.median(e_all)))} "
                f"max {pct(float(e_all.max()))} (at {g.tokens[worst]} tokens)")
        if gemms:
            e_g = rel(g.total(pred, gemms), g.total(g.measured, gemms))
            line += f"   GEMMs: median {pct(float(np.median(e_g)))} max {pct(float(e_g.max()))}"
        print(line)
        if g.missing:
            print(f"      not measured at every token count (left out of both sides): {', '.join(g.missing)}")
        if not per_op:
            continue
        for op in ops:
            e = rel(pred[op], g.measured[op])
            ratio = float(np.median(pred[op] / g.measured[op]))
            extra = ""
            if op in GEMMS:
                extra = _achieved(g, op)
            tag = "  (eager in the probe)" if op in EAGER else ""
            print(f"      {op:<26} median {pct(float(np.median(e)))}  max {pct(float(e.max()))}  "
                  f"twin/measured x{ratio:5.2f}{extra}{tag}")


def _achieved(g: Group, op: str) -> str:
    """Achieved TFLOP/s at the largest token count and weight GB/s at the smallest, for a GEMM."""
    m, tp = g.model, g.tp
    q = m.q_size // tp
    kv = max(1, m.num_key_value_heads // tp) * m.head_dim
    i = m.intermediate_size // tp
    h = m.hidden_size
    k, n = {
        "attn_pre_proj": (h, q + 2 * kv),
        "attn_post_proj": (q, h),
        "mlp_up_proj": (h, (2 if m.gated_mlp else 1) * i),
        "mlp_down_proj": (i, h),
    }[op]
    t_hi, t_lo = g.tokens[-1], g.tokens[0]
    tflops = 2.0 * t_hi * k * n / g.measured[op][-1] / 1e12
    gbs = k * n * m.dtype_bytes / g.measured[op][0] / 1e9
    return f"  [{tflops:6.1f} TFLOP/s at {t_hi} tok, {gbs:6.0f} GB/s weights at {t_lo} tok]"


def attention_rows(probe: dict[str, Any], specs: dict[str, ModelSpec]) -> list[dict[str, Any]]:
    return [r for r in probe.get("attention", []) if "ms" in r and r.get("model") in specs]


def attention_pred(r: dict[str, Any], spec: ModelSpec, gpu: GpuSpec, params: StepTimeParams) -> float:
    stm = StepTimeModel(spec, gpu, int(r["tp"]), params)
    if r["kind"] == "prefill":
        return stm.attention_time(float(r["pairs"]), 0.0, int(r["batch"]))
    return stm.attention_time(0.0, float(r["decode_kv_tokens"]), int(r["batch"]))


def report_attention(rows: list[dict[str, Any]], specs: dict[str, ModelSpec], gpu: GpuSpec,
                     params: StepTimeParams, detail: bool) -> None:
    if not rows:
        print("  (no attention measured)")
        return
    errs: dict[str, list[float]] = {"prefill": [], "decode": []}
    for r in rows:
        meas = r["ms"]["median"] * 1e-3
        pred = attention_pred(r, specs[r["model"]], gpu, params)
        errs[r["kind"]].append(abs(pred - meas) / meas)
        if detail:
            shape = (f"chunk {r['query_len']:>5} ctx {r['context']:>6}" if r["kind"] == "prefill"
                     else f"batch {r['batch']:>4} ctx {r['context']:>6}")
            note = f"{r.get('backend')}, {r.get('causal')}, gqa {r.get('gqa')}"
            print(f"  {r['model']:<28} tp {r['tp']} {r['kind']:<7} {shape}: measured {meas * 1e3:8.4f} ms  "
                  f"twin {pred * 1e3:8.4f} ms  twin/measured x{pred / meas:5.2f}  [{note}]")
    for kind, e in errs.items():
        if e:
            print(f"  {kind:<7} n={len(e):<3} median {pct(float(np.median(e)))}  max {pct(float(np.max(e)))}")


def consts(p: StepTimeParams, names: tuple[str, ...]) -> str:
    return ", ".join(f"{n}={getattr(p, n):.4g}" for n in names)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe_dir", nargs="?", default=os.environ.get("OUT"), help="the probe's --out folder")
    ap.add_argument("--gpu", help="twin GPU preset to compare against (default: from the probe's device name)")
    ap.add_argument("--no-refit", action="store_true")
    ap.add_argument("--brief", action="store_true", help="no per-op and per-shape lines")
    ap.add_argument("--smoke", action="store_true",
                    help="the committed H200 probe (benchmarks/data/h200), the whole report in seconds (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.probe_dir = str(Path(__file__).resolve().parent / "data" / "h200")
    if not args.probe_dir:
        ap.error("no probe folder given")
    path = Path(args.probe_dir) / "probe.json"
    probe = json.loads(path.read_text())
    dev = probe.get("device", {})
    gpu, how = pick_gpu(args.gpu, str(dev.get("name", "")))
    base = kernel_params_for(gpu)
    st = probe.get("settings", {})
    print(f"probe: {path}  device {dev.get('name')}  torch {dev.get('torch')}  "
          f"{'complete' if probe.get('complete') else 'INCOMPLETE'}  ({probe.get('elapsed_s', '?')} s; "
          f"reps {st.get('reps')}, L2 flush {st.get('flush_l2')}{', quick' if st.get('quick') else ''})")
    if dev.get("device_type") == "cpu":
        print("NOTE: measured on a CPU: these figures check the pipeline only, they say nothing of the twin.")
    print(f"twin GPU: {gpu.name} ({how}; architecture {gpu.architecture or '-'}, "
          f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s bf16, {gpu.hbm_bandwidth / 1e12:.2f} TB/s)")
    print(f"constants: {consts(base, CLASS_FIELDS)}")
    for w in probe.get("warnings", []):
        print(f"probe warning: {w}")

    twin_ops = tuple(linear_layer_breakdown(model_spec("x", {
        "n_embd": 64, "n_expanded_embd": 128, "n_head": 4, "n_kv_head": 4, "vocab_size": 8, "use_gated_mlp": True,
    }), gpu, 1, 1))
    specs = {k: model_spec(k, m) for k, m in probe.get("models", {}).items()}
    by_group: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in probe.get("linear", []):
        if r.get("model") in specs:
            by_group.setdefault((r["model"], int(r["tp"])), []).append(r)
    groups = [Group(k, specs[k], tp, rows, twin_ops) for (k, tp), rows in sorted(by_group.items())]
    groups = [g for g in groups if len(g.tokens)]
    failed = sorted({op for r in probe.get("linear", []) for op in r.get("errors", {})})
    if failed:
        print(f"ops that failed somewhere in the probe: {', '.join(failed)}")
    if not groups:
        print("no linear measurements in the probe output")
        return 1

    print("\n== per-layer linear time: twin (current constants) vs measured")
    report_linear(groups, gpu, base, per_op=not args.brief)
    arows = attention_rows(probe, specs)
    print("\n== attention per layer: twin vs measured")
    report_attention(arows, specs, gpu, base, detail=not args.brief)
    if args.no_refit:
        return 0

    print("\n== refitted on this data (printed only; nothing stored)")
    complete = [g for g in groups if not g.missing]
    if complete:
        profiles = [
            Profile(name=f"{g.key} tp{g.tp}", gpu=gpu, model=g.model, tokens=g.tokens, tp=np.full(len(g.tokens), g.tp),
                    measured_s=g.total(g.measured, g.ops), ops=g.ops)
            for g in complete
        ]
        for label, names in (("architecture constants (CLASS_FIELDS)", CLASS_FIELDS),
                             ("every linear constant (FIT_FIELDS)", FIT_FIELDS)):
            p = fit(profiles, base, names)
            print(f"-- calibration.fit, {label}: {consts(p, names)}")
            report_linear(complete, gpu, p, per_op=False)
    else:
        print("-- calibration.fit skipped: some op is missing from every group (the fit needs the whole layer)")

    gemm_groups = [g for g in groups if all(op in g.ops for op in GEMMS)]
    if gemm_groups:
        def gemm_loss(p: StepTimeParams) -> float:
            pred = np.concatenate([g.total(g.predicted(gpu, p), GEMMS) for g in gemm_groups])
            meas = np.concatenate([g.total(g.measured, GEMMS) for g in gemm_groups])
            return log_error_loss(pred, meas)

        p = fit_loss(gemm_loss, base, GEMM_FIELDS)
        print(f"-- GEMMs only (the ops the probe runs as vLLM does), {consts(p, GEMM_FIELDS)}")
        report_linear(gemm_groups, gpu, p, per_op=False)

    if len(arows) >= 2:
        meas_a = np.array([r["ms"]["median"] * 1e-3 for r in arows])

        def attn_loss(p: StepTimeParams) -> float:
            pred = np.array([attention_pred(r, specs[r["model"]], gpu, p) for r in arows])
            return log_error_loss(pred, meas_a)

        p = fit_loss(attn_loss, base, ATTN_FIELDS)
        print(f"-- attention constants, {consts(p, ATTN_FIELDS)}")
        report_attention(arows, specs, gpu, p, detail=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
