"""Time one transformer layer's ops on a real GPU, op by op as the Vidur profiles break them down.

    python benchmarks/gpu_probe.py [--out DIR] [--quick] [--device cuda|cpu] [--configs 8b:1,70b:8]
    python benchmarks/gpu_probe.py --smoke    # no GPU: the committed H200 probe's CSVs written again (CI)

Standalone on purpose: it imports only torch, the standard library and (if present) numpy, never
kvpilot, so it runs on a bare GPU machine with PyTorch (no vLLM).  `benchmarks/twin_vs_gpu.py`
reads what it writes and compares it with the engine twin.

What is timed, in bf16, one rank of tensor parallelism emulated on one GPU (shapes sharded as vLLM
shards them: QKV and gate/up column-parallel, O and down row-parallel, KV heads replicated when TP
exceeds their number, vocabulary split over ranks):

- the ops of Vidur's `*.mlp.csv` profiles, per token count: emb, input_layernorm, attn_pre_proj
  (QKV), attn_rope, attn_post_proj (O), post_attention_layernorm, mlp_up_proj (gate+up),
  mlp_act (SiLU-and-mul), mlp_down_proj, add (residual), for Llama-3-8B at TP 1/2/4 and
  Llama-3.1-70B at TP 2/4/8.  The four GEMMs run `torch.nn.functional.linear` (cuBLAS), which is
  what vLLM runs for unquantised weights.  vLLM runs RMSNorm, rotary and SiLU-and-mul as fused
  custom CUDA kernels that a bare PyTorch does not have: here they are PyTorch eager code
  (`F.rms_norm` where it exists, vLLM's `forward_native` rotary, `silu(x1) * x2`), so they are
  upper bounds for those ops, several kernels each; the JSON says which implementation ran.
- attention with `scaled_dot_product_attention` (flash backend where it accepts the shape, else
  whichever backend does; recorded): prefill chunks (chunk tokens after `context` cached ones,
  causal aligned lower right, as chunked prefill is) and decodes (batch x 1 query over a context
  of KV each).  Not paged: vLLM's paged FlashAttention reads the same bytes from blocks.

Each figure is min/max/mean/median/std in milliseconds over --reps repetitions timed with CUDA
events after --warmup untimed runs, with the L2 cache flushed before each repetition (a layer's
weights are cold in real inference: the previous layers' evicted them).  Output, in --out (default
$OUT): probe.json (everything, written after every configuration so a cut-short run keeps what it
measured) and one `<gpu>_<model>.mlp.csv` per model in the Vidur column layout, which
kvpilot.twin.calibration.layers.load_profile reads (ops that failed are left out of the CSV; see the
JSON's errors).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

try:  # Without torch the module still imports, so tests can use its output format (write_outputs).
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - depends on the machine
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

SCHEMA = "kvpilot-gpu-probe/1"

MODELS: dict[str, dict[str, Any]] = {
    # Keys are the Vidur file stems (`<gpu>_<key>.mlp.csv`).
    "meta-llama_Meta-Llama-3-8B": {
        "alias": "8b", "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_expanded_embd": 14336,
        "vocab_size": 128256, "use_gated_mlp": True, "head_dim": 128, "rope_theta": 500000.0,
        "tp": (1, 2, 4),
    },
    "meta-llama_Llama-3.1-70B": {
        "alias": "70b", "n_head": 64, "n_kv_head": 8, "n_embd": 8192, "n_expanded_embd": 28672,
        "vocab_size": 128256, "use_gated_mlp": True, "head_dim": 128, "rope_theta": 500000.0,
        "tp": (2, 4, 8),
    },
}

OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
STATS = ("min", "max", "mean", "median", "std")

TOKENS_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192,
               12288, 16384)
TOKENS_QUICK = (1, 64, 1024, 8192)
TOKENS_CPU_QUICK = (1, 8, 32)
# (chunk, context) for prefill; (batch, context) for decode.
PREFILL_FULL = ((512, 0), (2048, 0), (8192, 0), (512, 4096), (2048, 8192), (512, 30000))
DECODE_FULL = ((1, 1024), (16, 2048), (64, 4096), (256, 1024), (128, 8192), (32, 32768))
PREFILL_QUICK = ((2048, 0), (512, 4096))
DECODE_QUICK = ((64, 4096),)
PREFILL_CPU_QUICK = ((32, 0), (16, 64))
DECODE_CPU_QUICK = ((4, 128),)

IMPL = {
    "emb": "F.embedding over vocab/tp rows (vLLM VocabParallelEmbedding without its out-of-shard mask)",
    "input_layernorm": "F.rms_norm (eager; vLLM: fused rms_norm CUDA kernel)",
    "post_attention_layernorm": "F.rms_norm (eager; vLLM: fused rms_norm CUDA kernel)",
    "attn_pre_proj": "F.linear bf16 (cuBLAS), [t, h] x [h, (q + 2 kv)/tp]",
    "attn_rope": "vLLM RotaryEmbedding.forward_native, neox style, q and k (eager; vLLM: fused CUDA kernel)",
    "attn_post_proj": "F.linear bf16 (cuBLAS), [t, q/tp] x [q/tp, h]",
    "mlp_up_proj": "F.linear bf16 (cuBLAS), [t, h] x [h, 2 i/tp] (merged gate+up)",
    "mlp_act": "F.silu(x[:, :d]) * x[:, d:] (eager, two kernels; vLLM: fused silu_and_mul CUDA kernel)",
    "mlp_down_proj": "F.linear bf16 (cuBLAS), [t, i/tp] x [i/tp, h]",
    "add": "residual x + y, [t, h]",
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------- timing


class Timer:
    """Times a callable: CUDA events on a GPU (L2 flushed before each rep), perf_counter on a CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int, flush_l2: bool) -> None:
        self.device, self.warmup, self.reps = device, warmup, reps
        self.cuda = device.type == "cuda"
        self.flush_buf = None
        if self.cuda and flush_l2:
            # 256 MiB: several times the L2 of any current GPU (H100/H200: 50 MB).
            self.flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device)

    def __call__(self, fn) -> dict[str, float]:
        for _ in range(self.warmup):
            fn()
        times: list[float] = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            pairs = []
            for _ in range(self.reps):
                if self.flush_buf is not None:
                    self.flush_buf.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                pairs.append((start, end))
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in pairs]
        else:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return {
            "min": min(times), "max": max(times), "mean": statistics.fmean(times),
            "median": statistics.median(times), "std": statistics.pstdev(times),
        }


