"""The figures the docs quote against `make figures` (benchmarks/figures.py, committed data only): each
`<!-- fig NAME -->` in a doc must be followed by NAME's text as printed, and every figure printed must be
quoted somewhere."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("README-*.md"))]
MARK = re.compile(r"<!-- fig ([a-z][\w.-]*) -->\n?")  # names are lowercase: `<!-- fig NAME -->` is prose


@pytest.fixture(scope="module")
def printed() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "benchmarks/figures.py", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    figures: dict[str, str] = json.loads(done.stdout)
    return figures


def quoted() -> list[tuple[str, str, str]]:
    """(doc, name, the doc's text after the mark: as many lines as the figure's, each unindented)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in MARK.finditer(text):
            out.append((doc.name, m.group(1), text[m.end():]))
    return out


def as_quoted(after: str, figure: str) -> str:
    lines = after.split("\n")[:len(figure.split("\n"))]
    return "\n".join(line.lstrip() if i or "\n" in figure else line for i, line in enumerate(lines))


def test_docs_quote_the_figures_as_printed(printed: dict[str, str]) -> None:
    wrong = []
    for doc, name, after in quoted():
        if name not in printed:
            wrong.append(f"{doc}: <!-- fig {name} --> names no figure `make figures` prints")
        elif not as_quoted(after, printed[name]).startswith(printed[name]):
            wrong.append(f"{doc}: {name} reads\n{as_quoted(after, printed[name])}\nwhere `make figures` prints\n"
                         f"{printed[name]}")
    assert not wrong, "\n\n".join(wrong)


def test_every_figure_is_quoted(printed: dict[str, str]) -> None:
    assert sorted(set(printed) - {name for _, name, _ in quoted()}) == []


def test_a_stale_figure_fails() -> None:
    doc = "p99 TTFT <!-- fig x -->17.9% <= 20%\n  <!-- fig t -->\n  | a | b |\n  |---|---|\n  | 1 | **2%** |\n"
    marks = {m.group(1): doc[m.end():] for m in MARK.finditer(doc)}
    assert as_quoted(marks["x"], "17.9%").startswith("17.9%")
    assert not as_quoted(marks["x"], "18.0%").startswith("18.0%")
    table = "| a | b |\n|---|---|\n| 1 | **2%** |"
    assert as_quoted(marks["t"], table).startswith(table)
    assert not as_quoted(marks["t"], table.replace("2%", "3%")).startswith(table.replace("2%", "3%"))
