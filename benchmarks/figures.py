"""The figures the benchmark READMEs quote, printed from committed data only: every figure is what a
benchmark prints when it reprints or rescores a run kept in benchmarks/data (no vLLM, no GPU, nothing
measured again), so a change to the twin that moves one shows here.

    python benchmarks/figures.py           # `make figures`: every figure, by name (about 20 s)
    python benchmarks/figures.py --json    # {name: text}

A doc quotes a figure right after `<!-- fig NAME -->` (a table on the line after it);
tests/benchmarks/test_figures.py fails where the text there is not this output's, and where a figure
printed here is quoted nowhere.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = "benchmarks/data/vllm-cpu"
STATS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "rps")
PROFILES = "kvpilot/twin/calibration/data"
EPYC = ("--profile", f"{PROFILES}/profile_epyc.json", "--served", f"{PROFILES}/served_epyc.json")
MEASURED_COSTS = ("--profile", f"{PROFILES}/profile_measured_costs.json",
                  "--served", f"{PROFILES}/served_measured_costs.json")


def run(script: str, *args: str) -> str:
    """A benchmark's stdout, run from the repository root as the READMEs print its command."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks/{script} {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


class Replay:
    """The median errors `twin_vs_vllm.py --twin-only` prints for a committed replay: the twin on the
    probes (or the only figures, for a replay without them), the profile as calibrated, and real vLLM's
    run-to-run spread, each as {stat: percent}."""

    def __init__(self, replay: str, *args: str) -> None:
        out = run("twin_vs_vllm.py", "--twin-only", f"{CPU}/{replay}", *args)
        summary = out[out.index("median relative error over"):]
        rows = re.findall(r"(?m)^\s+(\w+)\s+([\d.]+)% \(max\s+[\d.]+%\)(?:; run-to-run spread median\s+([\d.]+)%)?",
                          summary)
        self.probed = {s: float(v) for s, v, _ in rows[:5]}
        self.spread = {s: float(v) for s, _, v in rows[:5]}
        self.calibrated = {s: float(v) for s, v, _ in rows[5:10]}
        assert list(self.probed) == list(STATS), rows


def pct(value: float) -> str:
    return f"{value:.1f}%"


def slashed(errors: dict[str, float], stats: tuple[str, ...] = STATS[:4]) -> str:
    """'14.1 / 18.2 / 9.5 / 15.4%', as the READMEs list p50 / p99 TTFT and p50 / p99 ITL."""
    return " / ".join(f"{errors[s]:.1f}" for s in stats) + "%"


def replay_xeon() -> dict[str, str]:
    lines = ["| replay (median relative error over 18 cases, 2 repeats each) | p50 TTFT | p99 TTFT | p50 ITL | p99 ITL "
             "| rps | vLLM's run-to-run spread (same four) |", "|---|---|---|---|---|---|---|"]
    for seed, name in ((0, "seed 0"), (1, "seed 1"), (2, "seed 2 (run after the refit)")):
        r = Replay("replay_xeon.json" if seed == 0 else f"replay_xeon_seed{seed}.json")
        probed = " | ".join(f"**{pct(r.probed[s])}**" for s in STATS[:4])
        calibrated = " | ".join(pct(r.calibrated[s]) for s in STATS[:4])
        lines.append(f"| {name}, with the probes | {probed} | {pct(r.probed['rps'])} | {slashed(r.spread)} |")
        lines.append(f"| seed {seed}, the profile as calibrated | {calibrated} | {pct(r.calibrated['rps'])} | |")
    return {"twin.replay-xeon": "\n".join(lines)}


def replay_epyc() -> dict[str, str]:
    r, seed1, slow = Replay("replay.json", *EPYC), Replay("replay_seed1.json", *EPYC), Replay("replay_slow_host.json",
                                                                                               *EPYC)
    out = {f"twin.replay-epyc.{s}": pct(r.probed[s]) for s in STATS[:4]}
    out["twin.replay-epyc-seed1"] = (
        ", ".join(f"{label} **{pct(seed1.probed[s])}**" for label, s in
                  zip(("p50 TTFT", "p99 TTFT", "p50 ITL", "p99 ITL"), STATS, strict=False))
        + f", rps {pct(seed1.probed['rps'])} (run-to-run spread {slashed(seed1.spread, STATS)})")
    out["twin.replay-slow-host.epyc-profile"] = slashed(slow.probed)
    return out