# ------------------------------------------------------------------------------------- the ops


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope_cache(head_dim: int, max_pos: int, theta: float, device: torch.device, dtype) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(max_pos, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rope_native(positions, q, k, cache, head_dim: int):
    """vLLM RotaryEmbedding.forward_native (neox style, full rotary dim)."""
    cos_sin = cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)

    def rot(x):
        shape = x.shape
        x = x.view(shape[0], -1, head_dim)
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).reshape(shape)

    return rot(q), rot(k)


def shard_shapes(m: dict[str, Any], tp: int) -> dict[str, int]:
    """Per-rank sizes as vLLM shards them."""
    hd = m["head_dim"]
    q_heads = m["n_head"] // tp
    kv_heads = max(1, m["n_kv_head"] // tp)
    inter = m["n_expanded_embd"] // tp
    return {
        "hidden": m["n_embd"], "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": hd,
        "q": q_heads * hd, "kv": kv_heads * hd, "inter": inter,
        "up": (2 if m["use_gated_mlp"] else 1) * inter, "vocab": -(-m["vocab_size"] // tp),
    }


def _randn(shape, device, dtype, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def _failing(op: str):
    def fn():
        raise RuntimeError(f"{op}: made to fail by --fail-op (a test of the error path)")
    return fn


def probe_linear(m: dict[str, Any], tp: int, tokens: list[int], timer: Timer, device, dtype,
                 deadline: float, fail_ops: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], list[str]]:
    s = shard_shapes(m, tp)
    h, q, kv, inter, up, hd = s["hidden"], s["q"], s["kv"], s["inter"], s["up"], s["head_dim"]
    tmax = max(tokens)
    w = {
        "qkv": _randn((q + 2 * kv, h), device, dtype),
        "o": _randn((h, q), device, dtype),
        "up": _randn((up, h), device, dtype),
        "down": _randn((h, inter), device, dtype),
        "ln1": torch.ones(h, device=device, dtype=dtype),
        "ln2": torch.ones(h, device=device, dtype=dtype),
        "emb": torch.empty((s["vocab"], h), device=device, dtype=dtype).normal_(0, 0.02),
    }
    cache = _rope_cache(hd, max(tmax, 8192), m["rope_theta"], device, dtype)
    x_h = _randn((tmax, h), device, dtype, 1.0)
    y_h = _randn((tmax, h), device, dtype, 1.0)
    x_q = _randn((tmax, q), device, dtype, 1.0)
    x_qkv = _randn((tmax, q + 2 * kv), device, dtype, 1.0)
    x_up = _randn((tmax, up), device, dtype, 1.0)
    x_i = _randn((tmax, inter), device, dtype, 1.0)
    ids = torch.randint(0, s["vocab"], (tmax,), device=device)
    pos = torch.randint(0, cache.shape[0], (tmax,), device=device)

    rows: list[dict[str, Any]] = []
    warnings: list[str] = []
    for t in tokens:
        if time.monotonic() > deadline:
            warnings.append(f"time budget spent: skipped tokens >= {t} for tp {tp}")
            log(f"    ! {warnings[-1]}")
            break
        qkv_t = x_qkv[:t]
        fns = {
            "emb": lambda t=t: F.embedding(ids[:t], w["emb"]),
            "input_layernorm": lambda t=t: _rms_norm(x_h[:t], w["ln1"]),
            "attn_pre_proj": lambda t=t: F.linear(x_h[:t], w["qkv"]),
            "attn_rope": lambda t=t, qkv_t=qkv_t: _rope_native(pos[:t], qkv_t[:, :q], qkv_t[:, q:q + kv], cache, hd),
            "attn_post_proj": lambda t=t: F.linear(x_q[:t], w["o"]),
            "post_attention_layernorm": lambda t=t: _rms_norm(y_h[:t], w["ln2"]),
            "mlp_up_proj": lambda t=t: F.linear(x_h[:t], w["up"]),
            "mlp_act": lambda t=t: F.silu(x_up[:t, :inter]) * x_up[:t, inter:],
            "mlp_down_proj": lambda t=t: F.linear(x_i[:t], w["down"]),
            "add": lambda t=t: x_h[:t] + y_h[:t],
        }
        row: dict[str, Any] = {"tp": tp, "num_tokens": t, "ops": {}, "errors": {}}
        for op in OPS:
            try:
                row["ops"][op] = timer(_failing(op) if op in fail_ops else fns[op])
            except Exception as e:  # noqa: BLE001 - record and carry on
                row["errors"][op] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        med = {op: row["ops"][op]["median"] for op in row["ops"]}
        gemm = sum(med.get(k, 0.0) for k in ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj"))
        total = sum(v for k, v in med.items() if k != "emb")
        errs = f"  errors: {sorted(row['errors'])}" if row["errors"] else ""
        log(f"    tp {tp} tokens {t:>6}: layer {total:8.4f} ms (GEMMs {gemm:8.4f} ms){errs}")
    return rows, warnings


def _sdpa(q, k, v, causal: str, gqa: str):
    if gqa == "expanded" and k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    kwargs = {"enable_gqa": True} if gqa == "native" and k.shape[1] != q.shape[1] else {}
    if causal == "lower_right":
        from torch.nn.attention.bias import causal_lower_right  # torch >= 2.3; an ImportError falls back

        mask = causal_lower_right(q.shape[2], k.shape[2])
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    if causal == "top_left":  # q_len == kv_len: the same as lower right
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    return lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)


def _backends(device) -> list[tuple[str, Any]]:
    """(name, context-manager factory) to try in order."""
    import contextlib

    out: list[tuple[str, Any]] = []
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if device.type == "cuda":
            out.append(("flash", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])))
            out.append(("efficient", lambda: sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])))
            if hasattr(SDPBackend, "CUDNN_ATTENTION"):
                out.append(("cudnn", lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])))
    except Exception:  # noqa: BLE001 - old torch: no backend selection
        pass
    out.append(("default", contextlib.nullcontext))
    return out


