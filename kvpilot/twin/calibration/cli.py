"""`kvpilot twin calibrate`: fit a device profile on a served vLLM's observations."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvpilot.twin.calibration import CPU_OBSERVATIONS, CPU_PROFILE, TINY_MODEL_CONFIG


def _shipped(path: Path) -> str:
    """The package-relative name of a shipped file: an install's absolute path is long enough for argparse to
    break it mid-name, and says less."""
    return str(path.relative_to(Path(__file__).resolve().parents[3]))


def register(twin_subparsers: Any) -> argparse.ArgumentParser:
    p = twin_subparsers.add_parser(
        "calibrate",
        help="fit a device profile (a CPU, a GPU without a preset) on a served vLLM's measured latencies",
        description="Fit the twin's step-time constants to observations of a served vLLM (steady decode gaps, "
                    "lone-prompt TTFTs, bursts, prompts among decodes, the frontend's CPU seconds; "
                    "benchmarks/twin_vs_vllm.py --calibrate measures them on real vLLM), print the fit's error on "
                    "each, and write the device profile that `--device-profile` takes (`kvpilot twin run|serve`, "
                    "`kvpilot tune`).  With no arguments it refits the profile kvpilot ships, "
                    f"{_shipped(CPU_PROFILE)}, from its observations.",
    )
    p.add_argument("--observations", default=str(CPU_OBSERVATIONS), metavar="JSON",
                   help="the measured observations: the JSON benchmarks/twin_vs_vllm.py --calibrate writes "
                        f"(default: the shipped {_shipped(CPU_OBSERVATIONS)})")
    p.add_argument("--model-config", default=str(TINY_MODEL_CONFIG), metavar="CONFIG_JSON",
                   help="the Hugging Face config.json of the model the observations were measured on "
                        f"(default: the shipped {_shipped(TINY_MODEL_CONFIG)}, the tiny model `make vllm-env` makes)")
    p.add_argument("--output", "-o", default="-", metavar="PROFILE_JSON",
                   help="where to write the profile; - (the default) prints it, and the fit's errors go to stderr")
    p.add_argument("--fit-frontend", action="store_true",
                   help="fit the frontend server's costs to the latencies with the rest, rather than take them "
                        "from the CPU time the observations measured")
    p.add_argument("--source", default=None, metavar="TEXT",
                   help="how the observations were measured, kept in the profile (default: names the file)")
    p.set_defaults(handler=calibrate_command)
    return p


def calibrate_command(args: argparse.Namespace) -> int:
    from kvpilot.twin.calibration.served import CalibrationError, calibrate, load_observations, report
    from kvpilot.twin.models import load_model_config

    try:
        measured = load_observations(args.observations)
        model = load_model_config(args.model_config)
        source = args.source or f"fitted by `kvpilot twin calibrate` on {args.observations}"
        cal = calibrate(measured, model, source=source, fit_frontend=args.fit_frontend)
    except (CalibrationError, ValueError) as exc:
        print(f"kvpilot twin calibrate: error: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        report(cal, sys.stderr)
        sys.stdout.write(cal.profile.as_json())
        return 0
    report(cal)
    cal.profile.write(args.output)
    print(f"wrote {args.output}")
    return 0
