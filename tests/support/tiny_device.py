"""The tiny local model real vLLM runs on these CPUs (its config.json's shapes, as `make vllm-env` generates it)
and the device profile fitted for it on this host (`kvpilot.twin.calibration`): what the tuner's twin is
given to model that engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpilot.twin.calibration import CPU_PROFILE, TINY_MODEL_CONFIG

PROFILE = CPU_PROFILE
TINY: dict[str, Any] = json.loads(TINY_MODEL_CONFIG.read_text())


def tiny_model_dir(parent: Path) -> Path:
    """A model directory holding the tiny model's config.json (no weights: the twin needs the shapes)."""
    model = parent / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    return model