def probe_attention(m: dict[str, Any], tp: int, prefill, decode, timer: Timer, device, dtype,
                    deadline: float) -> list[dict[str, Any]]:
    s = shard_shapes(m, tp)
    hq, hkv, hd = s["q_heads"], s["kv_heads"], s["head_dim"]
    shapes = [("prefill", 1, c, ctx) for c, ctx in prefill] + [("decode", b, 1, ctx) for b, ctx in decode]
    rows = []
    for kind, batch, qlen, ctx in shapes:
        kvlen = ctx + qlen if kind == "prefill" else ctx
        row: dict[str, Any] = {
            "tp": tp, "kind": kind, "batch": batch, "query_len": qlen, "context": ctx, "kv_len": kvlen,
            "q_heads": hq, "kv_heads": hkv, "head_dim": hd,
        }
        if time.monotonic() > deadline:
            row["error"] = "time budget spent: skipped"
            rows.append(row)
            continue
        try:
            q = _randn((batch, hq, qlen, hd), device, dtype, 1.0)
            k = _randn((batch, hkv, kvlen, hd), device, dtype, 1.0)
            v = _randn((batch, hkv, kvlen, hd), device, dtype, 1.0)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"alloc {type(e).__name__}: {e}"[:300]
            rows.append(row)
            continue
        if kind == "prefill":
            causal_opts = ["top_left"] if ctx == 0 else ["lower_right", "none"]
        else:
            causal_opts = ["none"]  # one query attends its whole context
        attempts: list[str] = []
        # Native GQA before K/V expanded to every query head (which reads kv-heads-fold the bytes, a
        # distortion for memory-bound decodes); within each, the fused backends first, every causal form
        # with each; the default (which may be the slow math kernel) last.
        backends = _backends(device)
        tries = [(b, c, g) for g in ("native", "expanded") for b in backends[:-1] for c in causal_opts]
        tries += [(backends[-1], c, g) for g in ("native", "expanded") for c in causal_opts]
        for (bname, ctxmgr), causal, gqa in tries:
            try:
                fn = _sdpa(q, k, v, causal, gqa)
                with ctxmgr():
                    stats = timer(fn)
                row.update(causal=causal, gqa=gqa, backend=bname, ms=stats)
                break
            except Exception as e:  # noqa: BLE001
                attempts.append(f"{causal}/{gqa}/{bname}: {type(e).__name__}: {str(e)[:120]}")
        if kind == "prefill":
            c = row.get("causal", causal_opts[0])
            row["pairs"] = qlen * kvlen if c == "none" else qlen * (ctx + (qlen + 1) / 2.0)
        else:
            row["pairs"] = batch * kvlen
        row["decode_kv_tokens"] = batch * kvlen if kind == "decode" else 0
        if "ms" not in row:
            row["error"] = "; ".join(attempts)[:1500]
            log(f"    attn {kind} b{batch} q{qlen} ctx{ctx}: FAILED ({attempts[-1] if attempts else '?'})")
        else:
            first = attempts[0] if attempts else ""
            row["fallbacks"] = attempts
            log(f"    attn {kind:<7} batch {batch:>4} q {qlen:>5} ctx {ctx:>6}: {row['ms']['median']:8.4f} ms "
                f"[{row['backend']}, {row['causal']}, gqa {row['gqa']}]" + (f"  (after: {first[:80]})" if first else ""))
        del q, k, v
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------- output


