"""Live path: an engine process that cannot start for lack of memory is told to the study graded by its
shortfall, read from its own log (a real `kvpilot twin serve` process, which fails with vLLM V1's wording:
the root cause in the engine core's lines, then "Engine core initialization failed")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvpilot.tuner.adapters.local import LocalApplier, free_port
from kvpilot.tuner.core.loop import ApplyFailed
from kvpilot.tuner.core.objective import INFEASIBLE_VIOLATION, Goal, infeasible
from kvpilot.tuner.core.space import EngineParams

REPO = Path(__file__).resolve().parents[3]
# Llama-3.1-70B at TP 2 on H100s: below gpuMemoryUtilization ~0.9 it cannot start.
TWIN_70B = [sys.executable, "-m", "kvpilot.cli", "twin", "serve", "--model", "Llama-3.1-70B", "--gpu", "H100-80GB",
            "--tensor-parallel-size", "2", "--max-model-len", "8192"]


def _startup_failure(params: EngineParams, tmp_path: Path) -> ApplyFailed:
    tmp_path.mkdir()
    applier = LocalApplier(TWIN_70B, port=free_port(), start=params, startup_timeout_s=60, shutdown_timeout_s=5,
                           log_dir=str(tmp_path),
                           env={"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        with pytest.raises(ApplyFailed) as err:
            applier.apply(params, trial=1)
    finally:
        applier.stop()
    return err.value


@pytest.mark.integration
def test_a_live_startup_failure_is_graded_by_its_memory_shortfall(tmp_path: Path) -> None:
    near = _startup_failure(EngineParams(512, 0.86, 64), tmp_path / "near")  # KV cache short of one sequence
    far = _startup_failure(EngineParams(8192, 0.75, 64), tmp_path / "far")  # no KV cache at all
    assert near.reason == far.reason == "OutOfMemory"
    assert "KV cache is needed" in near.message, near.message  # the root cause, not the last line
    v_near = infeasible(Goal.LATENCY, near.reason, near.message).constraints[0]
    v_far = infeasible(Goal.LATENCY, far.reason, far.message).constraints[0]
    assert 0 < v_near < v_far < INFEASIBLE_VIOLATION
