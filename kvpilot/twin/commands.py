"""`kvpilot twin ...`: run the engine twin offline, price one step, or serve it over HTTP."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvpilot.api.serve_args import serve_options
from kvpilot.api.vllm import VLLM_VERSION
from kvpilot.twin.flags import add_engine_arguments
from kvpilot.twin.workload import SPEC_HELP


def register(subparsers: Any) -> None:
    twin = subparsers.add_parser(
        "twin",
        help="the engine twin: a vLLM-faithful simulator (offline runs, step times, HTTP server)",
        description=f"The engine twin simulates vLLM {VLLM_VERSION}'s V1 engine without a GPU: chunked prefill, "
                    "the paged KV cache, preemption, and a step-time model calibrated on measured layer times "
                    "(`kvpilot twin calibrate` fits one for a device without a preset).  Its engine flags are "
                    f"those `vllm serve` {serve_options().vllm_version} parses (the flag list kvpilot ships).",
    )
    twin_sub = twin.add_subparsers(dest="twin_command", metavar="SUBCOMMAND", required=True)

    run = twin_sub.add_parser(
        "run",
        help="simulate a workload in virtual time and print a JSON report",
        description="Simulate a workload through the twin in virtual time and print a JSON report: TTFT, ITL, "
                    "e2e and queue-time percentiles, throughput, goodput under the SLO, preemptions, KV-cache "
                    "usage, and histograms with vLLM's bucket edges.  Takes the same engine flags as `vllm serve`.",
        epilog="Workload specs:\n\n" + SPEC_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--workload", required=True, metavar="SPEC",
                     help="e.g. poisson:rate=10,prompt=sharegpt or chat:rate=12 or gamma:rate=5,cv=3 or trace.jsonl "
                          "(see below)")
    stop = run.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, metavar="S",
                      help="arrival window in simulated seconds (default 60 unless --num-requests)")
    stop.add_argument("--num-requests", type=int, default=None, metavar="N", help="simulate the first N requests")
    run.add_argument("--slo", default="ttft=0.5,itl=0.05", help="SLO for goodput: ttft=S,itl=S (default %(default)s)")
    run.add_argument("--no-histograms", action="store_true", help="leave the histograms out of the report")
    add_engine_arguments(run)
    run.set_defaults(handler=_run)

    st = twin_sub.add_parser(
        "step-time",
        help="print the simulated time of one engine step, with its breakdown, as JSON",
        description="Price one engine step with the twin's step-time model. --tokens is every token in the step "
                    "(the linear layers see them all); --decode-seqs of them are decodes, each reading --context "
                    "tokens of KV cache; the rest form one prefill chunk.  `per_layer_linear_ms` is the figure "
                    "benchmarks/twin_calibration.py checks against measured layer times.",
    )
    st.add_argument("--gpu", default=None, help="GPU preset (default $KVPILOT_TWIN_GPU or H100-80GB)")
    model = st.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="model preset or Hugging Face id")
    model.add_argument("--model-config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    st.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel size")
    st.add_argument("--tokens", type=int, required=True, help="tokens scheduled in the step")
    st.add_argument("--decode-seqs", type=int, default=0, help="how many of them are decodes (default 0)")
    st.add_argument("--context", type=int, default=0, help="KV-cache tokens each decode reads (default 0)")
    st.set_defaults(handler=_step_time)

    su = twin_sub.add_parser(
        "startup",
        help="print how long a new replica takes to serve, by part, as JSON",
        description="The twin's start-up model: a replica's seconds from its pod starting until it serves "
                    "(process, weights, torch.compile, memory profiling, CUDA graphs, API server and the startup "
                    "probe), calibrated on real vLLM start-ups on an H100.  The fleet planner forecasts the load "
                    "over this time.  With --log, the parts of a real start-up read from a vLLM server log, to "
                    "set --weights-gib-per-s for your storage.",
    )
    source = su.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model preset or Hugging Face id")
    source.add_argument("--model-config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    source.add_argument("--log", metavar="FILE", help="a vLLM server log to read a real start-up from")
    su.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="tensor-parallel size")
    su.add_argument("--weights-gib-per-s", type=float, default=None, metavar="R",
                    help="the rate one rank reads the checkpoint at (default: the calibration's, 1.08)")
    su.add_argument("--compile-cached", action="store_true", help="vLLM's torch.compile cache holds this model")
    su.add_argument("--enforce-eager", action="store_true", help="vLLM's --enforce-eager: no compile, no graphs")
    su.set_defaults(handler=_startup)

    from kvpilot.twin.calibration import cli as calibrate_cli
    from kvpilot.twin.server import cli as serve_cli

    serve_cli.register(twin_sub)
    calibrate_cli.register(twin_sub)


def _fail(command: str, message: str, code: int) -> int:
    print(f"kvpilot twin {command}: error: {message}", file=sys.stderr)
    return code


def _run(args: argparse.Namespace) -> int:
    from kvpilot.api.slo import SLO
    from kvpilot.twin.flags import engine_config_from_args
    from kvpilot.twin.memory import EngineStartupError
    from kvpilot.twin.offline import simulate
    from kvpilot.twin.workload import Workload

    duration = args.duration
    if duration is None and args.num_requests is None:
        duration = 60.0
    if duration is not None and not duration > 0:
        return _fail("run", "--duration must be positive", 2)
    if args.num_requests is not None and args.num_requests < 1:
        return _fail("run", "--num-requests must be >= 1", 2)
    try:
        config = engine_config_from_args(args)
        workload = Workload.parse(args.workload)
        slo = SLO.parse(args.slo)
        report = simulate(config, workload, duration_s=duration, num_requests=args.num_requests, seed=args.seed,
                          slo=slo)
    except EngineStartupError as exc:
        return _fail("run", f"engine start-up failed: {exc}", 1)
    except ValueError as exc:
        return _fail("run", str(exc), 2)
    out = report.as_dict()
    if args.no_histograms:
        out.pop("histograms")
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _startup(args: argparse.Namespace) -> int:
    from kvpilot.twin.coldstart import WEIGHTS_GIB_PER_S, predict_cold_start, read_startup_log
    from kvpilot.twin.models import load_model_config, resolve_model

    try:
        if args.log:
            with open(args.log, encoding="utf-8", errors="replace") as f:
                start = read_startup_log(f.read())
            name = args.log
        else:
            model = load_model_config(args.model_config) if args.model_config else resolve_model(args.model)
            if args.tp < 1:
                raise ValueError(f"--tp must be >= 1 (got {args.tp})")
            rate = WEIGHTS_GIB_PER_S if args.weights_gib_per_s is None else args.weights_gib_per_s
            if not rate > 0:
                raise ValueError(f"--weights-gib-per-s must be > 0 (got {rate})")
            start = predict_cold_start(model, tensor_parallel_size=args.tp, compile_cached=args.compile_cached,
                                       enforce_eager=args.enforce_eager, weights_gib_per_s=rate)
            name = model.name
    except OSError as exc:
        return _fail("startup", f"cannot read --log {args.log!r}: {exc.strerror}", 2)
    except ValueError as exc:
        return _fail("startup", str(exc), 2)
    out = {"source": "log" if args.log else "model", "name": name, "seconds": round(start.total_s, 2),
           "parts": {k: round(v, 2) for k, v in start.parts().items()}}
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _step_time(args: argparse.Namespace) -> int:
    from kvpilot.twin.flags import gpu_from_args
    from kvpilot.twin.models import load_model_config, resolve_model
    from kvpilot.twin.steptime import StepTimeModel, linear_layer_breakdown, prefill_pairs

    if args.tokens < 1:
        return _fail("step-time", "--tokens must be >= 1", 2)
    if not 0 <= args.decode_seqs <= args.tokens:
        return _fail("step-time", "--decode-seqs must be between 0 and --tokens", 2)
    if args.context < 0:
        return _fail("step-time", "--context must be >= 0", 2)
    try:
        gpu = gpu_from_args(args)
        model = load_model_config(args.model_config) if args.model_config else resolve_model(args.model)
    except ValueError as exc:
        return _fail("step-time", str(exc), 2)
    if args.tp < 1 or model.num_attention_heads % args.tp:
        return _fail("step-time", f"--tp must divide the model's {model.num_attention_heads} attention heads", 2)
    stm = StepTimeModel(model, gpu, args.tp)
    prefill = args.tokens - args.decode_seqs
    num_requests = args.decode_seqs + (1 if prefill else 0)
    breakdown = stm.breakdown(
        args.tokens, num_requests, num_requests, prefill_pairs(prefill, 0) if prefill else 0.0,
        args.decode_seqs * (args.context + 1),
    )
    ops = linear_layer_breakdown(model, gpu, args.tp, args.tokens)
    out = {
        "gpu": gpu.name, "model": model.name, "tp": args.tp, "tokens": args.tokens,
        "decode_seqs": args.decode_seqs, "context": args.context, "prefill_tokens": prefill,
        **{k: round(v, 6) for k, v in breakdown.items()},
        "per_layer_ops_ms": {k: round(v * 1e3, 6) for k, v in ops.items()},
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