def _nvidia_smi() -> dict[str, str] | str:
    q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=15)
        line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else out.stderr.strip()
        vals = [v.strip() for v in line.split(",")]
        keys = q.split(",")
        return {keys[i]: vals[i] for i in range(min(len(keys), len(vals)))} if len(vals) > 3 else line
    except Exception as e:  # noqa: BLE001
        return f"unavailable: {type(e).__name__}: {e}"


def gpu_prefix(name: str) -> str:
    """The Vidur-style file prefix for a device name (what kvpilot.twin.hardware.resolve_gpu reads)."""
    n = name.lower()
    if n.startswith("cpu"):
        return "cpu"
    for key in ("gh200", "h200", "h100", "a100", "l40s", "a10g", "l4", "b200"):
        if re.search(rf"(^|[^a-z0-9]){key}($|[^a-z0-9])", n):
            return key
    return re.sub(r"[^a-z0-9]+", "", n)[:16] or "unknown"


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        "device_type": device.type, "cuda": getattr(torch.version, "cuda", None),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(
            name=p.name, capability=f"{p.major}.{p.minor}", total_memory_bytes=p.total_memory,
            multiprocessors=p.multi_processor_count,
            cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
        )
        for attr in ("L2_cache_size", "clock_rate", "memory_clock_rate", "memory_bus_width"):
            if hasattr(p, attr):
                info[attr] = getattr(p, attr)
    else:
        info.update(name=f"cpu ({platform.processor() or platform.machine()})", threads=torch.get_num_threads())
    return info


