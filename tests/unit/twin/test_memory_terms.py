"""The memory plan's start-up terms: the sampler warm-up, tensor-parallel memory held before the
free-memory check, the CUDA-graph estimate in the budget, which vLLM release uses which, and the
dataset they were fitted on."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvpilot.api import vllm
from kvpilot.tuner.adapters.offline import StartupFailed
from kvpilot.tuner.core.startup import memory_report, read_memory_failure
from kvpilot.twin.hardware import GiB, resolve_gpu
from kvpilot.twin.memory import (
    DEFAULT_PROFILE,
    FITTED_PROFILE,
    FLASHINFER_SAMPLER_FP32_COPIES,
    SAMPLER_FP32_COPIES,
    V1_TRITON_SAMPLER_FP32_COPIES,
    V2_SAMPLER_FP32_COPIES,
    EngineStartupError,
    MemoryProfile,
    activation_peak_bytes,
    forward_peak_bytes,
    parse_version,
    plan_memory,
    profile_for_vllm,
    runs_model_runner_v2,
    sampler_peak_bytes,
)
from kvpilot.twin.models import resolve_model

ROOT = Path(__file__).resolve().parents[3]
H100 = resolve_gpu("H100-80GB")
LLAMA8, QWEN8 = resolve_model("Llama-3.1-8B"), resolve_model("Qwen3-8B")
KW = dict(max_model_len=8192, block_size=16)
V1 = profile_for_vllm((0, 11, 0))  # model runner V1, vLLM's PyTorch top-k/top-p sampler


def _benchmark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("twin_memory", ROOT / "benchmarks" / "twin_memory.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["twin_memory"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def test_sampler_warmup_grows_with_vocabulary_and_sequences_not_with_tensor_parallelism() -> None:
    # Model runner V1: 1024 sequences (vLLM's default on an H100) of 151936-entry fp32 logits outweigh
    # an 8192-token forward pass of Qwen3-8B; the logits are gathered whole on every rank, so TP 2 keeps them.
    copies = V1.sampler_fp32_copies
    tp1 = activation_peak_bytes(QWEN8, 1, 8192, 1024, copies)
    assert tp1 == sampler_peak_bytes(QWEN8, 8192, 1024, copies) > forward_peak_bytes(QWEN8, 1, 8192)
    assert activation_peak_bytes(QWEN8, 2, 8192, 1024, copies) == tp1
    assert sampler_peak_bytes(QWEN8, 8192, 1024) / sampler_peak_bytes(LLAMA8, 8192, 1024) == pytest.approx(
        151936 / 128256, rel=1e-6)
    assert sampler_peak_bytes(QWEN8, 8192, 512) == pytest.approx(sampler_peak_bytes(QWEN8, 8192, 1024) / 2, rel=1e-6)
    # Only min(sequences, tokens) rows are sampled; with few sequences the forward pass is the peak.
    assert sampler_peak_bytes(QWEN8, 64, 1024) == sampler_peak_bytes(QWEN8, 64, 64)
    assert activation_peak_bytes(QWEN8, 1, 16384, 16, copies) == forward_peak_bytes(QWEN8, 1, 16384)


def test_more_sequences_leave_a_large_vocabulary_model_fewer_blocks_where_the_sampler_sorts() -> None:
    kw = dict(tensor_parallel_size=1, max_num_batched_tokens=8192, **KW)
    few = plan_memory(QWEN8, H100, max_num_seqs=256, profile=V1, **kw)
    many = plan_memory(QWEN8, H100, max_num_seqs=1024, profile=V1, **kw)
    assert few.kv_cache_bytes - many.kv_cache_bytes == many.activation_peak_bytes - few.activation_peak_bytes > 3 * GiB
    # Model runner V2 (the twin's vLLM) warms up without the sort: the sequence cap costs little.
    few = plan_memory(QWEN8, H100, max_num_seqs=256, **kw)
    many = plan_memory(QWEN8, H100, max_num_seqs=1024, **kw)
    assert 0 <= few.kv_cache_bytes - many.kv_cache_bytes < 0.1 * GiB
    assert few.activation_peak_bytes == forward_peak_bytes(QWEN8, 1, 8192)


def test_each_vllm_release_gets_its_own_sampler_warm_up_and_graph_term() -> None:
    assert parse_version("0.33.0") == (0, 33, 0) and parse_version("v0.28.1rc1") == (0, 28, 1)
    assert parse_version("0.10.1.1") == (0, 10, 1, 1)
    with pytest.raises(ValueError):
        parse_version("latest")
    old = profile_for_vllm((0, 11, 0), "Qwen3-8B")
    assert (old.sampler_fp32_copies, old.cuda_graph_in_budget) == (SAMPLER_FP32_COPIES, False)
    assert profile_for_vllm((0, 10, 1, 1), "Qwen2.5-7B", flashinfer_sampler=True).sampler_fp32_copies == \
        FLASHINFER_SAMPLER_FP32_COPIES
    assert profile_for_vllm((0, 21, 0), "Qwen3-8B").cuda_graph_in_budget
    # Model runner V1 stopped sorting the vocabulary in 0.17 (Triton top-k/top-p): a smaller warm-up,
    # until V2 takes the model over; FlashInfer, where a log says it samples, keeps its own term.
    assert profile_for_vllm((0, 16, 0), "Qwen3-8B").sampler_fp32_copies == SAMPLER_FP32_COPIES
    assert profile_for_vllm((0, 19, 1), "Qwen3-8B").sampler_fp32_copies == V1_TRITON_SAMPLER_FP32_COPIES
    assert profile_for_vllm((0, 24, 0), "Qwen2.5-7B").sampler_fp32_copies == V1_TRITON_SAMPLER_FP32_COPIES
    assert profile_for_vllm((0, 19, 1), "Qwen3-8B", flashinfer_sampler=True).sampler_fp32_copies == \
        FLASHINFER_SAMPLER_FP32_COPIES
    # Model runner V2 took over dense models family by family: Qwen3 in 0.22, Llama and Mistral in
    # 0.23, every dense model in 0.25; V2 warms up without top-k/top-p, FlashInfer or not.
    assert runs_model_runner_v2((0, 22, 0), "Qwen/Qwen3-8B") and not runs_model_runner_v2((0, 22, 0), "Llama-3.1-8B")
    assert runs_model_runner_v2((0, 23, 0), "Llama-3.1-8B") and runs_model_runner_v2((0, 23, 0), "Mistral-7B")
    assert not runs_model_runner_v2((0, 24, 0), "Qwen2.5-7B") and runs_model_runner_v2((0, 25, 0), "Qwen2.5-7B")
    assert profile_for_vllm((0, 31, 0), "Qwen2.5-7B", flashinfer_sampler=True).sampler_fp32_copies == \
        V2_SAMPLER_FP32_COPIES
    # The twin's default is the release it stands for, with the fitted constants.
    twin_release = profile_for_vllm(parse_version(vllm.VLLM_VERSION))
    assert twin_release == DEFAULT_PROFILE
    assert twin_release == dataclasses.replace(FITTED_PROFILE, sampler_fp32_copies=V2_SAMPLER_FP32_COPIES)


def test_tensor_parallel_memory_held_at_start_up_counts_against_free_memory() -> None:
    # 0.985 of an H100 fits beside the CUDA context at TP 1, not once NCCL and custom all-reduce
    # buffers hold their share of the GPU before vLLM checks free memory.
    kw = dict(max_num_batched_tokens=2048, max_num_seqs=256, gpu_memory_utilization=0.985, **KW)
    plan_memory(LLAMA8, H100, tensor_parallel_size=1, **kw)
    with pytest.raises(EngineStartupError, match=r"Free memory on device cuda:0 \((\d+\.\d+)/79\.19 GiB\)") as err:
        plan_memory(LLAMA8, H100, tensor_parallel_size=2, **kw)
    free = float(err.value.args[0].split("(")[1].split("/")[0])
    expected = (H100.total_memory_bytes - H100.cuda_context_bytes - DEFAULT_PROFILE.tp_startup_bytes) / GiB
    assert free == pytest.approx(expected, abs=0.005)
    # The held memory is outside the budget: it does not shrink the KV cache of a config that starts.
    ok = dict(kw, gpu_memory_utilization=0.9)
    held = plan_memory(LLAMA8, H100, tensor_parallel_size=2, **ok)
    none = plan_memory(LLAMA8, H100, tensor_parallel_size=2, profile=dataclasses.replace(
        DEFAULT_PROFILE, tp_startup_bytes=0), **ok)
    assert held.kv_cache_bytes == none.kv_cache_bytes
    assert held.non_torch_bytes == DEFAULT_PROFILE.non_torch_bytes + DEFAULT_PROFILE.tp_non_torch_bytes


def test_cuda_graph_estimate_comes_out_of_the_budget_only_where_vllm_takes_it() -> None:
    kw = dict(tensor_parallel_size=1, max_num_batched_tokens=2048, max_num_seqs=256, **KW)
    now = plan_memory(QWEN8, H100, **kw)
    before = plan_memory(QWEN8, H100, profile=dataclasses.replace(DEFAULT_PROFILE, cuda_graph_in_budget=False), **kw)
    assert now.cuda_graph_bytes == 36 * DEFAULT_PROFILE.cuda_graph_bytes_per_layer > 0
    assert before.cuda_graph_bytes == 0
    assert before.kv_cache_bytes - now.kv_cache_bytes == now.cuda_graph_bytes
    assert now.as_dict()["cuda_graph_gib"] == round(now.cuda_graph_bytes / GiB, 3)


def test_no_cache_message_still_gives_the_tuner_every_fixed_term() -> None:
    # The tuner reads "fixed" memory (weights + non-torch) from the message; the graph estimate,
    # which does not grow with the token budget either, must be inside it.
    profile = MemoryProfile(cuda_graph_bytes_per_layer=int(0.1 * GiB))
    with pytest.raises(EngineStartupError, match="No available memory for the cache blocks") as err:
        plan_memory(LLAMA8, H100, tensor_parallel_size=1, max_num_batched_tokens=2048, max_num_seqs=256,
                    gpu_memory_utilization=0.2, profile=profile, **KW)
    graphs = 32 * profile.cuda_graph_bytes_per_layer
    from kvpilot.twin.memory import weight_bytes_per_rank
    fixed = weight_bytes_per_rank(LLAMA8, 1) + profile.non_torch_bytes + graphs
    # Both ways the tuner gets them: the numbers the twin raises, and vLLM's words in the message.
    for report in (StartupFailed.of(err.value).memory, memory_report(str(err.value))):
        failure = read_memory_failure(2048, 0.2, 256, report)
        assert failure is not None and failure.fixed is not None
        assert failure.fixed == pytest.approx(fixed, abs=0.02 * GiB)


def test_dataset_parses_and_every_row_has_its_source() -> None:
    twin_memory = _benchmark()
    logs = twin_memory.load_logs()
    assert len(logs) >= 8
    assert all(log.source_url.startswith("https://github.com/") for log in logs)
    assert {log.split for log in logs} == {"train", "test"}
    assert sum(1 for log in logs if log.plannable and log.split == "test") >= 4
    assert all(not log.plannable and log.unplannable_reason == log.excluded for log in logs if log.excluded)
    for raw in map(json.loads, (ROOT / "benchmarks" / "data" / "vllm_startup_logs.jsonl").read_text().splitlines()):
        assert raw["logged"], raw["id"]


def test_defaults_are_the_constants_fitted_on_the_training_logs() -> None:
    twin_memory = _benchmark()
    fit = twin_memory.fit(twin_memory.load_logs())
    fitted = fit.profile
    for field in ("non_torch_bytes", "tp_non_torch_bytes", "tp_startup_bytes", "cuda_graph_bytes_per_layer"):
        assert getattr(FITTED_PROFILE, field) == pytest.approx(getattr(fitted, field), abs=0.01 * GiB), field
    assert FITTED_PROFILE.sampler_fp32_copies == pytest.approx(fitted.sampler_fp32_copies, abs=0.05)
    assert fit.flashinfer_sampler_fp32_copies == pytest.approx(FLASHINFER_SAMPLER_FP32_COPIES, abs=0.05)


def test_a_gpu_without_a_preset_is_sized_from_its_logged_total() -> None:
    twin_memory = _benchmark()
    row = json.loads((ROOT / "benchmarks" / "data" / "vllm_startup_logs.jsonl").read_text().splitlines()[0])
    log = twin_memory.parse_row({**row, "gpu": "A100-SXM4-40GB", "gpu_total_gib": 39.39}, 1)
    assert log.gpu_spec is not None and log.gpu_spec.total_memory_bytes == int(39.39 * GiB)
    with pytest.raises(twin_memory.DatasetError, match="unknown GPU"):
        twin_memory.parse_row({**row, "gpu": "A100-SXM4-40GB", "gpu_total_gib": None}, 1)


@pytest.mark.parametrize(("change", "match"), [
    ({"source_url": "see the issue"}, "source_url must be an https://"),
    ({"split": "validation"}, "split must be 'train' or 'test'"),
    ({"tp": 0}, "tp must be a positive integer"),
    ({"logged": {"kv_cache_gib": "51"}}, "logged.kv_cache_gib must be a number"),
    ({"logged": {"kv_gib": 51.0}}, "logged has unknown figures"),
    ({"model": "Llama-9-9B"}, "unknown model"),
])
def test_a_bad_row_is_refused_naming_the_field(change: dict, match: str) -> None:
    twin_memory = _benchmark()
    row = json.loads((ROOT / "benchmarks" / "data" / "vllm_startup_logs.jsonl").read_text().splitlines()[0])
    with pytest.raises(twin_memory.DatasetError, match=match):
        twin_memory.parse_row({**row, **change}, 1)
