"""`predict` (kvpilot.twin.admission), spec.resources.gpuType's GPU names, and `kvpilot validate --predict`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest

from kvpilot.api.models import InferenceService
from kvpilot.cli import main
from kvpilot.twin.accuracy import MEMORY_PLAN
from kvpilot.twin.admission import AVERAGE_SEQUENCE_TOKENS, HIGH_UTILIZATION, predict
from kvpilot.twin.engine import Engine, EngineConfig
from kvpilot.twin.hardware import GPU_PRESETS, product_label, resolve_gpu
from kvpilot.twin.models import MODEL_PRESETS, resolve_model
from kvpilot.twin.workload import SHAREGPT_OUTPUT, SHAREGPT_PROMPT

ROOT = Path(__file__).resolve().parents[3]
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
TINY_CONFIG = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
               "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
               "torch_dtype": "bfloat16"}


def service(model: str = LLAMA_8B, *, gpu_type: str | None = "NVIDIA-H100-80GB-HBM3", **spec: Any) -> InferenceService:
    body: dict[str, Any] = {"model": model, **spec}
    resources = dict(body.pop("resources", {}))
    if gpu_type is not None:
        resources["gpuType"] = gpu_type
    body["resources"] = resources
    return InferenceService.model_validate({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                                            "metadata": {"name": "svc"}, "spec": body})


# ---- spec.resources.gpuType ------------------------------------------------------------------------------

@pytest.mark.parametrize(("label", "twin"), [
    ("NVIDIA-H100-80GB-HBM3", "H100-80GB"),
    ("NVIDIA-A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA-H200", "H200"),
    ("NVIDIA-L40S", "L40S"),
    ("NVIDIA-L4", "L4"),
    ("NVIDIA-A10G", "A10G"),
])
def test_nvidia_product_labels_name_the_twins_gpus_and_back(label: str, twin: str) -> None:
    assert resolve_gpu(label).name == twin
    assert GPU_PRESETS[twin].product_label == label
    assert product_label(twin) == label
    assert product_label(label) == label


def test_every_twin_gpu_has_a_product_label_that_is_a_label_value() -> None:
    for gpu in GPU_PRESETS.values():
        assert service(gpu_type=gpu.product_label).spec.resources.gpu_type == gpu.product_label


@pytest.mark.parametrize("value", ["NVIDIA-B200", "NVIDIA-A100-SXM4-40GB", "AMD-Instinct-MI300X"])
def test_gpus_the_twin_does_not_model_are_allowed_and_selected_on_as_written(value: str) -> None:
    assert service(gpu_type=value).spec.resources.gpu_type == value
    assert product_label(value) == value


@pytest.mark.parametrize("value", ["", "-H100", "H100 80GB", "x" * 64, "NVIDIA/H100"])
def test_gpu_type_must_be_a_label_value(value: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        service(gpu_type=value)
    assert "gpuType" in str(info.value)


# ---- the prediction ---------------------------------------------------------------------------------------

def test_a_known_service_gets_the_twin_engines_own_memory_plan() -> None:
    p = predict(service(engine={"maxModelLen": 8192, "maxNumBatchedTokens": 8192, "maxNumSeqs": 512}))
    assert p.missing == () and p.failure is None and p.plan is not None
    engine = Engine(EngineConfig.resolve(resolve_model(LLAMA_8B), resolve_gpu("H100-80GB"), max_num_batched_tokens=8192,
                                         max_num_seqs=512, max_model_len=8192, gpu_memory_utilization=0.92))
    assert p.plan == engine.memory
    assert p.kv_cache_tokens == engine.num_gpu_blocks * 16
    assert p.weights_per_gpu_gib == pytest.approx(engine.memory.weights_bytes / 2**30)
    assert p.max_concurrency == pytest.approx(p.kv_cache_tokens / 8192)
    d = p.as_dict()
    assert d["kvCacheTokens"] == p.kv_cache_tokens and d["maxModelLen"] == 8192 and d["gpu"] == "H100-80GB"


def test_unset_fields_resolve_as_vllm_does_on_that_gpu() -> None:
    # maxModelLen unset: the model's own; gpuMemoryUtilization unset: vLLM's default.
    p = predict(service(gpu_type="NVIDIA-L40S"))
    assert p.config is not None
    assert p.config.max_model_len == resolve_model(LLAMA_8B).max_position_embeddings
    assert p.config.gpu_memory_utilization == 0.92


def test_a_predicted_failure_is_vllms_start_up_error() -> None:
    p = predict(service("meta-llama/Llama-3.1-70B-Instruct"))
    assert p.refused and p.plan is None
    assert p.failure is not None and p.failure.startswith("CUDA out of memory while loading the model weights")
    p = predict(service(engine={"tensorParallelSize": 3}, resources={"gpus": 3}))
    assert p.failure == "Total number of attention heads (32) must be divisible by tensor parallel size (3)."


def test_engine_kind_twin_is_predicted_on_the_gpu_it_simulates() -> None:
    p = predict(service(gpu_type=None, engine={"kind": "twin", "twin": {"gpu": "L4"}, "maxModelLen": 4096}))
    assert p.missing == () and p.gpu == "L4"


def test_missing_gpu_type_says_so_and_predicts_nothing() -> None:
    p = predict(service(gpu_type=None))
    assert p.plan is None and p.failure is None and not p.refused
    assert len(p.missing) == 1 and "spec.resources.gpuType is not set" in p.missing[0]
    assert "NVIDIA-H100-80GB-HBM3" in p.missing[0]


def test_unknown_gpu_type_says_so() -> None:
    p = predict(service(gpu_type="NVIDIA-B200"))
    assert p.plan is None and p.failure is None
    assert p.missing == ("GPU: spec.resources.gpuType 'NVIDIA-B200' is not a GPU the twin models (it models "
                         + ", ".join(f"{g.name} ({g.product_label})" for g in GPU_PRESETS.values()) + ")",)


def test_unknown_model_and_gpu_are_both_listed() -> None:
    p = predict(service("acme/secret-model", gpu_type="NVIDIA-B200"))
    assert [m.split(":")[0] for m in p.missing] == ["model", "GPU"]
    assert "'acme/secret-model' is not a twin preset" in p.missing[0]
    assert all(name in p.missing[0] for name in MODEL_PRESETS)


def test_a_config_json_sizes_a_model_without_a_preset() -> None:
    svc = service("acme/tiny", engine={"maxModelLen": 2048}, gpu_type="NVIDIA-L4")
    assert "not a twin preset" in predict(svc).missing[0]
    for given in (TINY_CONFIG, json.dumps(TINY_CONFIG)):
        p = predict(svc, model_config=given)
        assert p.missing == () and p.plan is not None and p.model == "acme/tiny"


def test_a_model_config_map_not_supplied_is_named() -> None:
    svc = service("acme/tiny", modelConfig={"configMapRef": {"name": "tiny", "key": "cfg.json"}})
    p = predict(svc)
    assert p.missing == ("model: spec.modelConfig names ConfigMap 'tiny' key 'cfg.json', which was not supplied "
                         "(put the ConfigMap in the same input, or pass --model-config PATH)",)


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (json.dumps({"hidden_size": 8}), "lacks 'num_attention_heads'"),
])
def test_an_unusable_config_json_is_missing_information(text: str, why: str) -> None:
    p = predict(service("acme/tiny"), model_config=text)
    assert len(p.missing) == 1 and why in p.missing[0] and p.missing[0].startswith("model: the config.json")


def test_utilization_above_095_warns_and_095_does_not() -> None:
    assert HIGH_UTILIZATION == 0.95
    high = predict(service(engine={"gpuMemoryUtilization": 0.96, "maxModelLen": 8192}))
    assert high.failure is None
    assert [w.split(":")[0] for w in high.warnings] == ["engine.gpuMemoryUtilization 0.96 is above 0.95"]
    assert predict(service(engine={"gpuMemoryUtilization": 0.95, "maxModelLen": 8192})).warnings == ()
    # A spec-only warning holds even when nothing can be predicted.
    assert predict(service(gpu_type=None, engine={"gpuMemoryUtilization": 0.99})).warnings


def test_a_kv_cache_short_of_max_num_seqs_average_sequences_warns() -> None:
    assert round(SHAREGPT_PROMPT.mean() + SHAREGPT_OUTPUT.mean()) == AVERAGE_SEQUENCE_TOKENS
    engine = {"maxModelLen": 8192, "maxNumSeqs": 2048, "maxNumBatchedTokens": 8192, "gpuMemoryUtilization": 0.5}
    p = predict(service(engine=engine))
    assert p.plan is not None
    fits = p.plan.kv_cache_tokens // AVERAGE_SEQUENCE_TOKENS
    assert fits < 2048
    assert p.warnings == (f"the KV cache holds {p.plan.kv_cache_tokens} tokens: {fits} sequences of "
                          f"{AVERAGE_SEQUENCE_TOKENS} tokens (the average request), fewer than engine.maxNumSeqs 2048; "
                          "vLLM will preempt requests before it runs that many",)
    roomy = predict(service(engine={**engine, "maxNumSeqs": 64, "gpuMemoryUtilization": 0.9}))
    assert roomy.warnings == ()


def test_the_average_is_capped_at_max_model_len() -> None:
    p = predict(service("Qwen2.5-0.5B", gpu_type="L4",
                        engine={"maxModelLen": 128, "maxNumSeqs": 256, "maxNumBatchedTokens": 256,
                                "kvCacheMemoryBytes": 4 << 20}))
    assert p.failure is None and p.plan is not None
    assert any("sequences of 128 tokens" in w for w in p.warnings)


# ---- kvpilot validate --predict --------------------------------------------------------------------------

def _doc(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": spec}


def _write(tmp_path: Path, *docs: dict[str, Any]) -> Path:
    path = tmp_path / "svc.yaml"
    path.write_text("---\n".join(json.dumps(d) + "\n" for d in docs))
    return path


OK = _doc("ok", model=LLAMA_8B, engine={"maxModelLen": 8192}, resources={"gpuType": "NVIDIA-H100-80GB-HBM3"})
TOO_BIG = _doc("too-big", model="meta-llama/Llama-3.1-70B-Instruct", resources={"gpuType": "NVIDIA-L4"})
NO_GPU = _doc("no-gpu", model=LLAMA_8B)


def test_cli_prints_the_figures_and_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--predict", "-f", str(_write(tmp_path, OK))]) == 0
    out = capsys.readouterr().out.splitlines()
    p = predict(service(engine={"maxModelLen": 8192}))
    assert out == [
        f"{tmp_path}/svc.yaml: document 1 (ok): valid",
        f"{tmp_path}/svc.yaml: document 1 (ok): predicted: Llama-3.1-8B on H100-80GB x1: weights "
        f"{p.weights_per_gpu_gib:.2f} GiB/GPU, KV cache {p.kv_cache_tokens} tokens, max concurrency "
        f"{p.max_concurrency:.2f}x at maxModelLen 8192",
        f"{tmp_path}/svc.yaml: document 1 (ok): accuracy: {MEMORY_PLAN.describe(resolve_model('Llama-3.1-8B'))}",
    ]


def test_cli_missing_information_exits_zero_and_a_failure_one(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--predict", "-q", "-f", str(_write(tmp_path, OK, NO_GPU))]) == 0
    out = capsys.readouterr().out
    assert "document 2 (no-gpu): missing: GPU: spec.resources.gpuType is not set" in out
    assert "document 1" not in out  # -q: only what needs attention
    assert main(["validate", "--predict", "-f", str(_write(tmp_path, OK, TOO_BIG))]) == 1
    out = capsys.readouterr().out
    assert ("document 2 (too-big): failure: Llama-3.1-70B on L4 x1: vLLM would refuse to start: "
            "CUDA out of memory while loading the model weights") in out


def test_cli_reads_the_config_map_the_spec_names_from_the_input(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    custom = _doc("custom", model="acme/tiny", modelConfig={"configMapRef": {"name": "tiny"}},
                  engine={"maxModelLen": 2048}, resources={"gpuType": "NVIDIA-L4"})
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tiny"},
                  "data": {"config.json": json.dumps(TINY_CONFIG)}}
    assert main(["validate", "--predict", "-f", str(_write(tmp_path, custom, config_map))]) == 0
    out = capsys.readouterr().out
    assert "document 1 (custom): predicted: acme/tiny on L4 x1" in out
    assert "document 2 (tiny): ConfigMap (read for spec.modelConfig)" in out
    # The wrong key is named, with the keys there are.
    config_map["data"] = {"other.json": "{}"}
    assert main(["validate", "--predict", "-f", str(_write(tmp_path, custom, config_map))]) == 0
    assert "missing: model: ConfigMap 'tiny' has no key 'config.json' (it has: other.json)" in capsys.readouterr().out
    # Without --predict a ConfigMap is still not an InferenceService.
    assert main(["validate", "-f", str(_write(tmp_path, custom, config_map))]) == 1


def test_cli_model_config_file_per_model_or_for_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    custom = _doc("custom", model="acme/tiny", engine={"maxModelLen": 2048}, resources={"gpuType": "L4"})
    path = _write(tmp_path, custom, OK)
    assert main(["validate", "--predict", "--model-config", f"acme/tiny={config}", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(custom): predicted: acme/tiny on L4" in out and "(ok): predicted: Llama-3.1-8B" in out
    assert main(["validate", "--predict", "--model-config", str(tmp_path / "nope.json"), "-f", str(path)]) == 0
    assert "missing: cannot read --model-config" in capsys.readouterr().out


def test_cli_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _doc("bad", model=LLAMA_8B, engine={"maxNumSeqs": 0})
    assert main(["validate", "--predict", "-o", "json", "-f", str(_write(tmp_path, OK, TOO_BIG, bad))]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in reports] == ["ok", "too-big", "bad"]
    assert reports[0]["prediction"]["kvCacheTokens"] > 0 and reports[0]["prediction"]["failure"] is None
    assert reports[1]["prediction"]["failure"].startswith("CUDA out of memory")
    assert reports[2]["valid"] is False and reports[2]["issues"]


def test_cli_model_config_needs_predict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "--model-config", str(tmp_path), "-f", "-"]) == 2
    assert "--model-config needs --predict" in capsys.readouterr().err


def test_cli_as_a_real_process_exits_one_on_a_predicted_failure_with_vllms_words(tmp_path: Path) -> None:
    path = _write(tmp_path, OK, TOO_BIG, NO_GPU)
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "validate", "--predict", "-f", str(path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 1, proc.stderr
    failure = predict(InferenceService.model_validate(TOO_BIG)).failure
    assert failure and f"vLLM would refuse to start: {failure}" in proc.stdout
    assert "(no-gpu): missing: GPU" in proc.stdout and proc.stderr == ""


def test_the_docs_show_the_real_output_of_their_command(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    text = (ROOT / "docs" / "admission.md").read_text()
    command = "$ kvpilot validate --predict -f docs/examples/predict.yaml   # exits 1\n"
    shown = text.split(command, 1)[1].split("```", 1)[0]
    monkeypatch.chdir(ROOT)
    assert main(["validate", "--predict", "-f", "docs/examples/predict.yaml"]) == 1
    assert capsys.readouterr().out == shown
