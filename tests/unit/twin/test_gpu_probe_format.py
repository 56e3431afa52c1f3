"""benchmarks/gpu_probe.py's output and benchmarks/twin_vs_gpu.py, which reads it (CPU only, no GPU).

The probe needs PyTorch, which the project does not depend on: where torch is not importable the
probe-run test skips, and the others write a synthetic probe folder with the probe's own writer
(`write_outputs`, importable without torch) from the twin's predictions with known distortions,
then check that twin_vs_gpu.py reads it, measures the distortions and refits them away.
KVPILOT_PROBE_PYTHON names an interpreter with torch to run the probe with (e.g. a separate venv).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpilot.twin.calibration.layers import load_profile
from kvpilot.twin.hardware import resolve_gpu
from kvpilot.twin.steptime import StepTimeModel, kernel_params_for, linear_layer_breakdown

ROOT = Path(__file__).resolve().parents[3]
PROBE = ROOT / "benchmarks" / "gpu_probe.py"
COMPARE = ROOT / "benchmarks" / "twin_vs_gpu.py"
H200 = resolve_gpu("H200")
GEMM_FACTOR, ELEMENTWISE_FACTOR, ATTN_FACTOR = 1.25, 2.0, 1.5


def _probe_module() -> Any:
    spec = importlib.util.spec_from_file_location("kvpilot_gpu_probe", PROBE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_compare(folder: Path, *args: str) -> str:
    out = subprocess.run([sys.executable, str(COMPARE), str(folder), *args], capture_output=True, text=True,
                         timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _synthetic(folder: Path) -> None:
    """A probe result as an H200 run would write it, with times = the twin's x known factors."""
    g = _probe_module()
    from benchmarks_twin_vs_gpu import model_spec  # loaded by the module fixture

    result: dict[str, Any] = {
        "schema": g.SCHEMA, "device": {"name": "NVIDIA H200", "device_type": "cuda", "torch": "synthetic"},
        "settings": {"reps": 15, "flush_l2": True, "quick": False}, "impl": g.IMPL,
        "models": {k: {kk: v for kk, v in m.items() if kk != "tp"} for k, m in g.MODELS.items()},
        "linear": [], "attention": [], "warnings": [], "complete": True, "elapsed_s": 1.0,
    }
    p = kernel_params_for(H200)
    for key, m in g.MODELS.items():
        spec = model_spec(key, m)
        for tp in m["tp"]:
            for t in g.TOKENS_FULL:
                parts = linear_layer_breakdown(spec, H200, tp, t, p)
                ops = {"emb": 0.01}
                for op, sec in parts.items():
                    factor = GEMM_FACTOR if op.endswith("_proj") else ELEMENTWISE_FACTOR if op != "add" else 1.0
                    ops[op] = sec * 1e3 * factor
                result["linear"].append({"model": key, "tp": tp, "num_tokens": t, "errors": {},
                                         "ops": {op: dict.fromkeys(g.STATS, ms) | {"std": 0.0} for op, ms in ops.items()}})
            stm = StepTimeModel(spec, H200, tp, p)
            s = g.shard_shapes(m, tp)
            for chunk, ctx in g.PREFILL_FULL:
                pairs = chunk * (ctx + (chunk + 1) / 2.0)
                ms = stm.attention_time(pairs, 0.0, 1) * 1e3 / spec.num_hidden_layers * ATTN_FACTOR
                result["attention"].append({
                    "model": key, "tp": tp, "kind": "prefill", "batch": 1, "query_len": chunk, "context": ctx,
                    "kv_len": ctx + chunk, "q_heads": s["q_heads"], "kv_heads": s["kv_heads"], "head_dim": 128,
                    "causal": "lower_right", "gqa": "native", "backend": "flash", "pairs": pairs,
                    "decode_kv_tokens": 0, "ms": dict.fromkeys(g.STATS, ms)})
            for batch, ctx in g.DECODE_FULL:
                ms = stm.attention_time(0.0, batch * ctx, batch) * 1e3 / spec.num_hidden_layers * ATTN_FACTOR
                result["attention"].append({
                    "model": key, "tp": tp, "kind": "decode", "batch": batch, "query_len": 1, "context": ctx,
                    "kv_len": ctx, "q_heads": s["q_heads"], "kv_heads": s["kv_heads"], "head_dim": 128,
                    "causal": "none", "gqa": "native", "backend": "flash", "pairs": batch * ctx,
                    "decode_kv_tokens": batch * ctx, "ms": dict.fromkeys(g.STATS, ms)})
    g.write_outputs(folder, result)


