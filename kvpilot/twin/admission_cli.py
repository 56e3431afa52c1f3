"""`kvpilot validate --predict`: validate InferenceService manifests, then predict vLLM's start-up.

`kvpilot validate` is the API layer's command, which may not import the twin; `kvpilot.cli` hands its
parser to `extend_validate` here, which adds --predict, --model-config and --output and takes over the
handler (without --predict it runs the API's own `validate_command` unchanged).

With --predict:
  * ConfigMap documents (apiVersion v1) in the input, in any of the files, are read as the model
    config.json sources that spec.modelConfig.configMapRef names (same namespace), not refused;
  * `--model-config [MODEL=]PATH` (repeatable) gives the config.json of the services whose spec.model is
    MODEL, or of every service without MODEL=; it wins over spec.modelConfig and over a twin preset;
  * each valid InferenceService gets `kvpilot.twin.admission.predict`'s answer.
Exit status: 1 when a document is invalid or vLLM is predicted to refuse to start; 0 otherwise, also
when a prediction could not be made for lack of the model's config or a known GPU (it says what is
missing: that is not a fault of the manifest).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the handler imports it: `kvpilot --help` must not pay for the twin
    from kvpilot.twin.admission import Prediction


@dataclass
class _ModelConfigs:
    """--model-config: paths for one model, and one for every model."""

    by_model: dict[str, str] = field(default_factory=dict)
    every: str | None = None

    def path_for(self, model: str) -> str | None:
        return self.by_model.get(model, self.every)


def extend_validate(validate: argparse.ArgumentParser) -> None:
    """Add the prediction's options to `kvpilot validate` (its parser, from the API layer)."""
    validate.description = (validate.description or "") + (
        " With --predict, also run vLLM's start-up memory plan for each valid InferenceService whose model "
        "and GPU are known (the engine twin's start-up, exactly): weights per GPU, KV-cache tokens, the "
        "largest concurrency at maxModelLen, warnings, and the start-up error vLLM would raise, in its "
        "words; exits 1 on a predicted failure. Missing information (a model that is not a twin preset "
        "without a config.json, no or an unknown spec.resources.gpuType) is reported, exit status 0.")
    validate.add_argument("--predict", action="store_true",
                          help="predict vLLM's start-up (memory plan, failure, warnings) for each service")
    validate.add_argument("--model-config", action="append", default=[], metavar="[MODEL=]PATH",
                          help="a Hugging Face config.json (file or directory) for the services whose spec.model "
                               "is MODEL, or for all of them; repeatable; with --predict")
    validate.add_argument("-o", "--output", choices=("text", "json"), default="text",
                          help="text (default) or json: a JSON array with every document's result (and its prediction, with --predict)")
    validate.set_defaults(handler=validate_command)


def _parse_model_configs(values: list[str]) -> _ModelConfigs:
    out = _ModelConfigs()
    for value in values:
        model, eq, path = value.partition("=")
        if eq and model:
            out.by_model[model] = path
        else:
            out.every = value
    return out


