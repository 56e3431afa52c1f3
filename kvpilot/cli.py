"""`kvpilot` — one command, one subcommand per job.

Each area of the package contributes its subcommands through a `commands` module with a
`register(subparsers)` function.  Those modules import their heavy dependencies inside the
handlers, so `kvpilot --help` and `kvpilot validate` stay fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpilot import __version__

if TYPE_CHECKING:
    from kvpilot.operator.reviews import Predictor


def build_parser() -> argparse.ArgumentParser:
    # Imported here, not at module level: a process that only imports this module (a worker the
    # twin server spawns re-imports its parent's main module) must not pay for every command.
    from kvpilot.api import commands as api_commands
    from kvpilot.operator import commands as operator_commands
    from kvpilot.slo import commands as slo_commands
    from kvpilot.tuner import commands as tuner_commands
    from kvpilot.twin import commands as twin_commands

    # Order is the order subcommands appear in `--help`.
    command_modules = (api_commands, operator_commands, twin_commands, slo_commands, tuner_commands)
    parser = argparse.ArgumentParser(
        prog="kvpilot",
        description=(
            "Run vLLM on Kubernetes with chunked prefill, and keep tuning it: an operator for the "
            "InferenceService resource, an SLO-constrained Optuna tuner, SLO rules and dashboards, "
            "and an engine twin that simulates vLLM without a GPU."
        ),
    )
    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in command_modules:
        module.register(subparsers)
    # `kvpilot validate --predict` runs the twin's start-up; the API layer's command cannot import it.
    from kvpilot.twin import admission_cli

    admission_cli.extend_validate(subparsers.choices["validate"])
    # The operator's webhook predicts vLLM's start-up with the twin, which the operator does not import.
    subparsers.choices["operator"].set_defaults(predictor=twin_predictor)
    return parser


def twin_predictor() -> Predictor:
    """The start-up prediction the operator's webhook runs on every valid engine: the twin's
    (kvpilot.twin.admission.predict, what `kvpilot validate --predict` prints), once per distinct spec.

    Where spec.modelConfig names a ConfigMap the webhook does not read it (an API call inside the
    API server's wait): such a model, like one that is not a twin preset or an engine without
    spec.resources.gpuType, is not predicted, only validated."""
    from kvpilot.operator.reviews import CachedPredictor
    from kvpilot.twin.admission import predict

    return CachedPredictor(predict)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `kvpilot render ... | head` is fine; silence the interpreter's complaint at exit.
        sys.stderr.close()
        return 0
    except (Exception, RecursionError, MemoryError) as exc:
        # Every known bad input has its own message; this is the last guard, so that a bug still
        # reaches the user as one line (and a bug report can ask for the traceback).
        if os.environ.get("KVPILOT_DEBUG"):
            raise
        print(f"kvpilot {args.command}: internal error: {type(exc).__name__}: {_brief_error(exc)} "
              "(set KVPILOT_DEBUG=1 to see the traceback)", file=sys.stderr)
        return 70  # EX_SOFTWARE
    return int(result or 0)


def _brief_error(exc: BaseException, limit: int = 300) -> str:
    try:
        text = " ".join(str(exc).split())
    except Exception:  # a __str__ that fails too
        text = ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
