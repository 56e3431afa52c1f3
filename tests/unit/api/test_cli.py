import subprocess
import sys
from pathlib import Path

from kvpilot.cli import main

ROOT = Path(__file__).resolve().parents[3]


def test_validate_examples_exit_zero(capsys):
    files = sorted(str(p) for p in (ROOT / "examples").glob("*.yaml"))
    args = ["validate"] + [a for f in files for a in ("-f", f)]
    assert main(args) == 0
    assert capsys.readouterr().out.count(": valid") == len(files)


def test_validate_reports_paths_and_exits_one(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: a}\n"
        "spec: {model: m, engine: {maxNumBatchedTokens: 64, maxNumSeqs: 128}}\n"
        "---\n"
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: b}\nspec: {model: m}\n"
    )
    assert main(["validate", "-f", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "document 1 (a): spec.engine.maxNumBatchedTokens: must be at least maxNumSeqs" in out
    assert "document 2 (b): valid" in out


def test_validate_stdin_non_yaml_never_tracebacks():
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "validate", "-f", "-"],
        input="key: [unclosed\n\t- tab", capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "not valid YAML at line" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_validate_missing_file(capsys):
    assert main(["validate", "-f", "/nonexistent/x.yaml"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_help_lists_subcommands():
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    for word in ("crd", "validate"):
        assert word in proc.stdout
