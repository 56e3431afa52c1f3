"""The rendered `vllm serve` command is one vLLM 0.33's own argument parser accepts.

Always: against the flag table dumped from vLLM 0.33.0's parser (vllm_0_33_serve_flags.txt).
With KVPILOT_VLLM_PYTHON pointing at a Python that has vLLM 0.33 installed: the real parser
itself parses every rendered command (vLLM pulls torch and CUDA libraries, so kvpilot's own
environment does not carry it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpilot.api.engine import FLAG_OF
from kvpilot.api.models import InferenceService
from kvpilot.api.vllm import REMOVED_FLAGS
from kvpilot.operator.builders import build_deployment
from tests.unit.operator.fixtures import isvc_dict

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TABLE = HERE / "vllm_0_33_serve_flags.txt"

VARIANTS: list[dict[str, Any]] = [
    isvc_dict(),
    isvc_dict(servedModelName="llama", engine={"maxNumBatchedTokens": 16384, "gpuMemoryUtilization": 0.85,
                                               "maxNumSeqs": 1024, "maxModelLen": 32768, "blockSize": 32,
                                               "kvCacheDtype": "fp8_e4m3", "longPrefillTokenThreshold": 4096,
                                               "tensorParallelSize": 4, "extraArgs": ["--enable-prefix-caching"]},
              resources={"gpus": 4}, rollout={"shutdownTimeoutSeconds": 120}),
    isvc_dict(engine={"kvCacheMemoryBytes": 17179869184}),
    isvc_dict(observability={"tracing": {"otlpTracesEndpoint": "http://otel-collector:4318/v1/traces",
                                         "samplingRatio": 0.1, "collectDetailedTraces": ["model", "worker"]}}),
]
# Flags vLLM reads with nargs="+" (the table has no nargs column): their values run to the next flag.
MANY_VALUES = {"--collect-detailed-traces"}


def flag_table() -> dict[str, tuple[str, list[str]]]:
    table: dict[str, tuple[str, list[str]]] = {}
    for line in TABLE.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        flag, kind, choices = (line.split("\t") + [""])[:3]
        table[flag] = (kind, [c for c in choices.split(",") if c])
    return table


def rendered_commands() -> list[list[str]]:
    objs = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))] + VARIANTS
    commands = []
    for obj in objs:
        svc = InferenceService.model_validate(obj)
        if svc.spec.engine.kind != "vllm":
            continue
        container = build_deployment(svc)["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == ["vllm", "serve"]
        commands.append(container["args"])
    return commands


def test_table_is_vllm_0_33_and_knows_the_typed_flags() -> None:
    assert "vLLM 0.33.0" in TABLE.read_text().splitlines()[0]
    table = flag_table()
    assert set(FLAG_OF.values()) <= set(table)
    assert not set(REMOVED_FLAGS) & set(table)


def test_every_rendered_flag_and_value_fits_the_table() -> None:
    table = flag_table()
    commands = rendered_commands()
    assert len(commands) >= 4
    for args in commands:
        assert not args[0].startswith("-")  # the model, positional, first
        i = 1
        while i < len(args):
            flag = args[i]
            assert flag in table, f"vLLM 0.33 has no {flag}"
            kind, choices = table[flag]
            if kind == "switch":
                i += 1
                continue
            values = [args[i + 1]]
            i += 2
            while flag in MANY_VALUES and i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            for value in values:
                if kind in ("int", "human_readable_int"):
                    int(value)
                elif kind == "float":
                    float(value)
                if choices:
                    assert value in choices, f"{flag} {value} not in {choices}"


VLLM_PYTHON = os.environ.get("KVPILOT_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="set KVPILOT_VLLM_PYTHON to a Python with vLLM 0.33 installed "
                    "to run vLLM's own `vllm serve` parser (the flag-table test above always runs)")
def test_vllms_own_parser_accepts_every_rendered_command() -> None:
    assert VLLM_PYTHON
    commands = rendered_commands()
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run([VLLM_PYTHON, str(HERE / "vllm_serve_parser.py"), "check"], input=json.dumps(commands),
                         capture_output=True, text=True, env=env, timeout=600, cwd="/", check=True).stdout
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == len(commands)
    for args, result in zip(commands, results, strict=True):
        assert result["ok"], f"vLLM refused {args}: {result}"
        parsed = result["parsed"]
        assert parsed["max_num_batched_tokens"] == int(args[args.index("--max-num-batched-tokens") + 1])
        assert parsed["shutdown_timeout"] == int(args[args.index("--shutdown-timeout") + 1])