def replay_probe() -> dict[str, str]:
    morning, costs = Replay("replay_probe.json", *EPYC), Replay("replay_probe.json", *MEASURED_COSTS)
    rows = [("morning's, with the probes", morning.probed, "**"), ("morning's, as calibrated (9 h earlier)",
                                                                   morning.calibrated, ""),
            ("13:12's (measured frontend costs), with the probes", costs.probed, ""),
            ("13:12's, as calibrated", costs.calibrated, "")]
    lines = ["| profile | p50 TTFT | p99 TTFT | p50 ITL | p99 ITL |", "|---|---|---|---|---|"]
    lines += [f"| {name} | " + " | ".join(f"{b}{pct(e[s])}{b}" for s in STATS[:4]) + " |" for name, e, b in rows]
    out = {"twin.replay-probe": "\n".join(lines), "twin.replay-probe.spread": slashed(morning.spread)}
    m1, c1 = Replay("replay_probe_seed1.json", *EPYC), Replay("replay_probe_seed1.json", *MEASURED_COSTS)
    out.update({"twin.replay-probe-seed1.morning": slashed(m1.probed),
                "twin.replay-probe-seed1.morning-calibrated": slashed(m1.calibrated),
                "twin.replay-probe-seed1.costs": slashed(c1.probed),
                "twin.replay-probe-seed1.costs-calibrated": slashed(c1.calibrated),
                "twin.replay-probe-seed1.spread": slashed(m1.spread)})
    return out


def memory() -> dict[str, str]:
    out = run("twin_memory.py")
    logs, sized, recent = re.search(r"(\d+) logs \((\d+) the twin can size\), (\d+) from vLLM >= 0\.17", out).groups()
    figures = {"twin.memory.logs": logs, "twin.memory.sized": sized, "twin.memory.recent": recent}
    for split, versions, key in (("train", "all versions", "train"), ("test ", "all versions", "test"),
                                 ("test ", "vLLM >= 0.17", "test-recent")):
        m = re.search(rf"{split} {re.escape(versions)}\s+fitted:\s+(\d+) logs, median\s+([\d.]+)%, max\s+([\d.]+)%"
                      rf"\s+before:\s+\d+ logs, median\s+([\d.]+)%, max\s+([\d.]+)%", out)
        assert m, (split, versions)
        n, med, mx, med0, mx0 = m.groups()
        figures[f"twin.memory.{key}"] = f"{n} logs, median {med}%, max {mx}% (before: {med0}%, {mx0}%)"
    figures["twin.memory.goal"] = re.search(r"goal on held-out vLLM >= 0\.17 logs \([^)]*\): (\w+(?: \w+)?)",
                                            out).group(1)
    return figures


def h200() -> dict[str, str]:
    out = run("twin_vs_gpu.py", "benchmarks/data/h200", "--brief", "--no-refit")
    rows = re.findall(r"layer: median\s+([\d.]+) % max\s+([\d.]+) % \(at \d+ tokens\)\s+GEMMs: median\s+([\d.]+) % "
                      r"max\s+([\d.]+) %", out.split("== attention")[0])
    layer, gemm, gemm_max = ([float(r[i]) for r in rows] for i in (0, 2, 3))
    return {"twin.h200.gemms": f"{min(gemm):.1f}-{max(gemm):.1f} % / {min(gemm_max):.0f}-{max(gemm_max):.0f} %",
            "twin.h200.layer": f"{min(layer):.0f}-{max(layer):.0f} %"}


