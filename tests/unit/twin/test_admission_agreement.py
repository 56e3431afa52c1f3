"""Issue 18's done-when check: `predict` refuses exactly the configs the twin's start-up refuses, with the
same words, and refuses none that it starts.

The twin's side is its real start-up entry, not the prediction: the operator renders an engine.kind twin
pod's command line for the service (`kvpilot twin serve ...`, builders.engine.engine_args), the real
`kvpilot` parser reads it, `engine_config_from_args` resolves it (naming the model and the GPU itself) and
`Engine(config)` starts the engine, which is what `serve_command` does before it opens its port.  A few of
the refused configs also run as a real `kvpilot twin serve` process, whose stderr must carry the message,
and one predicted to start runs until healthy, reporting the predicted block count.

The prediction's side is the same service as engine.kind vllm on spec.resources.gpuType (the product label,
or the twin's name for the GPU), so the gpuType mapping is checked too.  Combinations are drawn seeded
over model (18 presets, and a tenth as a config.json of a preset's shapes, the ConfigMap path), GPU (6),
tensorParallelSize, maxModelLen, gpuMemoryUtilization (or kvCacheMemoryBytes), maxNumBatchedTokens,
maxNumSeqs, blockSize and kvCacheDtype; the draws the API itself refuses are drawn again.
`benchmarks/admission_agreement.py` prints how many were drawn and refused and how long it took.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.admission_agreement import SEED, Case, agreement, cases, hf_config
from kvpilot.operator.builders.engine import MODEL_CONFIG_PATH, engine_args
from kvpilot.twin.admission import predict
from kvpilot.twin.models import MODEL_PRESETS


def test_predict_refuses_exactly_what_the_twin_refuses_with_the_same_words(tmp_path: Path) -> None:
    all_cases, _invalid = cases()
    assert len(all_cases) >= 2000
    counts = agreement(all_cases, tmp_path)
    assert counts["started"] + counts["refused"] == len(all_cases)
    # The set is useful only if it exercises both sides and every way of refusing.
    assert counts["started"] > 200 and counts["refused"] > 200, counts
    kinds = {k for k in counts if k.startswith("refused: ")}
    for wording in ("CUDA out of memory while loading the model weights", "No available memory for the cache blocks",
                    "The model's max seq len", "User-specified max_model_len", "Total number of attention heads",
                    "Free memory on device cuda:0"):
        assert any(k.startswith("refused: " + wording[:40]) for k in kinds), (wording, sorted(kinds))


def test_the_real_twin_serve_process_prints_the_predicted_failure(tmp_path: Path) -> None:
    """One case per kind of refusal, through a real `kvpilot twin serve` process: it exits 1 at start-up
    and its vLLM-worded error line is the prediction's failure."""
    all_cases, _ = cases(400, seed=SEED + 1)
    picked: dict[str, Case] = {}
    for case in all_cases:
        if case.config is not None:
            continue
        failure = predict(case.service("vllm")).failure
        if failure is not None:
            picked.setdefault(failure.split(" (")[0][:30], case)
        if len(picked) >= 4:
            break
    assert len(picked) >= 4
    for case in picked.values():
        failure = predict(case.service("vllm")).failure
        argv = [a if a != "0.0.0.0" else "127.0.0.1" for a in engine_args(case.service("twin"))]
        argv[argv.index("--port") + 1] = "0"
        proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "twin", "serve", *argv],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert f"ValueError: {failure}" in proc.stderr


if __name__ == "__main__":  # pragma: no cover - benchmarks/admission_agreement.py is the printing entry
    pytest.main([__file__, "-q"])


def test_a_real_twin_pod_command_starts_with_the_predicted_kv_cache(tmp_path: Path) -> None:
    """A config predicted to start, a model from a config.json (the pod's mounted ConfigMap): the real
    `kvpilot twin serve` process gets healthy and reports the predicted block count in vllm:cache_config_info."""
    import re
    import urllib.request

    from harness.twin_process import twin_server

    config = hf_config(MODEL_PRESETS["Qwen2.5-0.5B"])
    case = Case("acme/small-chat", config, "L4", "NVIDIA-L4",
                {"maxModelLen": 4096, "maxNumBatchedTokens": 2048, "maxNumSeqs": 64, "gpuMemoryUtilization": 0.8})
    p = predict(case.service("vllm"), model_config=json.dumps(config))
    assert p.failure is None and p.plan is not None
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = engine_args(case.service("twin"))
    for flag in ("--port", "--host"):  # the harness picks a free port on 127.0.0.1
        i = argv.index(flag)
        del argv[i:i + 2]
    argv = [str(path) if a == MODEL_CONFIG_PATH else a for a in argv]
    with twin_server(*argv, log_dir=tmp_path) as twin, urllib.request.urlopen(twin.metrics_url, timeout=10) as resp:
        metrics = resp.read().decode()
    m = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', metrics, flags=re.M)
    assert m is not None, metrics[:2000]
    assert int(m.group(1)) == p.plan.num_gpu_blocks
