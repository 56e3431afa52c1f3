"""`kvpilot tune --offline` end to end on the twin (small), and its input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvpilot.cli import main


def test_offline_tune_prints_a_table_writes_study_and_report_and_ends_with_the_engine_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "study.db"
    report = tmp_path / "report.html"
    argv = ["tune", "--offline", "--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--trials", "3", "-q",
            "--workload", "prompt=256,output=32", "--probe-seconds", "20", "--slo", "ttft=0.5,itl=0.05",
            "--storage", f"sqlite:///{db}", "--report", str(report)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "tokens" in err and "WithinSLO" in err  # the table on stderr: stdout is the block alone
    assert yaml.safe_load(out) and out.lstrip().startswith("# kvpilot tune --offline")
    block = out[out.index("# kvpilot tune --offline"):]
    engine = yaml.safe_load(block)["spec"]["engine"]
    assert set(engine) == {"maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs", "maxModelLen",
                           "tensorParallelSize"}
    assert engine["maxNumBatchedTokens"] >= engine["maxNumSeqs"]
    assert db.exists() and report.read_text().count("data:image/png;base64") == 3
    # A rerun resumes the study: 3 trials are done, nothing new runs.
    assert main([*argv, "--report", ""]) == 0
    import optuna

    summaries = optuna.get_all_study_summaries(storage=f"sqlite:///{db}")
    assert len(summaries) == 1 and summaries[0].n_trials == 3


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--slo", "ttft=fast"], "--slo: ttft=fast is not a number of seconds"),
        (["--workload", "prompt=12,colour=blue"], "unknown key 'colour'; allowed: rate, cv, prompt"),
        (["--workload", "prompt=12,requests=60"], "--probe-seconds S"),
        (["--probe-seconds", "5"], "--probe-seconds: must be between 10 and 3600"),
        (["--gpu", "TPU-v5"], "unknown GPU 'TPU-v5'"),
        (["--tokens", "4096:256"], "maxNumBatchedTokens"),
        (["--trials", "0"], "--trials must be >= 1"),
        (["--model", "Llama-3.1-70B", "-tp", "3"], "must be divisible by tensor parallel size (3)"),
        (["--join"], "--join: several independent processes on one study need a database server"),
        (["--heartbeat-interval", "0"], "--heartbeat-interval must be >= 1 second"),
        (["--grace-period", "10"], "--grace-period must be more than --heartbeat-interval (10)"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    assert main(["tune", "--offline", "-q", "--storage", f"sqlite:///{tmp_path}/s.db", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_canary_weight_outside_0_1_is_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["tune", "--local", "--prometheus", "http://127.0.0.1:9", "--storage", f"sqlite:///{tmp_path}/s.db",
                 "--report", "", "--trial-strategy", "canary", "--canary-weight", "1.5", "--",
                 "kvpilot", "twin", "serve", "--port", "8000"]) == 2
    err = capsys.readouterr().err
    assert "--canary-weight" in err and "in (0, 1)" in err and "Traceback" not in err


def test_a_negative_confirm_windows_is_one_clear_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["tune", "--local", "--prometheus", "http://127.0.0.1:9", "--storage", f"sqlite:///{tmp_path}/s.db",
                 "--report", "", "--confirm-windows", "-1", "--",
                 "kvpilot", "twin", "serve", "--port", "8000"]) == 2
    err = capsys.readouterr().err
    assert "--confirm-windows" in err and "0 or more" in err and "Traceback" not in err
