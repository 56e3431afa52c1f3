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


def test_validate_refuses_extra_args_by_the_flag_vllm_reads_them_as(tmp_path, capsys):
    # Each of these used to pass: vLLM takes unambiguous prefixes and `_` for `-`, and --config reads a file.
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: a}\n"
        "spec: {model: m, replicas: 2, engine: {extraArgs: [--max-num-batched=4096, --enforce-eager, --max_num_se, '512',"
        " --gpu-mem=0.5, --config, /etc/vllm.yaml]}}\n"
    )
    assert main(["validate", "-f", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "spec.engine.extraArgs[0]: --max-num-batched (vLLM reads it as --max-num-batched-tokens)" in out
    assert "spec.engine.extraArgs[2]: --max_num_se (vLLM reads it as --max-num-seqs)" in out
    assert "spec.engine.extraArgs[4]: --gpu-mem (vLLM reads it as --gpu-memory-utilization)" in out
    assert "spec.engine.extraArgs[5]: --config reads flags from a YAML file" in out
    assert "extraArgs[1]" not in out and "extraArgs[3]" not in out and "extraArgs[6]" not in out


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


def test_an_unexpected_error_is_one_line_not_a_traceback(tmp_path):
    # A planted bug stands in for any unforeseen failure: a handler that raises.  The real CLI runs
    # in a subprocess, started by a tiny script that plants the bug first.
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "import kvpilot.api.commands as c\n"
        "def boom(args):\n"
        "    raise RuntimeError('x' * 10000)\n"
        "c.validate_command = boom\n"
        "from kvpilot.cli import main\n"
        "sys.exit(main(['validate', '-f', '-']))\n"
    )
    proc = subprocess.run([sys.executable, str(script)], input="", capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 70
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error: RuntimeError" in lines[0] and len(lines[0]) < 500


def _with_gpu_type(tmp_path, value):
    path = tmp_path / "svc.yaml"
    path.write_text("apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: a}\n"
                    f"spec: {{model: m, resources: {{gpuType: {value}}}}}\n")
    return str(path)


def test_a_misspelt_gpu_type_is_valid_with_a_warning_that_suggests_the_board(tmp_path, capsys):
    # H1OO is a legal label value, and every pod would wait for a node labelled so: say it, on stderr.
    assert main(["validate", "-f", _with_gpu_type(tmp_path, "H1OO")]) == 0
    out, err = capsys.readouterr()
    assert "document 1 (a): valid" in out and "Warning" not in out
    assert "Warning:" in err and "spec.resources.gpuType: 'H1OO'" in err and "did you mean H100-80GB?" in err


def test_known_gpu_types_in_any_spelling_pass_without_a_warning(tmp_path, capsys):
    for value in ("H100", "H100-80GB", "NVIDIA-H100-80GB-HBM3", "nvidia-l4", "Tesla-T4", "NVIDIA-A100-SXM4-40GB"):
        assert main(["validate", "-f", _with_gpu_type(tmp_path, value)]) == 0
        assert capsys.readouterr().err == "", value


def test_validate_reads_a_directory_as_kubectl_does(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    for name in ("b.yaml", "a.yml", "sub/c.yaml"):
        (tmp_path / name).write_text((ROOT / "examples" / "minimal.yaml").read_text())
    (tmp_path / "d.json").write_text(
        '{"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "j"}, '
        '"spec": {"model": "m"}}')
    (tmp_path / "notes.txt").write_text("not a manifest")
    assert main(["validate", "-f", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines()] == [str(tmp_path / n) for n in ("a.yml", "b.yaml", "d.json")]
    assert main(["validate", "-R", "-f", str(tmp_path)]) == 0
    assert str(tmp_path / "sub" / "c.yaml") in capsys.readouterr().out


def test_validate_refuses_a_directory_with_nothing_to_read(tmp_path, capsys):
    assert main(["validate", "-f", str(tmp_path)]) == 1
    assert "a directory with no .json, .yaml, .yml files" in capsys.readouterr().err


def test_validate_reads_a_list_item_by_item(tmp_path, capsys):
    # What `kubectl get kvis -o yaml` prints: one v1 List holding the objects.
    items = [
        {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "a"},
         "spec": {"model": "m"}},
        {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "b"},
         "spec": {"model": "m", "engine": {"maxNumSeqs": 0}}},
    ]
    import yaml

    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
                                    "items": items}))
    assert main(["validate", "-f", str(path)]) == 1
    out = capsys.readouterr().out
    assert "document 1 item 1 (a): valid" in out
    assert "document 1 item 2 (b): spec.engine.maxNumSeqs" in out


def test_validate_minus_o_json_needs_no_prediction(tmp_path, capsys):
    # -o json was refused without --predict; a script reading results should not need the twin.
    import json

    assert main(["validate", "-o", "json", "-f", _with_gpu_type(tmp_path, "H1OO")]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["valid"] is True and "prediction" not in entry
    assert entry["warnings"][0].startswith("spec.resources.gpuType: 'H1OO'")
