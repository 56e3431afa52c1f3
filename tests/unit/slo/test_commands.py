"""`kvpilot slo ...` end to end through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvpilot.cli import main

ISVC = """\
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: llama, namespace: prod}
spec:
  model: meta/llama
  slo: {ttftSeconds: 1.0, itlSeconds: 0.1, objective: 0.995}
"""


@pytest.fixture
def isvc_file(tmp_path: Path) -> Path:
    p = tmp_path / "isvc.yaml"
    p.write_text(ISVC)
    return p


def test_rules_prints_a_prometheus_rule(isvc_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "rules", "-f", str(isvc_file), "--label", "release=prom"]) == 0
    obj = yaml.safe_load(capsys.readouterr().out)
    assert obj["kind"] == "PrometheusRule" and obj["metadata"]["name"] == "llama-slo"
    assert obj["metadata"]["labels"]["release"] == "prom"


def test_rules_as_rule_file(isvc_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "rules", "-f", str(isvc_file), "--format", "rulefile"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert list(doc) == ["groups"] and doc["groups"][0]["rules"]


def test_dashboard_one_and_all(isvc_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "dashboard", "-f", str(isvc_file)]) == 0
    assert json.loads(capsys.readouterr().out)["title"] == "kvpilot / prod / llama"
    assert main(["slo", "dashboard", "--all", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == "kvpilot-inferenceservices"


def test_dashboard_minus_o_is_the_format_and_a_file_name_there_still_writes_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.json"
    assert main(["slo", "dashboard", "--all", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["uid"] == "kvpilot-inferenceservices"
    printed = capsys.readouterr()
    assert printed.out == "" and f"write the file with `kvpilot slo dashboard ... > {out}`" in printed.err


@pytest.mark.parametrize("spelling", [["-o", "json"], ["--output", "json"], ["--json"]])
def test_query_takes_minus_o_json_like_every_command(spelling: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "query", "--selector", "job=twin", *spelling]) == 0
    assert "ttft_p99_seconds" in json.loads(capsys.readouterr().out)


def test_query_prints_promql_for_a_selector(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "query", "--selector", "job=twin", "--window", "600s", "--json"]) == 0
    queries = json.loads(capsys.readouterr().out)
    assert '{job="twin"}' in queries["ttft_p99_seconds"] and "[600s]" in queries["ttft_p99_seconds"]
    assert 'le="0.5"' in queries["ttft_error_ratio"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["slo", "rules", "-f", "/nonexistent.yaml"], "cannot read /nonexistent.yaml"),
        (["slo", "query"], "give an InferenceService with -f FILE"),
        (["slo", "query", "--selector", "job"], "expected LABEL=VALUE"),
        (["slo", "query", "--selector", "job=x", "--ttft", "0.3"], "0.3s is not a bucket edge"),
        (["slo", "query", "--selector", "job=x", "--window", "soon"], "not a Prometheus duration"),
        (["slo", "query", "--selector", "kvpilot.dev/x=y"], "not a Prometheus label name"),
    ],
)
def test_bad_input_is_a_clear_error(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_invalid_service_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(ISVC.replace("ttftSeconds: 1.0", "ttftSeconds: 0.3"))
    assert main(["slo", "rules", "-f", str(bad)]) == 2
    assert "spec.slo.ttftSeconds" in capsys.readouterr().err


def test_signals_unreachable_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    from harness.prometheus import free_port

    code = main(["slo", "signals", "--prometheus", f"http://127.0.0.1:{free_port()}", "--selector", "job=x", "--timeout", "2"])
    assert code == 2
    assert "did not answer" in capsys.readouterr().err


def test_help_helps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["slo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for sub in ("rules", "dashboard", "query", "signals"):
        assert sub in out


def test_other_kinds_in_the_file_are_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n---\n" + ISVC)
    assert main(["slo", "rules", "-f", str(bundle)]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metadata"]["name"] == "llama-slo"
    only_ns = tmp_path / "ns.yaml"
    only_ns.write_text("apiVersion: v1\nkind: Namespace\nmetadata: {name: prod}\n")
    assert main(["slo", "rules", "-f", str(only_ns)]) == 2
    assert "no InferenceService found" in capsys.readouterr().err


def test_broken_yaml_says_where(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [unclosed\n")
    assert main(["slo", "rules", "-f", str(broken)]) == 2
    assert "not valid YAML at line" in capsys.readouterr().err
