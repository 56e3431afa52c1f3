"""The docs' commands, extracted from their code blocks: those that need no cluster are run (`kvpilot
validate` / `render` on the files they apply), and the rest are cross-checked against those files:
namespaces, names, Secrets, the served model, the tuning phases in sample outputs, and the kind
quickstart's rollback demo (valid for the API, refused by the twin at start-up, as vLLM would)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.cli import main

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Namespaces the docs use for kvpilot itself and for the monitoring stack, not for services.
INFRA_NAMESPACES = {"kvpilot-system", "monitoring"}


def blocks(doc: Path) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", doc.read_text(), flags=re.S | re.M)


def commands(doc: Path) -> list[str]:
    """Every command line of every code block: continuations joined, `$ ` prompts and comments dropped."""
    out = []
    for block in blocks(doc):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            line = re.sub(r"\s+#\s.*$", "", line)
            if line and not line.startswith("#"):
                out.append(line)
    return out


def expected_status(doc: Path, cmd: str) -> int:
    """The exit status a doc says its command has (a `# exits N` comment on the line), else 0."""
    m = re.search(re.escape(cmd) + r"\s+#\s*exits (\d+)", doc.read_text())
    return int(m.group(1)) if m else 0


def applied(doc: Path) -> list[dict[str, Any]]:
    files = [m for c in commands(doc) for m in re.findall(r"apply (?:-n \S+ )?-f (examples/\S+\.yaml)", c)]
    return [yaml.safe_load((ROOT / f).read_text()) for f in files]


def tuning_phases() -> set[str]:
    from kvpilot.api.vocabulary import TuningPhase

    return {p.value for p in TuningPhase}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_kvpilot_commands_that_need_no_cluster_run(doc: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(ROOT)
    ran = 0
    for cmd in commands(doc):
        if not cmd.startswith(("kvpilot validate", "kvpilot render")):
            continue
        argv = shlex.split(cmd)
        if argv[:2] in (["kvpilot", "validate"], ["kvpilot", "render"]):
            status = expected_status(doc, cmd)
            assert main(argv[1:]) == status, f"{doc.name}: `{cmd}` failed:\n{capsys.readouterr().err[-2000:]}"
            ran += 1
    if doc.name in ("README.md", "quickstart-cluster.md"):
        assert ran, f"{doc.name} has no validate/render command to run"


@pytest.mark.parametrize("doc", [d for d in DOCS if applied(d)], ids=lambda p: p.name)
def test_names_and_namespaces_match_the_files_applied(doc: Path) -> None:
    objs = applied(doc)
    namespaces = {o["metadata"].get("namespace", "default") for o in objs}
    names = {o["metadata"]["name"] for o in objs}
    models = {o["spec"].get("servedModelName") or o["spec"]["model"] for o in objs}
    secrets = {(o["metadata"].get("namespace", "default"), o["spec"]["hfTokenSecret"]["name"],
                o["spec"]["hfTokenSecret"].get("key", "HF_TOKEN")) for o in objs if o["spec"].get("hfTokenSecret")}
    for cmd in commands(doc):
        if not cmd.startswith("kubectl"):
            continue
        argv = shlex.split(cmd)
        ns = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-n", "--namespace")), None)
        if "apply" in argv and ns is not None:
            assert ns in namespaces, f"{doc.name}: `{cmd}` applies into {ns}, the file says {namespaces}"
        every_ns = "-A" in argv or "--all-namespaces" in argv
        workload = not every_ns and any(w in cmd for w in ("kvis", "svc/", "involvedObject", "secret generic"))
        if workload and ns not in INFRA_NAMESPACES:
            assert (ns or "default") in namespaces, f"{doc.name}: `{cmd}`: namespace {ns or 'default'}, not {namespaces}"
        if "secret" in argv and "generic" in argv:
            name = argv[argv.index("generic") + 1]
            key = next(a.split("=")[1] for a in argv if a.startswith("--from-literal="))
            assert (ns or "default", name, key) in secrets, f"{doc.name}: `{cmd}` is not the Secret {secrets}"
        for ref in re.findall(r"(?:kvis |svc/|involvedObject\.name=)([a-z0-9][a-z0-9.-]*)", cmd):
            if ns not in INFRA_NAMESPACES:
                assert ref in names, f"{doc.name}: `{cmd}` names {ref}, the file has {names}"
        for model in re.findall(r'"model":\s*"([^"]+)"', cmd):
            assert model in models, f"{doc.name}: requests model {model!r}; the service serves {models}"
        for env in argv:
            if env.startswith("--env=LOAD_MODEL="):
                assert env.split("=", 2)[2] in models, env
            if env.startswith("--env=LOAD_URL="):
                host = env.split("//", 1)[1].split(":")[0].split(".")
                assert host[0] in names and host[1] in namespaces, env


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_sample_outputs_show_only_phases_the_tuner_sets(doc: Path) -> None:
    phases = tuning_phases()
    for block in blocks(doc):
        lines = [line[2:] if line.startswith("$ ") else line for line in block.splitlines()]
        for i, line in enumerate(lines):
            if not (line.startswith("NAME") and "TUNING" in line):
                continue
            start = line.index("TUNING")
            end = line.index("AGE") if "AGE" in line else None
            for row in lines[i + 1:]:
                if not row.strip() or row.startswith(("NAME", "kubectl", "$")):
                    break
                value = row[start:end].strip()
                assert value == "" or value in phases, f"{doc.name}: TUNING {value!r} is not a phase ({phases})"


def _merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in patch.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def test_the_kind_rollback_demo_is_valid_yet_refused_by_the_twin(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    doc = ROOT / "docs" / "quickstart-kind.md"
    patches = [shlex.split(c) for c in commands(doc) if c.startswith("kubectl patch kvis")]
    assert len(patches) == 1
    argv = patches[0]
    (obj,) = [o for o in applied(doc) if o["metadata"]["name"] == argv[3]]
    patched = _merge(obj, json.loads(argv[argv.index("-p") + 1]))
    manifest = tmp_path / "patched.yaml"
    manifest.write_text(yaml.safe_dump(patched))
    # The API takes it: the operator rolls it out (not InvalidSpec) ...
    assert main(["validate", "-f", str(manifest)]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert main(["render", "-f", str(manifest)]) == 0
    rendered = list(yaml.safe_load_all(capsys.readouterr().out))
    (dep,) = [d for d in rendered if d and d["kind"] == "Deployment"]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    args = [*container.get("command", [])[1:], *container.get("args", [])]
    assert args[:2] == ["twin", "serve"], args
    # ... and the engine it renders refuses to start, so the rollout cannot progress: RolledBack.
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", *args, "--host", "127.0.0.1", "--port", "0",
                           "--startup-delay", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0
    assert "KV cache" in proc.stderr and "Traceback" not in proc.stderr
    # ... at once, not at the deadline: the kubelet's termination message of that output (the engine
    # container's FallbackToLogsOnError) is vLLM's start-up failure, with the numbers the tuner grades by.
    from kvpilot.api.startup import memory_report
    from kvpilot.operator.builders.pods import engine_failure
    from tests.support.vllm_text import termination_message

    status = {"name": container["name"], "restartCount": 0,
              "state": {"terminated": {"exitCode": proc.returncode, "reason": "Error",
                                       "message": termination_message(proc.stdout + proc.stderr)}}}
    failure = engine_failure({"metadata": {"name": "llama-8b-twin-1"}, "status": {"containerStatuses": [status]}},
                             crash_loop_restarts=3)
    assert failure is not None and failure.reason == "EngineStartupFailed" and not failure.cause_above
    report = memory_report(failure.cause)
    assert report is not None and report.kind == "kv_short", failure.cause


def test_the_operators_twin_image_is_the_charts_image() -> None:
    from kvpilot.operator.builders.common import DEFAULT_TWIN_IMAGE

    values = yaml.safe_load((ROOT / "charts" / "kvpilot" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "kvpilot" / "Chart.yaml").read_text())
    image = values["image"]
    assert f"{image['repository']}:{image['tag'] or chart['appVersion']}" == DEFAULT_TWIN_IMAGE


def test_kvpilot_is_on_path_before_the_readme_uses_it_bare() -> None:
    """`make tune` installs kvpilot into .venv; the README's bare `kvpilot` commands come after it says how
    to put that on PATH (and `make tune` says so too)."""
    cmds = commands(ROOT / "README.md")
    first_bare = next(i for i, c in enumerate(cmds) if c.startswith("kvpilot "))
    activate = next((i for i, c in enumerate(cmds) if re.fullmatch(r"(\.|source) \.venv/bin/activate", c)), None)
    assert activate is not None and activate < first_bare, "README uses bare `kvpilot` before activating .venv"
    tune = (ROOT / "Makefile").read_text().split("\ntune:", 1)[1].split("\n\n", 1)[0]
    assert ".venv" in tune.replace("$(VENV)", ".venv") and "activate" in tune


def readme_commands() -> list[str]:
    """The README's commands: its untagged code blocks (```text and ```yaml blocks are outputs and files)."""
    out: list[str] = []
    tag = None  # the open fence's tag ("" untagged); None outside a fence
    for line in (ROOT / "README.md").read_text().replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            tag = line[3:].strip() if tag is None else None
        elif tag == "":
            line = re.sub(r"\s+#\s.*$", "", line.strip())
            if line and not line.startswith("#"):
                out.append(line)
    return out