def _config_maps(documents: list[Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(namespace, name) -> data of every ConfigMap document."""
    maps: dict[tuple[str, str], dict[str, Any]] = {}
    for obj in documents:
        if not _is_config_map(obj):
            continue
        meta = obj.get("metadata")
        meta = meta if isinstance(meta, dict) else {}
        name, namespace, data = meta.get("name"), meta.get("namespace"), obj.get("data")
        if isinstance(name, str):
            maps[(namespace if isinstance(namespace, str) else "default", name)] = (
                data if isinstance(data, dict) else {})
    return maps


def _is_config_map(obj: Any) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == "ConfigMap" and obj.get("apiVersion") == "v1"


def validate_command(args: argparse.Namespace) -> int:
    if not args.predict:
        if args.model_config:
            print("kvpilot validate: error: --model-config needs --predict", file=sys.stderr)
            return 2
        if args.output == "text":
            from kvpilot.api.commands import validate_command as plain_validate

            return plain_validate(args)
    return _predict(args)


def _read_model_config(path: str) -> tuple[str | None, str | None]:
    """(text, None) or (None, why it cannot be read)."""
    from kvpilot.twin.models import ModelSpecError, read_model_config

    try:
        return read_model_config(path, label="--model-config"), None
    except ModelSpecError as exc:
        return None, str(exc)


def _predict(args: argparse.Namespace) -> int:
    from kvpilot.api.documents import DocumentError, expand_filenames, read_source
    from kvpilot.api.validation import parse_text, strict_validate
    from kvpilot.twin.admission import Prediction, predict

    configs = _parse_model_configs(args.model_config)
    try:
        names = expand_filenames(args.filename, args.recursive)
    except DocumentError as exc:
        print(f"kvpilot validate: -f {exc}", file=sys.stderr)
        return 1
    failed = False
    inputs: list[tuple[str, list[Any]]] = []
    for name in names:
        source = "<stdin>" if name == "-" else name
        try:
            inputs.append((source, parse_text(read_source(name))))
        except OSError as exc:
            print(f"{source}: cannot read: {exc.strerror or exc}", file=sys.stderr)
            failed = True
        except DocumentError as exc:
            print(f"{source}: {exc}")
            failed = True
    config_maps = _config_maps([doc.obj for _, docs in inputs for doc in docs])
    reports: list[dict[str, Any]] = []
    for source, docs in inputs:
        for doc in docs:
            entry: dict[str, Any] = {"source": source, "document": doc.result.index + 1, "name": doc.result.name}
            if doc.result.item is not None:
                entry["item"] = doc.result.item + 1
            reports.append(entry)
            if _is_config_map(doc.obj):
                entry["kind"] = "ConfigMap"
                _say(args, f"{source}: {doc.result.label}: ConfigMap (read for spec.modelConfig)", quiet_too=False)
                continue
            entry["valid"] = doc.result.valid
            if not doc.result.valid:
                failed = True
                entry["issues"] = [str(i) for i in doc.result.issues]
                for issue in doc.result.issues:
                    _say(args, f"{source}: {doc.result.label}: {issue}", quiet_too=True)
                continue
            if doc.result.warnings:
                entry["warnings"] = [str(w) for w in doc.result.warnings]
            for warning in doc.result.warnings:
                print(f"Warning: {source}: {doc.result.label}: {warning}", file=sys.stderr)
            if not args.predict:
                continue
            service = strict_validate(doc.obj)
            model_config, unreadable = _model_config_for(service, configs, config_maps)
            prediction = predict(service, model_config=model_config)
            if unreadable:
                prediction = Prediction(missing=(unreadable, *prediction.missing), warnings=prediction.warnings,
                                        gpu=prediction.gpu)
            entry["prediction"] = prediction.as_dict()
            failed |= prediction.refused
            _say(args, f"{source}: {doc.result.label}: valid", quiet_too=False)
            for line in prediction_lines(prediction):
                _say(args, f"{source}: {doc.result.label}: {line}",
                     quiet_too=line.startswith(("failure:", "warning:", "missing:")))
    if args.output == "json":
        json.dump(reports, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 1 if failed else 0


def _say(args: argparse.Namespace, line: str, *, quiet_too: bool) -> None:
    if args.output == "text" and (quiet_too or not args.quiet):
        print(line)


def _model_config_for(service: Any, configs: _ModelConfigs,
                      config_maps: dict[tuple[str, str], dict[str, Any]]) -> tuple[str | None, str | None]:
    """The config.json text for `service` (from --model-config, else its spec.modelConfig ConfigMap in the
    input), or why a named one cannot be read; (None, None) when none is named."""
    path = configs.path_for(service.spec.model)
    if path is not None:
        return _read_model_config(path)
    ref = service.spec.model_config_ref
    if ref is None:
        return None, None
    data = config_maps.get((service.metadata.namespace, ref.config_map_ref.name))
    if data is None:
        return None, None  # predict says the ConfigMap was not supplied
    text = data.get(ref.config_map_ref.key)
    if not isinstance(text, str):
        return None, (f"model: ConfigMap {ref.config_map_ref.name!r} has no key {ref.config_map_ref.key!r} "
                      f"(it has: {', '.join(sorted(map(str, data))) or 'none'})")
    return text, None


def prediction_lines(p: Prediction) -> list[str]:
    from kvpilot.twin.accuracy import MEMORY_PLAN

    """The prediction in words, one finding a line: `predicted:`, `failure:`, `warning:`, `missing:`."""
    lines: list[str] = []
    for what in p.missing:
        lines.append(f"missing: {what}; no prediction")
    if p.config is not None:
        c = p.config
        where = f"{p.model} on {p.gpu} x{c.tensor_parallel_size}"
        if p.plan is not None:
            lines.append(
                f"predicted: {where}: weights {p.weights_per_gpu_gib:.2f} GiB/GPU, KV cache "
                f"{p.kv_cache_tokens} tokens, max concurrency {p.max_concurrency:.2f}x at maxModelLen {c.max_model_len}")
            lines.append(f"accuracy: {MEMORY_PLAN.describe(c.model)}")
        if p.failure is not None:
            lines.append(f"failure: {where}: vLLM would refuse to start: {p.failure}")
    for w in p.warnings:
        lines.append(f"warning: {w}")
    return lines
