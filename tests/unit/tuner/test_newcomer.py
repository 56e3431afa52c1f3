"""What a new user hits first with `kvpilot tune --offline`: a changed question gets a new answer, bad
input is one clear line, a model that cannot start says why, the engine block pastes into a manifest,
and the report says what was asked."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from kvpilot.cli import main
from kvpilot.tuner.identity import StudyMismatch, bind, differences, digest, identity

ROOT = Path(__file__).resolve().parents[3]
SMALL = ["--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--trials", "2", "-q",
         "--workload", "prompt=256,output=32", "--probe-seconds", "20"]


def _tune(tmp_path: Path, *args: str) -> list[str]:
    return ["tune", "--offline", *SMALL, "--storage", f"sqlite:///{tmp_path}/s.db", "--report", "", *args]


def _studies(tmp_path: Path) -> list[str]:
    return sorted(s.study_name for s in optuna.get_all_study_summaries(storage=f"sqlite:///{tmp_path}/s.db"))


# -- 1: a study's identity -------------------------------------------------------------------------

def test_identity_covers_every_input_and_reads_alike_whatever_the_order() -> None:
    base = dict(model="m", gpu="g", slo={"ttftSeconds": 0.5, "itlSeconds": 0.05}, seed=0)
    assert digest(identity(**base)) == digest(identity(**dict(reversed(base.items()))))
    assert digest(identity(**base)) == digest(identity(**{**base, "slo": {"itlSeconds": 0.05, "ttftSeconds": 0.5}}))
    for key, other in (("slo", {"ttftSeconds": 0.001, "itlSeconds": 0.05}), ("seed", 1), ("gpu", "h")):
        assert digest(identity(**base)) != digest(identity(**{**base, key: other})), key
    assert differences(identity(**base), identity(**{**base, "seed": 3})) == ["seed: 0 -> 3"]


def test_a_study_made_for_other_inputs_is_refused_with_what_differs() -> None:
    study = optuna.create_study(study_name="s")
    bind(study, identity(tensorParallelSize=1, rate=5.0))
    bind(study, identity(tensorParallelSize=1, rate=5))  # the same question
    with pytest.raises(StudyMismatch, match=r"rate: 5 -> 8; tensorParallelSize: 1 -> 2"):
        bind(study, identity(tensorParallelSize=2, rate=8))


def test_an_unrecorded_study_with_trials_is_not_trusted() -> None:
    study = optuna.create_study(study_name="old")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    with pytest.raises(StudyMismatch, match="no record of the inputs"):
        bind(study, identity(seed=0))


@pytest.mark.parametrize("change", [
    ["--slo", "ttft=0.001,itl=0.05"],
    ["--tensor-parallel-size", "2"],
    ["--max-model-len", "4096"],
    ["--workload", "prompt=300,output=32"],
    ["--probe-seconds", "30"],
    ["--seed", "1"],
])
def test_a_changed_question_starts_a_new_study(tmp_path: Path, change: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path)) == 0
    capsys.readouterr()
    main(_tune(tmp_path, *change))
    err = capsys.readouterr().err
    assert "resuming" not in err
    assert len(_studies(tmp_path)) == 2


def test_the_latency_goals_rate_is_part_of_the_question(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path, "--goal", "latency", "--rate", "2")) == 0
    assert main(_tune(tmp_path, "--goal", "latency", "--rate", "4")) == 0
    assert len(_studies(tmp_path)) == 2


def test_the_same_question_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path)) == 0
    capsys.readouterr()
    assert main(_tune(tmp_path)) == 0
    assert "resuming: 2 trials done" in capsys.readouterr().err
    assert len(_studies(tmp_path)) == 1


def test_a_named_study_asked_another_question_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path, "--study-name", "mine")) == 0
    capsys.readouterr()
    assert main(_tune(tmp_path, "--study-name", "mine", "--slo", "ttft=0.001,itl=0.05")) == 2
    err = capsys.readouterr().err
    assert 'slo: {"itlSeconds": 0.05, "ttftSeconds": 0.5} -> {"itlSeconds": 0.05, "ttftSeconds": 0.001}' in err
    assert "Traceback" not in err
    trials = optuna.load_study(study_name="mine", storage=f"sqlite:///{tmp_path}/s.db").trials
    assert len(trials) == 2  # untouched


# -- 3: storage and credentials are one clear line ---------------------------------------------------

def test_a_storage_path_is_not_a_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--offline", "-q", "--storage", "x.db"]) == 2
    err = capsys.readouterr().err
    assert "--storage: expected a database URL" in err and "sqlite:///x.db" in err and "Traceback" not in err


def test_a_missing_database_driver_names_the_extra(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed here: there is no missing driver to report")
    assert main(["tune", "--offline", "-q", "--storage", "postgresql://kv:pw@127.0.0.1:1/kv"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'kvpilot[postgresql]'" in err and "Traceback" not in err


def test_the_tuner_without_credentials_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", "http://127.0.0.1:1",
                           "--metrics-port", "0", "--storage", f"sqlite:///{tmp_path}/t.db"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "no Kubernetes credentials" in proc.stderr and "Traceback" not in proc.stderr


def test_the_tuner_refuses_a_storage_path(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", "http://127.0.0.1:1",
                           "--storage", "tuner.db"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "--storage: expected a database URL" in proc.stderr and "Traceback" not in proc.stderr


# -- 4: a model that cannot start says why -----------------------------------------------------------

def test_a_model_too_big_for_the_gpu_shows_the_cause_and_the_flag(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["tune", "--offline", "-q", "--model", "Llama-3.1-70B", "--gpu", "L4", "--trials", "2",
            "--storage", f"sqlite:///{tmp_path}/s.db", "--report", ""]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "GiB per GPU" in err and "--tensor-parallel-size" in err
    assert "relax the SLO" not in err


# -- 5: the engine block pastes into a manifest ------------------------------------------------------

def _deep_merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for k, v in patch.items():
        out[k] = _deep_merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def test_the_engine_block_merges_into_an_inferenceservice(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path, "--max-model-len", "4096")) == 0
    out = capsys.readouterr().out
    block = yaml.safe_load(out[out.index("# kvpilot tune --offline"):])
    assert set(block) == {"spec"}
    assert block["spec"]["engine"]["maxModelLen"] == 4096
    assert block["spec"]["engine"]["tensorParallelSize"] == 1
    isvc = _deep_merge(yaml.safe_load((ROOT / "examples" / "twin.yaml").read_text()), block)
    manifest = tmp_path / "tuned.yaml"
    manifest.write_text(yaml.safe_dump(isvc))
    assert main(["validate", "-f", str(manifest)]) == 0, capsys.readouterr()


# -- 7: the report says what was asked, one per study, in the format asked ---------------------------

def test_the_report_states_the_question_and_each_study_keeps_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    base = ["tune", "--offline", *SMALL, "--storage", f"sqlite:///{tmp_path}/s.db"]
    assert main(base) == 0
    assert main([*base, "--slo", "ttft=0.8,itl=0.08"]) == 0
    reports = sorted((tmp_path / "out").glob("*.html"))
    assert len(reports) == 2
    assert {r.stem for r in reports} == set(_studies(tmp_path))
    texts = sorted(r.read_text() for r in reports)
    assert sum("p99 TTFT &lt;= 0.8 s, p99 ITL &lt;= 0.08 s" in t for t in texts) == 1
    assert sum("p99 TTFT &lt;= 0.5 s, p99 ITL &lt;= 0.05 s" in t for t in texts) == 1
    for text in texts:
        assert "<th>Workload</th><td>custom:prompt=256,output=32: 256 prompt / 32 output tokens" in text
        assert "capacity: the highest arrival rate (req/s) sustained in steady state" in text


def test_a_pdf_report_is_a_pdf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the report extra is not installed")
    out = tmp_path / "r.pdf"
    assert main(_tune(tmp_path)[:-2] + ["--report", str(out)]) == 0
    assert out.read_bytes().startswith(b"%PDF")


def test_an_unknown_report_format_is_refused_before_tuning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path)[:-2] + ["--report", str(tmp_path / "r.docx")]) == 2
    err = capsys.readouterr().err
    assert "--report:" in err and ".html, .png, .pdf, .svg" in err
    assert not (tmp_path / "s.db").exists() or _studies(tmp_path) == []


# -- the in-cluster tuner's storage: its own configuration, the password never on its command line -----

def test_the_tuner_refuses_a_password_on_its_command_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", "http://127.0.0.1:1",
                           "--storage", "postgresql://kv:s3cret@db:5432/kv"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert "--storage carries a password" in proc.stderr and "$KVPILOT_TUNER_STORAGE" in proc.stderr
    assert "s3cret" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


def test_the_tuner_reads_its_storage_from_the_environment_and_masks_the_password(tmp_path: Path) -> None:
    from kvpilot.api.vocabulary import ENV_TUNER_STORAGE

    # A URL SQLAlchemy cannot read, from the environment: the error names the variable, not a flag,
    # and shows the URL with its password masked.
    env = {**os.environ, "PYTHONPATH": str(ROOT), ENV_TUNER_STORAGE: "postgres ql://kv:s3cret@db/kv"}
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", "http://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"${ENV_TUNER_STORAGE}: 'postgres ql://kv:***@db/kv' is not a database URL" in proc.stderr
    assert "s3cret" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "environ", "url"), [
    ([], {}, "sqlite:////var/lib/kvpilot/tuner.db"),
    ([], {"KVPILOT_TUNER_STORAGE": "postgresql://kv:pw@db/kv"}, "postgresql://kv:pw@db/kv"),
    (["--storage", "sqlite:////data/t.db"], {"KVPILOT_TUNER_STORAGE": "postgresql://kv:pw@db/kv"},
     "sqlite:////data/t.db"),
])
def test_the_tuners_storage_is_the_flag_then_the_environment_then_the_default(
        argv: list[str], environ: dict[str, str], url: str) -> None:
    from kvpilot.cli import build_parser
    from kvpilot.tuner.commands import tuner_storage

    args = build_parser().parse_args(["tuner", "--prometheus", "http://p:9090", *argv])
    assert tuner_storage(args, environ) == url


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://kv:s3cret@db:5432/kv", "postgresql://kv:***@db:5432/kv"),
    ("postgresql+psycopg://kv:p%40ss@db/kv?sslmode=require", "postgresql+psycopg://kv:***@db/kv?sslmode=require"),
    ("postgresql://kv@db/kv", "postgresql://kv@db/kv"),
    ("sqlite:////var/lib/kvpilot/tuner.db", "sqlite:////var/lib/kvpilot/tuner.db"),
])
def test_redacted_masks_only_the_password(url: str, shown: str) -> None:
    from kvpilot.tuner.storage import has_password, redacted

    assert redacted(url) == shown
    assert has_password(url) == (shown != url)


@pytest.mark.parametrize("flag", ["--max-model-len", "--tensor-parallel-size"])
def test_a_size_below_one_is_refused_by_the_flag_not_the_engine(flag: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # 0 tokens was once reported as "greater than the derived max_model_len", after the study was made.
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--offline", flag, "0", "--storage", f"sqlite:///{tmp_path}/s.db"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "0 must be >= 1" in err
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize(("content", "match"), [
    (None, "cannot read trace"),
    ("", "has no requests"),
    ('{"arrival_s": 0, "prompt_tokens": 10}\n', "arrival_s, prompt_tokens and output_tokens"),
])
def test_a_bad_trace_is_refused_before_the_study_exists(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         content: str | None, match: str) -> None:
    # Read lazily, a missing trace made every trial fail and stored them, and a rerun resumed into them.
    trace = tmp_path / "trace.jsonl"
    if content is not None:
        trace.write_text(content)
    db = tmp_path / "s.db"
    assert main(["tune", "--offline", "--workload", str(trace), "--storage", f"sqlite:///{db}"]) == 2
    assert match in capsys.readouterr().err
    assert not db.exists()


@pytest.mark.parametrize("spelling", [
    ["--gpu", "H100"],
    ["--gpu", "nvidia-h100-80gb-hbm3"],
    ["--model", "meta-llama/Llama-3.1-8B-Instruct"],
    ["--workload", "prompt=256,output=32,rate=7"],  # capacity tuning searches the rate itself
])
def test_the_same_question_in_another_spelling_resumes_its_study(tmp_path: Path, spelling: list[str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tune(tmp_path)) == 0
    capsys.readouterr()
    assert main(_tune(tmp_path, *spelling)) == 0
    assert "resuming: 2 trials done" in capsys.readouterr().err
    assert len(_studies(tmp_path)) == 1


def test_a_trace_is_its_content_not_how_its_path_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"arrival_s": {i * 0.5}, "prompt_tokens": 200, "output_tokens": 20}}\n'
                             for i in range(40)))
    monkeypatch.chdir(tmp_path)
    assert main(_tune(tmp_path, "--workload", str(trace))) == 0
    assert main(_tune(tmp_path, "--workload", "./t.jsonl")) == 0
    assert "resuming" in capsys.readouterr().err and len(_studies(tmp_path)) == 1
    trace.write_text(trace.read_text().replace('"output_tokens": 20', '"output_tokens": 40'))
    assert main(_tune(tmp_path, "--workload", "t.jsonl")) == 0
    assert len(_studies(tmp_path)) == 2


def test_a_database_that_refuses_connections_is_the_environment_not_a_bug(capsys: pytest.CaptureFixture[str]) -> None:
    # It ended as "internal error" (exit 70); nothing listens on a port just freed.  Needs the driver
    # (the lowest-dependencies run has none: the test above covers that case).
    import socket

    pytest.importorskip("psycopg")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["tune", "--offline", "--trials", "1", "--storage",
                 f"postgresql://kv:s3cret@127.0.0.1:{port}/studies"]) == 69
    err = capsys.readouterr().err
    assert f"cannot connect to the study storage postgresql://kv:***@127.0.0.1:{port}/studies" in err
    assert "s3cret" not in err and "internal error" not in err


def test_stdout_is_the_answer_alone_yaml_or_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `kvpilot tune --offline > engine.yaml` did not parse: the trials table shared stdout with the block.
    import json

    assert main(_tune(tmp_path)) == 0
    out, err = capsys.readouterr()
    assert set(yaml.safe_load(out)) == {"spec"} and "WithinSLO" in err
    assert main(_tune(tmp_path, "-o", "json")) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["engine"] == yaml.safe_load(out)["spec"]["engine"]
    assert result["study"] in _studies(tmp_path)
    # The baseline says which it is, with its values: vLLM's own defaults on an H100, not an InferenceService's.
    baseline = result["vllmDefaults"]["engine"]
    assert (baseline["maxNumBatchedTokens"], baseline["maxNumSeqs"]) == (8192, 1024)
    shown = f"{baseline['maxNumBatchedTokens']}/{baseline['gpuMemoryUtilization']:g}/{baseline['maxNumSeqs']}"
    assert f"(vLLM defaults: {result['vllmDefaults']['value']:.3f} at {shown}, `vllm serve` without these flags)" \
        in out.strip().splitlines()[0]
