"""The import-linter contracts hold the layering docs/development.md describes: each import that would break
it, added to a copy of the packages (kvpilot, the harness, benchmarks and tests), makes `lint-imports`
fail on the contract that forbids it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# (module that gains the import, the import, words of the contract that must break)
BREAKS = [
    ("kvpilot/operator/builders/engine.py", "import kvpilot.operator.kube", "operator builders are pure"),
    ("kvpilot/operator/builders/service.py", "import aiohttp", "operator builders are pure"),
    ("kvpilot/twin/offline.py", "import kvpilot.slo.promql", "layers"),
    ("kvpilot/slo/promql.py", "import kvpilot.twin.hardware", "layers"),
    ("kvpilot/tuner/core/loop.py", "import subprocess", "the tuner core is free of transport"),
    ("kvpilot/tuner/core/objective.py", "import urllib.request", "the tuner core is free of transport"),
    ("kvpilot/tuner/core/study.py", "import aiohttp", "the tuner core is free of transport"),
    ("kvpilot/tuner/core/space.py", "import kvpilot.tuner.report", "the tuner core is free of transport"),
    ("kvpilot/tuner/adapters/kubernetes.py", "import kvpilot.operator.reconcile", "layers"),
    ("kvpilot/twin/scheduler.py", "import kvpilot.twin.server.app", "the simulator core is free of HTTP"),
    ("kvpilot/api/models.py", "import kvpilot.twin.hardware", "layers"),
    ("kvpilot/loadgen.py", "import kvpilot.api.slo", "layers"),
    ("kvpilot/twin/offline.py", "import tests.support.tiny_device", "the product stands alone"),
    ("kvpilot/api/models.py", "import benchmarks.twin_speed", "the product stands alone"),
    ("kvpilot/tuner/jobs.py", "import harness.conformance.traces", "the product stands alone"),
    ("benchmarks/twin_speed.py", "import tests.support.tiny_device", "benchmarks and the harness never import tests"),
    ("harness/twin_process.py", "import tests.support.cel", "benchmarks and the harness never import tests"),
    ("kvpilot/operator/builders/deployment.py", "import kvpilot.twin.hardware", "the operator never imports the twin"),
    ("kvpilot/operator/runner.py", "from kvpilot.twin.admission import predict", "the operator never imports the twin"),
]
# The packages the contracts name, copied as their Python files (benchmarks' data stays behind).
PACKAGES = ("kvpilot", "harness", "benchmarks", "tests")


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(tree / "pyproject.toml")],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"lint-imports is not installed next to {sys.executable} (make setup installs it)")
    tree = tmp_path_factory.mktemp("layering")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tree / package, ignore=_python_only)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _python_only(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or (not n.endswith(".py") and not (Path(directory) / n).is_dir())}


def test_the_tree_as_it_is_keeps_every_contract(pristine: Path) -> None:
    result = lint(pristine)
    assert result.returncode == 0, result.stdout[-3000:]


@pytest.mark.parametrize(("module", "line", "contract"), BREAKS, ids=[f"{m}:{i}" for m, i, _ in BREAKS])
def test_a_layering_breaking_import_fails_its_contract(pristine: Path, tmp_path: Path, module: str, line: str,
                                                      contract: str) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(pristine, tree)
    target = tree / module
    target.write_text(target.read_text() + f"\n{line}  # added by the layering test\n")
    result = lint(tree)
    assert result.returncode != 0, f"{line} in {module} broke no contract:\n{result.stdout[-2000:]}"
    assert contract in broken_contracts(result.stdout), result.stdout[-3000:]


def broken_contracts(report: str) -> str:
    """The names of the contracts lint-imports reports BROKEN, joined (names wrap over lines there)."""
    # A name that fills its line runs into its status word with no space ("...clientKEPT").
    parts = re.split(r"\s?(KEPT|BROKEN)\b", " ".join(report.split()))
    names = [parts[0][-200:], *parts[2::2]]
    return " | ".join(name.strip() for name, status in zip(names, parts[1::2], strict=False) if status == "BROKEN")
