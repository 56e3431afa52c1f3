"""`kvpilot twin run` and `kvpilot twin step-time`, through argparse and as a real process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvpilot.api import vllm as vllm_facts
from kvpilot.twin import commands


def cli(argv: list[str]) -> int:
    """The same dispatch as kvpilot.cli.main, with only the twin's commands registered."""
    parser = argparse.ArgumentParser(prog="kvpilot")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


def test_run_prints_a_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli(["twin", "run", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "A100-80GB", "--workload",
              "poisson:rate=5,prompt=200..800,output=50", "--duration", "20", "--max-num-batched-tokens", "1024",
              "--max-model-len", "8k", "--seed", "3", "--slo", "ttft=0.25,itl=0.025",
              "--trust-remote-code", "--dtype", "bfloat16", "--enable-chunked-prefill"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["max_num_batched_tokens"] == 1024 and report["config"]["max_model_len"] == 8000
    assert report["requests"]["completed"] == report["requests"]["total"] > 50
    for key in ("ttft_s", "itl_s", "e2e_s", "queue_s"):
        assert set(report[key]) >= {"p50", "p90", "p99"}
    assert report["slo"] == {"ttft_s": 0.25, "itl_s": 0.025}
    assert 0 <= report["goodput"]["requests_per_s"] <= report["throughput"]["requests_per_s"]
    ttft = report["histograms"][vllm_facts.METRIC_TTFT]
    assert list(ttft["buckets"])[:-1] == [f"{e:g}" for e in vllm_facts.TTFT_BUCKETS]
    assert ttft["buckets"]["+Inf"] == ttft["count"] == report["requests"]["completed"]
    itl = report["histograms"][vllm_facts.METRIC_ITL]
    assert list(itl["buckets"])[:-1] == [f"{e:g}" for e in vllm_facts.ITL_BUCKETS]
    counts = list(itl["buckets"].values())
    assert counts == sorted(counts)  # cumulative


def test_run_is_deterministic_for_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["twin", "run", "--model", "qwen2.5-7b", "--gpu", "L40S", "--max-model-len", "4096",
            "--workload", "gamma:rate=3,cv=2", "--num-requests", "60", "--no-histograms"]
    outs = []
    for _ in range(2):
        assert cli(argv) == 0
        report = json.loads(capsys.readouterr().out)
        report.pop("wall_s")
        outs.append(report)
    assert outs[0] == outs[1] and "histograms" not in outs[0]


@pytest.mark.parametrize(
    ("argv", "code", "match"),
    [
        (["--model", "gpt-5", "--workload", "poisson:rate=1"], 2, "unknown model 'gpt-5'"),
        (["llama-3.1-8b", "--gpu", "B300", "--workload", "poisson:rate=1"], 2, "unknown GPU 'B300'"),
        (["llama-3.1-8b", "--workload", "poisson"], 2, "rate=R"),
        (["llama-3.1-8b", "--workload", "poisson:rate=1", "--slo", "ttft=fast"], 2, "not a number"),
        (["llama-3.1-8b", "--gpu", "L4", "--workload", "poisson:rate=1"], 1, "max seq len"),
        (["llama-3.1-8b", "--gpu-memory-utilization", "0.999", "--workload", "poisson:rate=1"], 1,
         "less than desired GPU memory utilization"),
    ],
)
def test_run_errors_name_the_problem(argv: list[str], code: int, match: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["twin", "run", *argv]) == code
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_removed_and_unknown_flags_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(["twin", "run", "llama-3.1-8b", "--workload", "poisson:rate=1", "--max-num-partial-prefills", "2"])
    assert exc.value.code == 2
    assert "removed in vLLM 0.33" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["twin", "run", "llama-3.1-8b", "--workload", "poisson:rate=1", "--speculative-config", "{}"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_run_help_documents_workload_specs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(["twin", "run", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "poisson:rate=10" in out and "lognormal/MEDIAN/SIGMA" in out and "--max-num-batched-tokens" in out


def test_step_time_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["twin", "step-time", "--gpu", "H100-80GB", "--model", "Llama-3.1-70B", "--tp", "4",
                "--tokens", "512", "--decode-seqs", "64", "--context", "2000"]) == 0
    out = json.loads(capsys.readouterr().out)
    parts = out["linear_ms"] + out["attention_ms"] + out["allreduce_ms"] + out["lm_head_ms"] + out["cpu_overhead_ms"]
    assert out["total_ms"] == pytest.approx(parts, rel=1e-4)
    assert out["allreduce_ms"] > 0 and out["prefill_tokens"] == 448
    assert out["per_layer_linear_ms"] == pytest.approx(sum(out["per_layer_ops_ms"].values()), rel=1e-3)
    assert cli(["twin", "step-time", "--model", "Llama-3.1-8B", "--tokens", "8", "--decode-seqs", "9"]) == 2
    assert "--decode-seqs" in capsys.readouterr().err


def test_step_time_with_a_model_config(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert cli(["twin", "step-time", "--gpu", "a100", "--model-config", str(tmp_path / "config.json"),
                "--tokens", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Vidur measured 2.12 ms per layer for Llama-2-7B at 1024 tokens on an A100 (TP 1).
    assert out["per_layer_linear_ms"] == pytest.approx(2.12, rel=0.1)


def test_real_process_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "twin", "step-time", "--model", "mistral-7b", "--gpu", "L4",
         "--tokens", "128"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "Mistral-7B"


def test_the_help_names_the_vllm_whose_flags_the_twin_takes(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The flag list is read from one vLLM build and the engine modelled on another: say both, from the data.
    from kvpilot.api.serve_args import serve_options
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli(["twin", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"those `vllm serve` {serve_options().vllm_version} parses" in out
