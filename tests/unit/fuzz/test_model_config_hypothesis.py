"""Hypothesis against the config.json reader: whatever JSON value each field the twin reads holds,
`ModelSpec.from_hf_config` returns a spec whose shapes are positive or raises ModelSpecError (a
ValueError that the commands print as one line), never anything else; and a config.json in a ConfigMap
of `validate --predict`'s input is held to the same bounds as one given with --model-config.

Fixed number of examples and a fixed seed (derandomize), so CI runs the same cases every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.twin.models import ModelSpec, ModelSpecError
from tests.fuzz.model_configs import CASES, MOE, TINY

ROOT = Path(__file__).resolve().parents[3]
FIELDS = sorted({*TINY, *MOE, "head_dim", "text_config", "quantization_config", "sliding_window",
                 "use_sliding_window", "layer_types", "model_type", "num_experts", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "decoder_sparse_step", "interleave_moe_layer_step",
                 "intermediate_size_mlp", "kv_lora_rank", "tie_word_embeddings", "_name_or_path", "dtype"})
SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
           | st.text(max_size=20) | st.sampled_from([0, 1, -1, 4096, "fp8", "compressed-tensors", "LlamaForCausalLM"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(["quant_method", "config_groups", "weights", "num_bits",
                                                         "type", "g", *FIELDS]), inner, max_size=4),
                      max_leaves=12)


@SETTINGS
@given(base=st.sampled_from([TINY, MOE]), changes=st.dictionaries(st.sampled_from(FIELDS), values, max_size=4))
def test_any_field_value_gives_a_spec_or_a_model_spec_error(base: dict[str, Any], changes: dict[str, Any]) -> None:
    try:
        spec = ModelSpec.from_hf_config({**base, **changes})
    except ModelSpecError as exc:
        assert "\n" not in str(exc) and len(str(exc)) <= 600
        return
    assert min(spec.hidden_size, spec.num_hidden_layers, spec.num_attention_heads, spec.num_key_value_heads,
               spec.head_dim, spec.vocab_size) > 0
    assert spec.kv_bytes_per_token() > 0 and spec.num_params() > 0


def test_a_config_map_config_is_held_to_the_same_bounds(tmp_path: Path) -> None:
    docs = []
    for i, case_id in enumerate(("deep-2000", "num_attention_heads-zero", "too-large")):
        text = next(c for c in CASES if c.id == case_id).data.decode()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"c{i}", "namespace": "ml"},
                     "data": {"config.json": text}})
        docs.append({"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"name": f"s{i}", "namespace": "ml"},
                     "spec": {"model": "acme/custom", "modelConfig": {"configMapRef": {"name": f"c{i}",
                                                                                      "key": "config.json"}},
                              "resources": {"gpuType": "NVIDIA-L4"}}})
    # JSON is YAML: one document a line, so no value needs YAML's quoting.
    (tmp_path / "in.yaml").write_text("---\n".join(json.dumps(d) + "\n" for d in docs))
    proc = subprocess.run([sys.executable, "-m", "kvpilot.cli", "validate", "--predict", "-f", str(tmp_path / "in.yaml")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "(ml/s0): missing: model: the config.json given for 'acme/custom' cannot be used: it nests more than 32" \
        in proc.stdout, proc.stdout
    assert "(ml/s1): missing: model: the config.json given for 'acme/custom' cannot be used: config.json field " \
        "'num_attention_heads' must be a positive integer" in proc.stdout, proc.stdout
    assert "(ml/s2): missing: model: the config.json given for 'acme/custom' cannot be used: it is larger than 1024 KiB" \
        in proc.stdout, proc.stdout
