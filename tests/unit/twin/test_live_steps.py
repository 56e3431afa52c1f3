"""benchmarks/live_steps.py without vLLM: a recorded window's gaps and steps become the figures it prints."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.live_steps import parse_config, report
from kvpilot.api import vllm
from kvpilot.twin.models import resolve_model
from kvpilot.twin.profiles import DeviceProfile
from kvpilot.twin.steptime import StepTimeModel
from tests.support.tiny_device import PROFILE


def test_a_window_is_read_as_prometheus_reads_it_and_its_steps_sorted_by_chunk(capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    profile = DeviceProfile.load(PROFILE)
    sm = StepTimeModel(resolve_model("llama-3.2-1b"), profile.device, params=profile.step_time)
    edges = list(vllm.ITL_BUCKETS)
    counts = [900.0] + [1000.0] * (len(edges) - 1) + [1000.0]  # 90% under 10 ms, the rest under 25
    steps = [(0, 0, 3, 0.004)] * 5 + [(1, 512, 2, 0.020)] * 3 + [(1, 700, 1, 0.030)]
    row = report({"config": "512/4", "edges": edges, "itlCounts": counts, "steps": steps}, sm, 600.0, 32.0)
    assert row["itlP99Read"] == pytest.approx(0.01 + 0.015 * 90 / 100)
    assert {k: v["steps"] for k, v in row["steps"].items()} == {"decode": 5, "chunk 257-512": 3, "chunk > 512": 1}
    assert row["steps"]["chunk 257-512"]["vllmMs"] == pytest.approx(20.0)
    assert row["steps"]["chunk > 512"]["twinMs"] > row["steps"]["chunk 257-512"]["twinMs"] > 0
    assert "p99 as read 23.5 ms" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["512", "512/x", "0/4", "512/4/2"])
def test_a_config_that_is_not_tokens_over_seqs_is_refused_by_name(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=f"config '{text}'"):
        parse_config(text)
    assert parse_config("512/4") == (512, 4)
