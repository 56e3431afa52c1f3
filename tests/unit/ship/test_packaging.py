"""Building kvpilot's metadata with the build backend pyproject.toml asks for: no deprecation warnings
(they print on every install), and the extras a user is told to install exist."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_metadata_builds_without_warnings(tmp_path: Path) -> None:
    import setuptools

    wanted = next(Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    if not wanted.specifier.contains(setuptools.__version__):
        pytest.fail(f"the test venv's setuptools {setuptools.__version__} is not the {wanted} pyproject builds with")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvpilot", src / "kvpilot", ignore=shutil.ignore_patterns("__pycache__"))
    meta = tmp_path / "meta"
    meta.mkdir()
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-c",
         "import sys, setuptools.build_meta as b; print(b.prepare_metadata_for_build_wheel(sys.argv[1]))", str(meta)],
        cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    metadata = (meta / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata


def test_the_extras_the_messages_name_exist() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"report", "postgresql", "tracing", "tracing-grpc"} <= set(extras)
    runtime = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    # Tracing is optional: the twin imports OpenTelemetry only when asked to trace.
    assert not {n for n in runtime if n.startswith("opentelemetry")}
    assert "opentelemetry-exporter-otlp-proto-grpc" not in {Requirement(r).name for r in extras["tracing"]}
    assert "matplotlib" not in runtime and "kubernetes" not in runtime


def test_the_wheel_ships_the_device_profiles_and_no_harness(tmp_path: Path) -> None:
    """The profiles `--device-profile` and `kvpilot twin calibrate` point at are package data; the oracle
    harness, the tests and the benchmarks are not in the wheel."""
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("kvpilot", "harness", "benchmarks", "tests"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    dist.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))", str(dist)],
        cwd=src, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = set(zipfile.ZipFile(dist / proc.stdout.strip().splitlines()[-1]).namelist())
    data = "kvpilot/twin/calibration/data/"
    assert {data + "profile.json", data + "served.json", data + "tiny-llama.json", data + "profile_icelake.json",
            data + "profile_epyc.json", "kvpilot/loadgen.py", "kvpilot/api/gpus.py"} <= names
    assert not {n for n in names if n.split("/")[0] in ("harness", "tests", "benchmarks") or "conformance" in n}
