"""The `vllm serve` flags the twin accepts."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.twin.flags import add_engine_arguments, engine_config_from_args, human_int


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="twin")
    add_engine_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize(("text", "value"), [("123", 123), ("4k", 4000), ("4K", 4096), ("32k", 32000),
                                              ("20Gi", 20 * 2**30), ("1g", 10**9), ("1.5k", 1500)])
def test_human_readable_integers_as_vllm_reads_them(text: str, value: int) -> None:
    assert human_int(text) == value


def test_the_flags_the_operator_renders() -> None:
    args = parse(["meta-llama/Llama-3.1-70B-Instruct", "--served-model-name", "chat", "--max-num-batched-tokens",
                  "4096", "--gpu-memory-utilization", "0.88", "--max-num-seqs", "128", "--max-model-len", "16384",
                  "-tp", "4", "--block-size", "32", "--kv-cache-dtype", "fp8", "--long-prefill-token-threshold",
                  "1024", "--enable-prefix-caching", "--shutdown-timeout", "30", "--seed", "7", "--gpu", "h200",
                  "--enable-chunked-prefill", "--disable-log-requests", "--uvicorn-log-level", "warning"])
    cfg = engine_config_from_args(args)
    assert (cfg.model.name, cfg.gpu.name, cfg.served_model_name) == ("Llama-3.1-70B", "H200", "chat")
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len) == (4096, 128, 16384)
    assert (cfg.tensor_parallel_size, cfg.block_size, cfg.kv_cache_dtype) == (4, 32, "fp8")
    assert cfg.gpu_memory_utilization == 0.88 and cfg.long_prefill_token_threshold == 1024 and cfg.seed == 7
    assert args.shutdown_timeout == 30


def test_model_flag_and_gpu_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPILOT_TWIN_GPU", "L40S")
    cfg = engine_config_from_args(parse(["--model", "Qwen/Qwen2.5-7B-Instruct", "--max-model-len", "8k"]))
    assert cfg.model.name == "Qwen2.5-7B" and cfg.gpu.name == "L40S" and cfg.max_model_len == 8000
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (2048, 256)  # vLLM's small-GPU defaults


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["m", "--gpu-memory-utilization", "1.5"], "outside (0, 1]"),
        (["m", "--max-num-seqs", "0"], "must be >= 1"),
        (["m", "--max-model-len", "lots"], "not a whole number"),
        (["m", "--block-size", "7"], "invalid choice"),
        (["m", "--max-long-partial-prefills", "1"], "removed in vLLM 0.33"),
        (["m", "-pp", "2"], "one pipeline stage"),
        (["m", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_flags_are_argparse_errors_naming_the_flag(argv: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_long_prefill_token_threshold_adaptive_is_a_vllm_switch() -> None:
    assert engine_config_from_args(parse(["Qwen2.5-0.5B"])).long_prefill_token_threshold_adaptive is False
    cfg = engine_config_from_args(parse(["Qwen2.5-0.5B", "--long-prefill-token-threshold", "512",
                                         "--long-prefill-token-threshold-adaptive"]))
    assert cfg.long_prefill_token_threshold == 512 and cfg.long_prefill_token_threshold_adaptive is True
