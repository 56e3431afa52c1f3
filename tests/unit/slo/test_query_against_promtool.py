"""`kvpilot slo query` accepts a window or a selector only where Prometheus's own parser does.

The oracle is `promtool check rules` (Prometheus's PromQL parser): every window is put into a
range selector and kvpilot's verdict must equal promtool's.  For label names kvpilot is stricter
than the parser (it refuses the reserved `__` names, which no stored series carries), so there the
test holds that whatever kvpilot prints, Prometheus parses.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.prometheus import require_promtool
from kvpilot.cli import main
from kvpilot.slo import promql, yamltext

WINDOWS = [
    "5m", "600s", "1h30m", "1y2w3d4h5m6s7ms", "1ms", "292y", "5m0s", "01m",
    "0s", "0", "0ms", "5m5m", "30m1h", "1.5m", "5M", "5", "m", "", "-5m", "5 m", "300y",
    "99999999999999999999y", "9223372036854775807ms", "106751d", "106752d", "$__range", "$__rate_interval",
]
LABEL_NAMES = ["job", "_x", "a1", "__name__", "__meta_x", "1a", "a-b", "a.b", "ä", ""]


def _parses(exprs: list[str], tmp_path: Path) -> list[bool]:
    """For each expression, whether Prometheus's parser accepts it (one promtool run each)."""
    verdicts = []
    for i, expr in enumerate(exprs):
        path = tmp_path / f"r{i}.yaml"
        path.write_text(yamltext.dump({"groups": [{"name": "g", "rules": [{"record": "r", "expr": expr}]}]}))
        proc = subprocess.run([require_promtool(), "check", "rules", str(path)],
                              capture_output=True, text=True, timeout=60)
        verdicts.append(proc.returncode == 0)
    return verdicts


def _kvpilot_accepts_window(window: str) -> bool:
    try:
        promql.validate_duration(window, grafana=False)
    except ValueError:
        return False
    return True


def test_windows_are_judged_as_prometheus_judges_them(tmp_path: Path) -> None:
    prometheus = _parses([f"rate(x[{w}])" for w in WINDOWS], tmp_path)
    ours = [_kvpilot_accepts_window(w) for w in WINDOWS]
    disagree = [(w, p, o) for w, p, o in zip(WINDOWS, prometheus, ours, strict=True) if p != o]
    assert not disagree, f"(window, prometheus accepts, kvpilot accepts): {disagree}"
    assert prometheus.count(True) >= 8 and prometheus.count(False) >= 10  # both sides exercised


def test_duration_seconds_matches_units() -> None:
    assert promql.duration_seconds("1y2w3d4h5m6s7ms") == 365 * 86400 + 14 * 86400 + 3 * 86400 + 4 * 3600 + 306.007


@pytest.mark.parametrize("window", [w for w in WINDOWS if not _kvpilot_accepts_window(w)])
def test_query_refuses_bad_windows_with_one_line(window: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "query", "--selector", "job=twin", f"--window={window}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: window") and err.count("\n") == 1


def test_whatever_query_prints_prometheus_parses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    accepted = [n for n in LABEL_NAMES if _matcher_ok(n)]
    assert accepted == ["job", "_x", "a1"]
    exprs: list[str] = []
    for name in accepted:
        for window in ("1ms", "292y", "1h30m"):
            assert main(["slo", "query", "--selector", f"{name}=v\"\\{{}}", "--window", window, "-o", "json"]) == 0
            exprs += json.loads(capsys.readouterr().out).values()
    assert all(_parses(exprs[:: max(1, len(exprs) // 12)], tmp_path))


def _matcher_ok(name: str) -> bool:
    try:
        promql.Matcher(name, "v")
    except ValueError:
        return False
    return True


def test_refused_label_names_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slo", "query", "--selector", "__name__=x"]) == 2
    assert "metric name" in capsys.readouterr().err
    assert main(["slo", "query", "--selector", "__meta_pod=x"]) == 2
    assert "reserves" in capsys.readouterr().err