def regret_table(out: str) -> str:
    """The regret lines of a live_tuning.py rescore, as the README's table."""
    lines = ["| study | @3 | @5 | @10 |", "|---|---|---|---|"]
    for study in ("cold start", "warm start"):
        values = re.search(rf"(?m)^{study}\s+(\S+)\s+(\S+)\s+(\S+)$", out).groups()
        bold = "**" if study == "warm start" else ""
        lines.append(f"| {study} | " + " | ".join(f"{bold}{v}{bold}" if i < 2 else v for i, v in enumerate(values))
                     + " |")
    return "\n".join(lines)


def live() -> dict[str, str]:
    icelake = f"{CPU}/live_icelake.json"
    out = run("live_tuning.py", "--only", "rescore", "--rate", "2.5", "--window", "20", "--repeats", "2",
              "--studies", icelake, "--grid", icelake, "--out", os.devnull)
    xeon = f"{CPU}/live_xeon_w20.json"
    out_xeon = run("live_tuning.py", "--only", "rescore", "--rate", "10", "--prompt-words", "300", "--window", "20",
                   "--repeats", "2", "--studies", xeon, "--grid", xeon, "--out", os.devnull)
    figures = {"tuner.live.icelake": regret_table(out), "tuner.live.xeon": regret_table(out_xeon)}
    # The EPYC host's 14:05 studies valued on the 13:25 grid, the 17:13 grid, and both pooled.
    first, second = f"{CPU}/live_poisson_w40.json", f"{CPU}/live_poisson_w40_1713.json"
    for name, grids in (("first", [first]), ("second", [second]), ("pooled", [first, second])):
        out = run("live_tuning.py", "--only", "rescore", "--window", "40", "--repeats", "3", "--studies", first,
                  *(a for g in grids for a in ("--grid", g)), "--out", os.devnull)
        tokens, seqs, value = re.search(r"grid optimum tokens=(\d+) util=\S+ seqs=(\d+) = ([\d.]+)", out).groups()
        cold, warm = (re.search(rf"(?m)^{s} start\s+\S+\s+(\S+)", out).group(1) for s in ("cold", "warm"))
        figures[f"tuner.live.epyc.{name}"] = f"{tokens}/{seqs} {value}"
        figures[f"tuner.live.epyc.{name}.regret5"] = f"{cold} / {warm}"
    return figures


def speed() -> dict[str, str]:
    """twin_speed.py's one deterministic figure, the work it times (its timings are the machine's)."""
    out = run("twin_speed.py", "--repeat", "1")
    requests, steps = re.search(r"run 1: .*?, (\d+) requests, (\d+) steps", out).groups()
    return {"twin.speed.work": f"{int(steps):,} engine steps for {int(requests):,} requests"}


def gpu_serving() -> dict[str, str]:
    """twin_vs_gpu_serving.py's medians on the committed real-GPU runs (benchmarks/data/gpu-serving; the
    leave-one-model-out figures need --fit, minutes, and are not here)."""
    out = run("twin_vs_gpu_serving.py", "--traces", "none")
    figures = {}
    for label, key in (("whole-run rows", "whole"), ("every row", "every")):
        e2e, _, _, ttft, _, p99, itl = re.search(rf"(?m)^\s+twin\s+{label}((?:\s+[\d.]+){{7}})$", out).group(1).split()
        figures[f"gpu.serving.{key}"] = f"E2E {e2e}%, TTFT {ttft}% (p99 {p99}%), ITL {itl}%"
    med, mx, n = re.search(r"dense models: median \|error\| ([\d.]+)%, max ([\d.]+)% \((\d+) configs\)", out).groups()
    figures["gpu.serving.memory"] = f"{med}% (max {mx}%) on {n} dense-model configs"
    return figures


SOURCES: tuple[Callable[[], dict[str, str]], ...] = (replay_xeon, replay_epyc, replay_probe, memory, h200, live,
                                                     speed, gpu_serving)


def figures() -> dict[str, str]:
    with ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda source: source(), SOURCES))
    return {name: text for part in parts for name, text in part.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print {name: text} as JSON")
    args = ap.parse_args(argv)
    found = figures()
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    for name, text in found.items():
        print(f"{name}:\n{text}" if "\n" in text else f"{name}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
