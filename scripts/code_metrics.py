#!/usr/bin/env python3
"""The shape of the package at a git revision: its largest modules, its longest functions, the
module docstrings' lengths and the README's.

    python scripts/code_metrics.py [REV]      # default HEAD; e.g. compare f49ec0b with HEAD

A module over 500 lines should say why at its top (`# Over 500 lines: ...`); the list marks the
ones that do.
"""

from __future__ import annotations

import ast
import subprocess
import sys


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def main(argv: list[str]) -> int:
    rev = argv[0] if argv else "HEAD"
    paths = [p for p in git("ls-tree", "-r", "--name-only", rev, "kvpilot").split() if p.endswith(".py")]
    modules, functions, docstrings = [], [], []
    for path in paths:
        text = git("show", f"{rev}:{path}")
        lines = text.count("\n")
        reason = "over 500 lines:" in "\n".join(text.splitlines()[:12]).lower()
        modules.append((lines, path, reason))
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False)
        docstrings.append(doc.count("\n") + 1 if doc else 0)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                functions.append((node.end_lineno - node.lineno + 1, f"{path}:{node.name}"))
    readme = git("show", f"{rev}:README.md").count("\n")
    print(f"revision {git('rev-parse', '--short', rev).strip()}: {len(paths)} modules, {sum(m[0] for m in modules)} lines")
    print("largest modules:")
    for lines, path, reason in sorted(modules, reverse=True)[:8]:
        print(f"  {lines:5d}  {path}{'  (says why)' if reason else ''}")
    over = [m for m in modules if m[0] > 500]
    print(f"modules over 500 lines: {len(over)}, {sum(1 for m in over if not m[2])} without a reason at the top")
    print("longest functions:")
    for lines, name in sorted(functions, reverse=True)[:6]:
        print(f"  {lines:5d}  {name}")
    print(f"functions over 100 lines: {sum(1 for f in functions if f[0] > 100)}")
    long_docs = sorted(docstrings, reverse=True)
    print(f"module docstrings: {sum(docstrings)} lines in all, {sum(1 for d in docstrings if d >= 20)} of 20+ lines, "
          f"longest {long_docs[0]}")
    print(f"README.md: {readme} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
