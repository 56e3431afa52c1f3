"""The engine command line: `vllm serve MODEL --port 8000` plus exactly the typed flags (rendered by the
API's engine codec), then extraArgs."""

from __future__ import annotations

from kvpilot.api import serving
from kvpilot.api.engine import format_value
from kvpilot.api.models import EngineSpec, InferenceService
from kvpilot.operator.builders.common import HTTP_PORT

# Where an engine.kind twin pod mounts spec.modelConfig's ConfigMap key (as config.json).
MODEL_CONFIG_DIR = "/etc/kvpilot/model"
MODEL_CONFIG_PATH = f"{MODEL_CONFIG_DIR}/config.json"


def typed_flags(isvc: InferenceService, engine: EngineSpec | None = None) -> list[str]:
    """The typed engine fields as vLLM flags (the codec's order); unset optional fields are left out."""
    return serving.typed_flags(isvc.spec, engine)


def engine_args(isvc: InferenceService, engine: EngineSpec | None = None) -> list[str]:
    """Arguments after the command: model, port, served name, typed flags, extraArgs (and --gpu for the twin)."""
    engine = engine or isvc.spec.engine
    args = [isvc.spec.model, "--port", str(HTTP_PORT)]
    if engine.kind == "twin":
        # The twin binds 127.0.0.1 by default; in a pod it must listen on the pod IP.
        args += ["--host", "0.0.0.0"]
    if isvc.spec.served_model_name:
        args += ["--served-model-name", isvc.spec.served_model_name]
    args += typed_flags(isvc, engine)
    if engine.kind == "twin":
        args += ["--gpu", engine.twin.gpu]
        if isvc.spec.model_config_ref is not None:
            # The twin sizes a model it has no preset of from the mounted config.json (deployment.py).
            args += ["--model-config", MODEL_CONFIG_PATH]
        if engine.twin.startup_delay_seconds > 0:
            args += ["--startup-delay", format_value(engine.twin.startup_delay_seconds)]
    args += list(engine.extra_args)
    return args


def engine_command(engine: EngineSpec) -> list[str]:
    return ["vllm", "serve"] if engine.kind == "vllm" else ["kvpilot", "twin", "serve"]