def write_outputs(out: Path, result: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "probe.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "probe.json")
    written = [out / "probe.json"]
    prefix = gpu_prefix(result["device"]["name"])
    for key, m in result["models"].items():
        rows = [r for r in result["linear"] if r["model"] == key]
        if not rows:
            continue
        # Only ops measured in every row: load_profile sums the columns of the first row.
        ops = [op for op in OPS if all(op in r["ops"] for r in rows)]
        cols = [f"time_stats.{op}.{s}" for op in ops for s in STATS]
        cols += ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp", "num_tokens",
                 "num_tensor_parallel_workers"]
        path = out / f"{prefix}_{key}.mlp.csv"
        with path.open("w", newline="") as f:
            wr = csv.writer(f)
            wr.writerow(cols)
            for r in rows:
                vals: list[Any] = [r["ops"][op][s] for op in ops for s in STATS]
                vals += [m["n_head"], m["n_kv_head"], m["n_embd"], m["n_expanded_embd"], m["vocab_size"],
                         str(m["use_gated_mlp"]), r["num_tokens"], r["tp"]]
                wr.writerow(vals)
        written.append(path)
    return written


# ------------------------------------------------------------------------------------------ main


def smoke(data: Path) -> int:
    """The output path on a committed probe: its Vidur CSVs written again from its probe.json, byte for byte."""
    import tempfile

    result = json.loads((data / "probe.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        written = write_outputs(Path(tmp), result)
        differ = [p.name for p in written[1:] if p.read_bytes() != (data / p.name).read_bytes()]
    n_err = sum(len(r["errors"]) for r in result["linear"]) + sum("error" in r for r in result["attention"])
    log(f"{data}: {result['device']['name']}, {len(result['linear'])} layer rows, {len(result['attention'])} "
        f"attention shapes, {n_err} failed measurements, {len(result['warnings'])} warnings")
    for p in written[1:]:
        log(f"  {p.name}: {'differs from the committed copy' if p.name in differ else 'as committed'}")
    return 1 if differ else 0



def parse_configs(text: str | None) -> list[tuple[str, int]]:
    """'8b:1,70b:8' -> [(model key, tp)]; None -> every model at its TP sizes."""
    if not text:
        return [(k, tp) for k, m in MODELS.items() for tp in m["tp"]]
    by_alias = {m["alias"]: k for k, m in MODELS.items()} | {k.lower(): k for k in MODELS}
    out = []
    for part in text.split(","):
        name, _, tp = part.strip().partition(":")
        key = by_alias.get(name.strip().lower())
        if key is None:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(by_alias)}")
        out.extend((key, int(t)) for t in (tp.split("/") if tp else MODELS[key]["tp"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT"), help="output folder (default: $OUT)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a format check, not a measurement)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few token counts and shapes, fewer reps")
    ap.add_argument("--configs", help="model:tp list, e.g. 8b:1,70b:2/8 (default: 8b at 1,2,4 and 70b at 2,4,8)")
    ap.add_argument("--tokens", help="comma-separated token counts (overrides the default list)")
    ap.add_argument("--reps", type=int, help="timed repetitions per op (default 15; quick 5; cpu 2)")
    ap.add_argument("--warmup", type=int, help="untimed runs first (default 3; quick 2; cpu 1)")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between repetitions")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--fail-op", action="append", default=[], help=argparse.SUPPRESS)  # tests: an op that raises
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="stop starting new measurements after this many seconds (default 200)")
    ap.add_argument("--smoke", action="store_true",
                    help="no GPU, no torch: write the committed H200 probe's outputs again from its probe.json and "
                         "compare them with the committed CSVs (seconds; CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        return smoke(Path(__file__).resolve().parent / "data" / "h200")
    if not args.out:
        ap.error("--out not given and $OUT not set")
    if torch is None:
        log("PyTorch is not importable here: nothing to measure")
        return 2
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    out = Path(args.out)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("CUDA is not available: nothing to measure (use --device cpu for a format check)")
        return 2
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    cpu = device.type == "cpu"
    dtype = torch.bfloat16
    if args.tokens:
        tokens = sorted({int(t) for t in args.tokens.split(",")})
    else:
        tokens = list(TOKENS_CPU_QUICK if cpu else TOKENS_QUICK if args.quick else TOKENS_FULL)
    if cpu:
        prefill, decode = PREFILL_CPU_QUICK, DECODE_CPU_QUICK
    elif args.quick:
        prefill, decode = PREFILL_QUICK, DECODE_QUICK
    else:
        prefill, decode = PREFILL_FULL, DECODE_FULL
    reps = args.reps or (2 if cpu else 5 if args.quick else 15)
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 2 if args.quick else 3)
    configs = parse_configs(args.configs)
    if args.quick and not args.configs:
        configs = [("meta-llama_Meta-Llama-3-8B", 1), ("meta-llama_Llama-3.1-70B", 8)]
    if cpu and not args.configs:
        configs = [("meta-llama_Meta-Llama-3-8B", 4)]

    torch.manual_seed(0)
    info = device_info(device)
    smi = _nvidia_smi() if device.type == "cuda" else "n/a (cpu)"
    log(f"device: {info['name']}  torch {info['torch']}  cuda {info.get('cuda')}  "
        f"capability {info.get('capability', '-')}")
    log(f"clocks (nvidia-smi, before): {smi}")
    names = ", ".join(MODELS[k]["alias"] + f" tp{tp}" for k, tp in configs)
    log(f"configs: {names}; tokens {tokens}; "
        f"reps {reps}, warmup {warmup}, L2 flush {not args.no_flush and not cpu}; budget {args.budget_s:.0f} s")
    if cpu:
        log("NOTE: CPU run: checks the code path and the output format; the times mean nothing for a GPU.")

    timer = Timer(device, warmup, reps, flush_l2=not args.no_flush)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "device": info,
        "clocks_before": smi,
        "settings": {
            "quick": args.quick, "reps": reps, "warmup": warmup, "flush_l2": timer.flush_buf is not None,
            "dtype": "bfloat16", "tokens": tokens, "budget_s": args.budget_s,
            "timer": "cuda events" if device.type == "cuda" else "perf_counter",
            "argv": sys.argv[1:],
        },
        "impl": {**IMPL, **({} if hasattr(F, "rms_norm") else {
            "input_layernorm": "eager float32 RMSNorm (no F.rms_norm in this torch)",
            "post_attention_layernorm": "eager float32 RMSNorm (no F.rms_norm in this torch)"})},
        "skipped_ops": ["none skipped; RMSNorm, rotary and SiLU-and-mul are eager PyTorch, not vLLM's fused kernels"],
        "models": {k: {kk: v for kk, v in MODELS[k].items() if kk not in ("tp",)} for k in dict.fromkeys(
            k for k, _ in configs)},
        "linear": [],
        "attention": [],
        "warnings": [],
        "complete": False,
    }
    for key, tp in configs:
        m = MODELS[key]
        log(f"== {key} tp {tp}: {shard_shapes(m, tp)}  ({time.monotonic() - t_start:.1f} s)")
        try:
            rows, warns = probe_linear(m, tp, tokens, timer, device, dtype, deadline, tuple(args.fail_op))
            for r in rows:
                r["model"] = key
            result["linear"].extend(rows)
            result["warnings"].extend(warns)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: record, go on
            msg = f"{key} tp {tp} linear: {type(e).__name__}: {e}"
            result["warnings"].append(msg[:500])
            log(f"    ! {msg[:300]}")
            traceback.print_exc()
        if not args.no_attention:
            try:
                arows = probe_attention(m, tp, prefill, decode, timer, device, dtype, deadline)
                for r in arows:
                    r["model"] = key
                result["attention"].extend(arows)
            except Exception as e:  # noqa: BLE001
                msg = f"{key} tp {tp} attention: {type(e).__name__}: {e}"
                result["warnings"].append(msg[:500])
                log(f"    ! {msg[:300]}")
                traceback.print_exc()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["elapsed_s"] = round(time.monotonic() - t_start, 2)
        write_outputs(out, result)
    result["clocks_after"] = _nvidia_smi() if device.type == "cuda" else "n/a (cpu)"
    result["complete"] = not any("time budget" in w for w in result["warnings"])
    result["elapsed_s"] = round(time.monotonic() - t_start, 2)
    n_err = sum(len(r["errors"]) for r in result["linear"]) + sum("error" in r for r in result["attention"])
    written = write_outputs(out, result)
    log(f"clocks (nvidia-smi, after): {result['clocks_after']}")
    log(f"done in {result['elapsed_s']:.1f} s: {len(result['linear'])} layer rows, {len(result['attention'])} "
        f"attention shapes, {n_err} failed measurements, {len(result['warnings'])} warnings")
    for p in written:
        log(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
