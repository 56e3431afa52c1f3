"""Every hostile manifest of tests/fuzz/documents.py, through `kvpilot validate`, `render` and
`slo rules`: one clear error (or the right answer), no traceback, within 2 CPU-seconds and
200 MB of its own, each measured by the kernel in a forked child (tests/fuzz/harness.py)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fuzz.documents import CASES

ROOT = Path(__file__).resolve().parents[3]
CPU_BOUND_S = 2.0
MEMORY_BOUND_MB = 200.0
COMMANDS = {
    "validate": ["validate", "-f", "{input}"],
    "render": ["render", "-f", "{input}"],
    "slo-rules": ["slo", "rules", "-f", "{input}"],
}


@pytest.fixture(scope="module")
def results() -> dict[tuple[str, str], dict]:
    jobs = [
        {"id": f"{command}/{case.id}", "argv": argv, "input": base64.b64encode(case.data).decode()}
        for case in CASES for command, argv in COMMANDS.items() if command in case.commands
    ]
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.harness"], input=json.dumps(jobs),
                          capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[tuple[str, str], dict] = {}
    for line in proc.stdout.splitlines():
        result = json.loads(line)
        command, _, case_id = result["id"].partition("/")
        out[(command, case_id)] = result
    assert len(out) == len(jobs)
    return out


def test_the_harness_measures_cpu_and_memory() -> None:
    """A child that allocates 300 MB and spins for 0.5 CPU-seconds is seen doing both."""
    from tests.fuzz.harness import SELF_TEST

    job = {"id": "self-test", "argv": [SELF_TEST, "300", "0.5"], "input": ""}
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.harness"], input=json.dumps([job]),
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(proc.stdout)
    assert result["returncode"] == 0
    assert 290 <= result["peak_rss_mb"] <= 400
    assert result["cpu_s"] >= 0.5


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("case", "command"),
    [(c, command) for c in CASES for command in COMMANDS if command in c.commands],
    ids=[f"{c.id}-{command}" for c in CASES for command in COMMANDS if command in c.commands],
)
def test_case(case, command: str, results) -> None:
    r = results[(command, case.id)]
    text = r["stdout"] + r["stderr"]
    assert "Traceback" not in text, text[-2000:]
    assert "internal error" not in text, text[-2000:]
    assert r["cpu_s"] <= CPU_BOUND_S, f"{r['cpu_s']} CPU-seconds"
    assert r["peak_rss_mb"] <= MEMORY_BOUND_MB, f"{r['peak_rss_mb']} MB"
    if case.expect == "valid":
        assert r["returncode"] == 0, text[-2000:]
        return
    assert r["returncode"] in (1, 2), (r["returncode"], text[-2000:])
    problems = r["stderr"] if command != "validate" else r["stdout"]
    expected = (case.expect,) if isinstance(case.expect, str) else case.expect
    assert any(e in problems for e in expected), problems[-2000:]
    # One line per problem, each short: no value is echoed whole.
    longest = max((len(line) for line in problems.splitlines()), default=0)
    assert longest <= 600, f"a {longest}-character line"


def test_slo_rules_streams_its_output_a_service_at_a_time() -> None:
    """The rules of a thousand services are 20 MB of YAML; `slo rules` writes each service's as it is made,
    so its memory is that of one service's rules, not of them all (it was 120 MB, and 3 GB for 29,501)."""
    from tests.fuzz.documents import _many_docs

    job = {"id": "slo-rules/thousand", "argv": COMMANDS["slo-rules"], "input": base64.b64encode(_many_docs(1000)).decode()}
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.harness"], input=json.dumps([job]),
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    result = json.loads(proc.stdout)
    assert result["returncode"] == 0, result["stderr"]
    assert result["stdout_len"] > 20_000_000
    assert result["peak_rss_mb"] <= 50, f"{result['peak_rss_mb']} MB"