def test_every_kvpilot_command_the_readme_prints_parses() -> None:
    """Those the first test does not run (tune, twin, slo) take their arguments as printed."""
    from kvpilot.cli import build_parser

    cmds = [c for c in readme_commands() if c.startswith("kvpilot ")]
    assert any(c.startswith("kvpilot tune ") for c in cmds), cmds
    for cmd in cmds:
        try:
            build_parser().parse_args(shlex.split(cmd)[1:])
        except SystemExit as exc:
            pytest.fail(f"README.md: `{cmd}` does not parse (exit {exc.code})")


def test_the_readmes_tune_output_names_the_study_report_and_storage_the_tuner_uses() -> None:
    """The sample output's study, its report `out/<study>.html`, and the storage `optuna-dashboard` opens."""
    from kvpilot.tuner.commands import DEFAULT_TUNE_STORAGE
    from kvpilot.tuner.jobs import report_path

    text = (ROOT / "README.md").read_text()
    study, storage = re.search(r"^study '([^']+)' in (\S+)$", text, flags=re.M).groups()
    assert storage == DEFAULT_TUNE_STORAGE
    report = re.search(r"^report: (\S+)$", text, flags=re.M).group(1)
    assert Path(report) == report_path(None, study)
    assert f"optuna-dashboard {DEFAULT_TUNE_STORAGE}" in readme_commands()
    assert "make tune" in readme_commands()


def test_the_tuned_example_holds_the_block_the_readmes_tune_output_recommends() -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^(spec:\n  engine:\n(?:    .*\n)+)", text, flags=re.M).group(1)
    tuned = yaml.safe_load((ROOT / "docs" / "examples" / "tuned.yaml").read_text())
    assert tuned["spec"]["engine"] == yaml.safe_load(block)["spec"]["engine"]
    assert tuned["spec"]["resources"]["gpuType"]
