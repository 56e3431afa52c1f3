"""The generated rules pass `promtool check rules`, and the checked-in promtool rule tests
(tests/promtool/, from tests/promtool/generate.py) are current and pass `promtool test rules`.

The 1h/5m page file (with the KV, preemption and absent alerts, and the hostile-name file)
runs here; the 6h and ticket files evaluate days of synthetic series and run as integration
tests (tests/integration/slo/test_promtool_long_windows.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.prometheus import require_promtool
from kvpilot.slo import yamltext
from kvpilot.slo.objectives import SloTarget
from kvpilot.slo.rules import rule_file_for
from tests.promtool import generate

PROMTOOL_DIR = Path(generate.__file__).parent


def _promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_promtool(), *map(str, args)], capture_output=True, text=True, timeout=240, cwd=cwd)


def test_checked_in_files_match_the_generator() -> None:
    built = generate.build_all()
    on_disk = {p.name for p in PROMTOOL_DIR.glob("*.yaml")}
    assert on_disk == set(built), "run: python -m tests.promtool.generate"
    for name, text in built.items():
        assert (PROMTOOL_DIR / name).read_text() == text, f"{name} is stale; run: python -m tests.promtool.generate"


@pytest.mark.parametrize(
    "target",
    [
        generate.PLAIN,
        generate.HOSTILE,
        SloTarget(namespace="a", name="b", ttft_seconds=2560.0, itl_seconds=0.01, objective=0.9999, period="4w", replicas=0),
    ],
    ids=["plain", "hostile", "edges"],
)
def test_promtool_check_rules_accepts_generated_rules(tmp_path: Path, target: SloTarget) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yamltext.dump(rule_file_for(target)))
    result = _promtool("check", "rules", path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("name", ["slo.page-1h.test.yaml", "hostile.page-1h.test.yaml"])
def test_promtool_rule_tests_page_1h(name: str) -> None:
    result = _promtool("test", "rules", name, cwd=PROMTOOL_DIR)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_a_broken_expectation_fails(tmp_path: Path) -> None:
    """The promtool tests can fail: flip one expected alert set and promtool must say FAILED."""
    import yaml

    doc = yaml.safe_load((PROMTOOL_DIR / "slo.page-1h.test.yaml").read_text())
    first = doc["tests"][0]  # "fires at 1.05x threshold": expects alerts
    assert first["alert_rule_test"][0]["exp_alerts"]
    first["alert_rule_test"][0]["exp_alerts"] = []
    doc["tests"] = [first]
    doc["rule_files"] = [str(PROMTOOL_DIR / "slo.rules.yaml")]
    path = tmp_path / "broken.test.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = _promtool("test", "rules", path)
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr
