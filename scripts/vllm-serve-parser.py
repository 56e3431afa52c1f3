"""vLLM's own `vllm serve` argument parser, for kvpilot's flag list and its differential tests.

    <vllm venv>/bin/python scripts/vllm-serve-parser.py --options   # the option strings, as JSON
    <vllm venv>/bin/python scripts/vllm-serve-parser.py             # JSON lines: argv in, parse out

Runs inside the real-vLLM venv and imports nothing from kvpilot.  The parser is the one `vllm serve`
builds (vLLM's CLI main: a FlexibleArgumentParser with the serve subcommand), and each command line
goes through its `parse_args(["serve", *argv])` exactly as `vllm serve` does; nothing is validated
or started.

`--options` prints `{"vllmVersion": ..., "actions": [[option strings of one flag], ...]}` in the
order the serve parser registers them (the order argparse lists an ambiguous prefix's matches in):
kvpilot/api/vllm_serve_options.json is this output.

Otherwise each input line is `{"describe": true}`, answered with each flag's option strings, dest,
nargs and choices (`{"ok": true, "actions": [...]}`), or `{"argv": [...], "dests": [...]}`, answered
`{"ok": true, "values": {dest: value}}` (the parsed namespace's values for those dests; all of them
when `dests` is absent) or `{"ok": false, "status": N, "error": "..."}`, the error being argparse's
message (`ambiguous option: ...`, `argument --max-num-seqs: invalid int value: ...`) or the
exception vLLM raised.  Replies are written to the original stdout; vLLM's own logging and help
text go to stderr.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def serve_parsers() -> tuple[Any, Any]:
    """(the `vllm` parser, its `serve` subparser), built as vLLM's CLI main builds them."""
    from vllm.entrypoints.cli import main as cli_main
    from vllm.entrypoints.cli.serve import ServeSubcommand

    from_main = getattr(cli_main, "_build_parser", None)
    if from_main is not None:  # newer mains build the parser in a function of their own
        parser, _ = from_main("serve", use_flexible_parser=True)
    else:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(description="vLLM CLI")
        parser.add_argument("-v", "--version", action="version", version=importlib.metadata.version("vllm"))
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        cmd = ServeSubcommand()
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return parser, subparsers.choices["serve"]


def options(serve: Any) -> dict[str, Any]:
    actions = [list(a.option_strings) for a in serve._actions if a.option_strings]
    return {"vllmVersion": importlib.metadata.version("vllm"), "actions": actions}


def jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def describe(serve: Any) -> dict[str, Any]:
    actions = [
        {"options": list(a.option_strings), "dest": a.dest, "nargs": jsonable(a.nargs),
         "choices": [jsonable(c) for c in a.choices] if a.choices is not None else None}
        for a in serve._actions if a.option_strings
    ]
    return {"ok": True, "actions": actions}


def parse(parser: Any, request: dict[str, Any]) -> dict[str, Any]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(sys.stderr):
            ns = parser.parse_args(["serve", *request["argv"]])
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if ": error: " in ln]
        message = lines[-1].split(": error: ", 1)[1] if lines else err.getvalue().strip()[-2000:]
        return {"ok": False, "status": exc.code, "error": message}
    except Exception as exc:  # vLLM's own checks raise (a --config file it cannot read, ...)
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}
    values = vars(ns)
    dests = request.get("dests") or [k for k in values if k != "dispatch_function"]
    return {"ok": True, "values": {d: jsonable(values.get(d)) for d in dests}}


def main() -> None:
    # Replies get a descriptor of their own: vLLM logs to stdout.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    parser, serve = serve_parsers()
    if sys.argv[1:] == ["--options"]:
        found = options(serve)  # one flag a line, so a vLLM upgrade reads as a diff of flags
        out.write(f'{{"vllmVersion": {json.dumps(found["vllmVersion"])}, "actions": [\n')
        out.write(",\n".join(json.dumps(a) for a in found["actions"]) + "\n]}\n")
        return
    ready = {"ready": True, "vllmVersion": importlib.metadata.version("vllm"), "python": list(sys.version_info[:2])}
    out.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        if line.strip():
            request = json.loads(line)
            out.write(json.dumps(describe(serve) if request.get("describe") else parse(parser, request)) + "\n")


if __name__ == "__main__":
    main()
