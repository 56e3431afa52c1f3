"""Every hostile config.json of tests/fuzz/model_configs.py, and /dev/zero, through each command that
reads a model's config.json (and those of size, nesting and encoding through --device-profile and
--observations, the twin's other JSON inputs): one clear error naming what is wrong (or the right answer), no traceback,
no internal error, within 2 CPU-seconds and 200 MB of its own, measured by the kernel in a forked
child (tests/fuzz/harness.py)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpilot.twin.calibration import CPU_OBSERVATIONS
from tests.fuzz.model_configs import CASES, Case

ROOT = Path(__file__).resolve().parents[3]
CPU_BOUND_S = 2.0
MEMORY_BOUND_MB = 200.0
SERVICE = """\
apiVersion: kvpilot.dev/v1alpha1
kind: InferenceService
metadata: {name: s, namespace: ml}
spec:
  model: custom
  resources: {gpuType: NVIDIA-L4}
"""
# `tune --model` reads a path as a config.json only when it ends in .json (else it names a preset).
DEV_ZERO = Case("dev-zero", b"", "larger than 1024 KiB", ("predict", "twin-run", "calibrate"))


def _argv(command: str, tmp: Path, config: str) -> list[str]:
    return {
        "predict": ["validate", "--predict", "-f", str(tmp / "svc.yaml"), "--model-config", config],
        "twin-run": ["twin", "run", "--workload", "poisson:rate=1", "--num-requests", "2", "--gpu", "L4",
                     "--model-config", config],
        "tune": ["tune", "--offline", "--model", config, "--gpu", "L4", "--trials", "1", "-q",
                 "--workload", "prompt=64,output=8", "--probe-seconds", "10",
                 "--storage", f"sqlite:///{tmp}/tune.db", "--report", ""],
        "calibrate": ["twin", "calibrate", "--observations", str(CPU_OBSERVATIONS), "--model-config", config,
                      "--output", str(tmp / "profile.json")],
        # The twin's other JSON inputs, through the same bounded reader.
        "device-profile": ["twin", "run", "--workload", "poisson:rate=1", "--num-requests", "2",
                           "--device-profile", config],
        "observations": ["twin", "calibrate", "--observations", config, "--output", str(tmp / "profile.json")],
    }[command]


# The cases of size, nesting and encoding, which every JSON file the twin reads is held to.
OTHER_JSON = ("too-large", "deep-2000", "deep-list-300k", "int-5000-digits", "not-utf8")


def _runs() -> list[tuple[Case, str]]:
    runs = [(case, command) for case in CASES for command in case.commands]
    runs += [(case, command) for case in CASES if case.id in OTHER_JSON
             for command in ("device-profile", "observations")]
    return runs + [(DEV_ZERO, command) for command in (*DEV_ZERO.commands, "device-profile", "observations")]


RUNS = _runs()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    tmp = tmp_path_factory.mktemp("model-configs")
    (tmp / "svc.yaml").write_text(SERVICE)
    jobs = [{"id": f"{command}/{case.id}", "input_name": "config.json",
             "argv": _argv(command, tmp, "/dev/zero" if case is DEV_ZERO else "{input}"),
             "input": base64.b64encode(case.data).decode()} for case, command in RUNS]
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.harness"], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for line in proc.stdout.splitlines():
        result = json.loads(line)
        command, _, case_id = result["id"].partition("/")
        out[(command, case_id)] = result
    assert len(out) == len(jobs)
    return out


@pytest.mark.parametrize(("case", "command"), RUNS, ids=[f"{c.id}-{command}" for c, command in RUNS])
def test_case(case: Case, command: str, results: dict[tuple[str, str], dict]) -> None:
    r = results[(command, case.id)]
    text = r["stdout"] + r["stderr"]
    assert "Traceback" not in text, text[-2000:]
    assert "internal error" not in text, text[-2000:]
    assert r["cpu_s"] <= CPU_BOUND_S, f"{r['cpu_s']} CPU-seconds"
    assert r["peak_rss_mb"] <= MEMORY_BOUND_MB, f"{r['peak_rss_mb']} MB"
    if case.expect == "valid":
        assert r["returncode"] == 0, text[-2000:]
        if command == "predict":
            assert "predicted: custom on L4" in r["stdout"], r["stdout"][-2000:]
        return
    # `validate --predict` reports a config it cannot use as missing information (exit 0), the others exit 2.
    assert r["returncode"] == (0 if command == "predict" else 2), (r["returncode"], text[-2000:])
    assert case.expect in text, text[-2000:]
    # No value is echoed whole (a 100,000-character architecture name is shown by its first characters).
    assert r["stdout_len"] + r["stderr_len"] <= 4096, text[-2000:]


def test_twin_serve_refuses_a_hostile_config_before_it_serves(tmp_path: Path) -> None:
    """`twin serve` reads --model-config through the same reader; a refusal ends it with exit 2 at once."""
    for case_id in ("num_attention_heads-zero", "deep-2000"):
        config = tmp_path / "config.json"
        config.write_bytes(next(c for c in CASES if c.id == case_id).data)
        proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "twin", "serve", "--port", "0",
                               "--model-config", str(config)], capture_output=True, text=True, timeout=60,
                              cwd=ROOT)
        assert proc.returncode == 2, proc.stderr[-2000:]
        expected = next(c for c in CASES if c.id == case_id).expect
        assert expected in proc.stderr and "internal error" not in proc.stderr, proc.stderr[-2000:]
