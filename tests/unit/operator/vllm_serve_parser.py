"""Run with a Python that has vLLM 0.33 installed (not kvpilot's venv: vLLM pulls torch and CUDA).

    VLLM_TARGET_DEVICE=cpu PY -m tests.unit.operator.vllm_serve_parser dump > vllm_0_33_serve_flags.txt
    VLLM_TARGET_DEVICE=cpu PY tests/unit/operator/vllm_serve_parser.py check < argv-lists.json

`dump` prints the flag table of vLLM's own `vllm serve` parser
(vllm.entrypoints.common.cli_args.make_arg_parser); `check` parses each JSON list of arguments
with that parser and prints one JSON result per list.  Only stdlib and vLLM are imported here.
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))


def _type_name(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    kind = action.type
    return getattr(kind, "__name__", type(kind).__name__) if kind is not None else "str"


def dump() -> int:
    import vllm

    parser = _parser()
    print(f"# The `vllm serve` flags of vLLM {vllm.__version__}, dumped from vLLM's own argument parser")
    print("# (vllm.entrypoints.common.cli_args.make_arg_parser) by tests/unit/operator/vllm_serve_parser.py dump.")
    print("# flag<TAB>type<TAB>choices (comma-separated, empty when free)")
    seen: set[str] = set()
    rows = []
    for action in parser._actions:
        for flag in action.option_strings:
            if flag in seen:
                continue
            seen.add(flag)
            choices = ",".join(str(c) for c in action.choices) if action.choices else ""
            rows.append(f"{flag}\t{_type_name(action)}\t{choices}")
    print("\n".join(sorted(rows)))
    return 0


def check() -> int:
    parser = _parser()
    for argv in json.load(sys.stdin):
        try:
            ns, unknown = parser.parse_known_args(argv)
            result = {"ok": not unknown, "unknown": unknown,
                      "parsed": {k: v for k, v in vars(ns).items() if isinstance(v, int | float | str)}}
        except (argparse.ArgumentError, SystemExit, ValueError, TypeError) as exc:
            result = {"ok": False, "error": str(exc)}
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(dump() if sys.argv[1:] == ["dump"] else check() if sys.argv[1:] == ["check"] else 2)