@pytest.fixture(autouse=True, scope="module")
def _compare_importable() -> Any:
    spec = importlib.util.spec_from_file_location("benchmarks_twin_vs_gpu", COMPARE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks_twin_vs_gpu"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("benchmarks_twin_vs_gpu", None)


def _figures(text: str, label: str) -> list[tuple[float, float]]:
    """(median, max) percentages of every line's `label: median X % max Y %`."""
    pat = re.compile(rf"{label}: median\s+([\d.]+) % max\s+([\d.]+) %")
    return [(float(a), float(b)) for a, b in pat.findall(text)]


def test_synthetic_probe_output_is_read_measured_and_refitted(tmp_path: Path) -> None:
    _synthetic(tmp_path)
    csvs = sorted(tmp_path.glob("h200_*.mlp.csv"))
    assert [c.name for c in csvs] == ["h200_meta-llama_Llama-3.1-70B.mlp.csv", "h200_meta-llama_Meta-Llama-3-8B.mlp.csv"]
    prof = load_profile(csvs[1])  # the Vidur layout, as the calibration reads it
    assert prof.gpu is H200 and set(prof.tp.tolist()) == {1, 2, 4} and len(prof.ops) == 9
    assert prof.model.num_key_value_heads == 8 and prof.model.intermediate_size == 14336

    out = _run_compare(tmp_path)
    assert "twin GPU: H200" in out
    gemm = _figures(out, "GEMMs")
    assert len(gemm) >= 6
    # Before any refit (the first 6 lines): the twin is 1/1.25 of the measured GEMMs: 20 % off.
    expected = 100 * (1 - 1 / GEMM_FACTOR)
    assert all(abs(med - expected) < 0.5 for med, _ in gemm[:6]), gemm[:6]
    # After the GEMM-only refit the GEMMs are matched again (1.25x is within the constants' reach).
    section = out.split("-- GEMMs only", 1)[1].split("-- attention", 1)[0]
    after = _figures(section, "GEMMs")
    assert len(after) == 6 and all(mx < 3.0 for _, mx in after), section
    attn_before = re.search(r"prefill n=\d+\s+median\s+([\d.]+) %", out)
    assert attn_before and abs(float(attn_before.group(1)) - 100 * (1 - 1 / ATTN_FACTOR)) < 1.0
    attn_after = out.split("-- attention constants", 1)[1]
    assert all(float(x) < 3.0 for x in re.findall(r"median\s+([\d.]+) %", attn_after)), attn_after
    assert "calibration.fit, architecture constants" in out and "every linear constant" in out


def test_missing_op_is_left_out_and_reported(tmp_path: Path) -> None:
    _synthetic(tmp_path)
    data = json.loads((tmp_path / "probe.json").read_text())
    for r in data["linear"]:
        if r["tp"] == 2:
            del r["ops"]["attn_rope"]
            r["errors"]["attn_rope"] = "RuntimeError: no kernel"
    (tmp_path / "probe.json").write_text(json.dumps(data))
    out = _run_compare(tmp_path, "--brief")
    assert "ops that failed somewhere in the probe: attn_rope" in out
    assert "left out of both sides): attn_rope" in out
    assert "calibration.fit, architecture constants" in out  # the complete groups are still fitted


def _probe_python() -> str | None:
    env = os.environ.get("KVPILOT_PROBE_PYTHON")
    if env:
        return env
    return sys.executable if importlib.util.find_spec("torch") is not None else None


@pytest.mark.skipif(_probe_python() is None, reason="PyTorch is not importable (set KVPILOT_PROBE_PYTHON)")
def test_probe_cpu_quick_run_end_to_end(tmp_path: Path) -> None:
    python = _probe_python()
    assert python
    run = subprocess.run([python, str(PROBE), "--device", "cpu", "--quick", "--out", str(tmp_path),
                          "--fail-op", "attn_rope"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads((tmp_path / "probe.json").read_text())
    assert data["schema"] == "kvpilot-gpu-probe/1" and data["linear"] and data["attention"]
    assert all("attn_rope" in r["errors"] and "mlp_up_proj" in r["ops"] for r in data["linear"])
    assert all("ms" in r for r in data["attention"])
    (csv_file,) = tmp_path.glob("cpu_*.mlp.csv")
    assert "attn_rope" not in csv_file.read_text().splitlines()[0]
    out = _run_compare(tmp_path, "--gpu", "H200")
    assert "ops that failed somewhere in the probe: attn_rope" in out
    assert _figures(out, "GEMMs") and np.isfinite([m for m, _ in _figures(out, "GEMMs")]).all()
