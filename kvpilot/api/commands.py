"""`kvpilot crd` and `kvpilot validate`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_CRD_DIR = Path("crds")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    crd = subparsers.add_parser(
        "crd",
        help="print (or write) the InferenceService CustomResourceDefinition",
        description="Generate the InferenceService CRD (apiextensions.k8s.io/v1) from kvpilot's API models. "
        "Prints it to stdout, or with --write writes crds/inferenceservices.kvpilot.dev.yaml.",
    )
    crd.add_argument(
        "--write", action="store_true", help="write the file instead of printing it (default dir: ./crds)"
    )
    crd.add_argument("--dir", type=Path, default=DEFAULT_CRD_DIR, help="directory for --write (default: %(default)s)")
    crd.set_defaults(handler=_crd)

    validate = subparsers.add_parser(
        "validate",
        help="validate InferenceService manifests",
        description="Validate one or more InferenceService manifests (multi-document YAML). Prints every problem "
        "with its field path; exits 1 if anything is invalid, 0 if all is valid.",
    )
    validate.add_argument(
        "-f", "--filename", action="append", required=True, metavar="FILE",
        help="a YAML or JSON file, a directory (its .json, .yaml and .yml files), or - for stdin; repeatable. "
             "A List (what `kubectl get kvis -o yaml` prints) is read item by item",
    )
    validate.add_argument("-R", "--recursive", action="store_true",
                          help="with a directory, read its subdirectories too (as kubectl -R)")
    validate.add_argument("-q", "--quiet", action="store_true", help="print only the problems")
    validate.set_defaults(handler=validate_command)


def _crd(args: argparse.Namespace) -> int:
    from kvpilot.api.crd import CRD_FILENAME, crd_yaml

    text = crd_yaml()
    if not args.write:
        sys.stdout.write(text)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    target = args.dir / CRD_FILENAME
    target.write_text(text)
    print(f"wrote {target}", file=sys.stderr)
    return 0


def validate_command(args: argparse.Namespace) -> int:
    from kvpilot.api.documents import DocumentError, expand_filenames, read_source
    from kvpilot.api.validation import validate_text

    try:
        names = expand_filenames(args.filename, args.recursive)
    except DocumentError as exc:
        print(f"kvpilot validate: -f {exc}", file=sys.stderr)
        return 1
    failed = False
    for name in names:
        source = "<stdin>" if name == "-" else name
        try:
            data = read_source(name)
        except OSError as exc:
            print(f"{source}: cannot read: {exc.strerror or exc}", file=sys.stderr)
            failed = True
            continue
        except DocumentError as exc:
            print(f"{source}: {exc}")
            failed = True
            continue
        for result in validate_text(data):
            for warning in result.warnings:
                # As kubectl shows the API server's warnings: on stderr, the answer unchanged.
                print(f"Warning: {source}: {result.label}: {warning}", file=sys.stderr)
            if result.valid:
                if not args.quiet:
                    print(f"{source}: {result.label}: valid")
                continue
            failed = True
            for issue in result.issues:
                print(f"{source}: {result.label}: {issue}")
    return 1 if failed else 0
