"""kvpilot reads `vllm serve` arguments as vLLM's own parser does (real vLLM: `make vllm-env`).

- the committed option list (kvpilot/api/vllm_serve_options.json) is the one vLLM's parser has;
- for generated InferenceServices, vLLM parses the rendered command to exactly the spec's typed
  fields, port, served name and model; every extraArgs list kvpilot accepts leaves those as they
  are; every extraArgs entry kvpilot refuses really does, in vLLM, reach the flag kvpilot named (or
  is refused by vLLM with the very ambiguity message kvpilot gave).

vLLM's parser runs in one worker process (scripts/vllm-serve-parser.py) for the whole module:
importing `vllm serve` takes seconds, a parse a millisecond.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harness.conformance.reference import VllmEnvMissing, VllmWorker, require_vllm_env, worker_env
from kvpilot.api import engine, serve_args
from kvpilot.api.models import InferenceService
from kvpilot.operator.builders.engine import engine_args

pytestmark = pytest.mark.vllm

WORKER = Path(__file__).resolve().parents[2] / "scripts" / "vllm-serve-parser.py"
REGENERATE = f"<vllm venv>/bin/python {WORKER.relative_to(WORKER.parents[1])} --options > kvpilot/api/{serve_args.OPTIONS_FILE}"
START_DEADLINE_S = 300.0


def _python() -> Path:
    try:
        python, _ = require_vllm_env()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    return python


class ServeParser(VllmWorker):
    """vLLM's `vllm serve` parser in a worker process; `parse(argv)` answers as the worker documents."""

    what = "vLLM parser worker"

    def __init__(self, python: Path) -> None:
        super().__init__(WORKER, python=python)
        self.python = tuple(self.ready["python"])  # argparse reads `-t=1` differently before 3.12
        self.actions: list[dict[str, Any]] = self.ask({"describe": True})["actions"]
        self.dest_of = {s: a["dest"] for a in self.actions for s in a["options"]}
        self.strings_of = {s: a["options"] for a in self.actions for s in a["options"]}
        self.nargs_of = {s: a["nargs"] for a in self.actions for s in a["options"]}

    def parse(self, argv: list[str]) -> dict[str, Any]:
        return self.ask({"argv": argv})


@pytest.fixture(scope="module")
def vllm_parser() -> Iterator[ServeParser]:
    worker = ServeParser(_python())
    try:
        yield worker
    finally:
        worker.close()


def test_the_committed_option_list_is_vllms() -> None:
    out = subprocess.run([str(_python()), str(WORKER), "--options"], capture_output=True, text=True, env=worker_env(),
                         timeout=START_DEADLINE_S, check=True).stdout
    real = serve_args.ServeOptions.from_json(out)
    committed = serve_args.serve_options()
    real_strings = {s for a in real.actions for s in a}
    committed_strings = {s for a in committed.actions for s in a}
    assert (committed.vllm_version, committed.actions) == (real.vllm_version, real.actions), (
        f"kvpilot/api/{serve_args.OPTIONS_FILE} is not vLLM {real.vllm_version}'s list (new: "
        f"{sorted(real_strings - committed_strings)}, gone: {sorted(committed_strings - real_strings)}); "
        f"regenerate it: {REGENERATE}")


# ---- generated specs ------------------------------------------------------------------------------
TYPED = {f.flag: f for f in engine.ENGINE_FLAGS}
GUARDED = [*TYPED, *engine.OWNED_FLAGS, *engine.REFUSED_EXTRA_FLAGS]
ALL = [s for a in serve_args.serve_options().actions for s in a]
# A value vLLM's parser takes for each typed flag, unlike any a spec renders; one for each owned flag.
PROBE_VALUE = {int: "12345", float: "0.123", str: "fp8_inc"}
CONFIG_HOST = "5.6.7.8"
OWNED_PROBE = {"--port": "4321", "--host": "4.3.2.1", "--served-model-name": "probe-name", "--model": "probe/model"}

model_names = st.from_regex(r"[a-z][a-z0-9]{0,8}(/[A-Za-z0-9][A-Za-z0-9._-]{0,12})?", fullmatch=True)


@st.composite
def specs(draw: Any) -> dict[str, Any]:
    seqs = draw(st.integers(1, 4096))
    eng: dict[str, Any] = {
        "kind": "vllm",
        "maxNumSeqs": seqs,
        "maxNumBatchedTokens": draw(st.integers(seqs, engine.MAX_BATCHED_TOKENS_LIMIT)),
        "maxModelLen": draw(st.none() | st.integers(1, engine.MAX_MODEL_LEN_LIMIT)),
        "tensorParallelSize": draw(st.integers(1, 8)),
        "blockSize": draw(st.sampled_from([1, 8, 16, 32, 64, 128, 256])),
        "kvCacheDtype": draw(st.sampled_from(["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])),
        "longPrefillTokenThreshold": draw(st.integers(0, 1 << 16)),
    }
    if draw(st.booleans()):
        eng["kvCacheMemoryBytes"] = draw(st.integers(1, engine.MAX_KV_CACHE_MEMORY_BYTES))
    else:
        eng["gpuMemoryUtilization"] = draw(st.none() | st.floats(0.01, 0.99).map(lambda x: round(x, 4)))
    spec: dict[str, Any] = {"model": draw(model_names), "replicas": 2, "engine": eng,
                            "resources": {"gpus": eng["tensorParallelSize"]},
                            "rollout": {"shutdownTimeoutSeconds": draw(st.integers(0, 3600))}}
    if draw(st.booleans()):
        spec["servedModelName"] = draw(model_names)
    if draw(st.booleans()):
        spec["observability"] = {"tracing": {
            "otlpTracesEndpoint": draw(st.sampled_from(["http://otel-collector:4318/v1/traces",
                                                        "https://otel.example.com:443/otlp/v1/traces"])),
            "collectDetailedTraces": draw(st.lists(st.sampled_from(["model", "worker", "all"]), unique=True))}}
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "svc", "namespace": "ml"}, "spec": spec}


@st.composite
def spellings(draw: Any, option: str) -> str:
    """`option` as a user might write it: cut to a prefix, `_` for some `-`."""
    if option.startswith("--"):
        keep = draw(st.integers(3, len(option)))
        body = "".join(c if c != "-" or not draw(st.booleans()) else "_" for c in option[2:keep])
        return "--" + body
    return option[: draw(st.integers(2, len(option)))]


@st.composite
def extra_args(draw: Any) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(0, 4))):
        option = draw(st.sampled_from(GUARDED) | st.sampled_from(ALL))
        name = draw(spellings(option))
        shape = draw(st.sampled_from(["space", "equals", "bare", "dotted"]))
        value = draw(st.sampled_from(["1", "auto", "x", "0.5"]))
        if shape == "space":
            out += [name, value]
        elif shape == "equals":
            out.append(f"{name}={value}")
        elif shape == "dotted" and name.startswith("--"):
            out += [f"{name}.k", value]
        else:
            out.append(name)
    if draw(st.integers(0, 9)) == 0:
        out.insert(draw(st.integers(0, len(out))), "--")
    return out


def expected_values(parser: ServeParser, isvc: InferenceService) -> dict[str, Any]:
    """The namespace values the spec means: typed fields as rendered, the port, served name, model."""
    eng = isvc.spec.engine
    spec_values: dict[str, Any] = {
        "--max-num-batched-tokens": eng.max_num_batched_tokens, "--max-num-seqs": eng.max_num_seqs,
        "--gpu-memory-utilization": eng.effective_gpu_memory_utilization,
        "--kv-cache-memory-bytes": eng.kv_cache_memory_bytes, "--max-model-len": eng.max_model_len,
        "--tensor-parallel-size": eng.tensor_parallel_size, "--block-size": eng.block_size,
        "--kv-cache-dtype": eng.kv_cache_dtype, "--long-prefill-token-threshold": eng.long_prefill_token_threshold,
        "--shutdown-timeout": isvc.spec.rollout.shutdown_timeout_seconds,
    }
    tracing = isvc.spec.observability.tracing
    spec_values["--otlp-traces-endpoint"] = tracing.otlp_traces_endpoint if tracing else None
    spec_values["--collect-detailed-traces"] = list(tracing.collect_detailed_traces) or None if tracing else None
    assert set(spec_values) == set(TYPED)
    out = {parser.dest_of[flag]: value for flag, value in spec_values.items() if value is not None}
    out["model_tag"] = isvc.spec.model
    out[parser.dest_of["--served-model-name"]] = [isvc.spec.served_model_name] if isvc.spec.served_model_name else None
    return out


def guarded_dests(parser: ServeParser) -> list[str]:
    """The namespace entries of the typed and owned flags (--help has none: it exits)."""
    return sorted({parser.dest_of[f] for f in GUARDED if f != "--help"} | {"model_tag"})


def probe(parser: ServeParser, base: list[str], use: serve_args.FlagUse, config: Path) -> list[str]:
    """The base command plus the refused argument alone, with a value vLLM's parser takes for its flag
    (in place of the argument's own, so the effect shows) where the argument is a plain flag."""
    arg = use.arg
    name, eq, _ = arg.partition("=")
    if use.ambiguous or "." in name:  # kept as it is: vLLM quotes it, or turns it into JSON
        return [*base, arg] if eq else [*base, arg, "2"]
    if use.option and parser.nargs_of.get(use.option) == 0:  # a switch (--help, --headless, ...)
        return [*base, arg]
    if use.flag == "--config":
        value = str(config)
    elif use.flag in TYPED:
        value = PROBE_VALUE[TYPED[use.flag].type]
    else:
        value = OWNED_PROBE.get(use.flag or "", "2")
    return [*base, f"{name}={value}"] if eq else [*base, arg, value]


def whole_on_3_11(parser: ServeParser, use: serve_args.FlagUse, reply: dict[str, Any]) -> bool:
    """Python 3.11's argparse reads a single-dash prefix with `=` (`-t=1`) whole, an unknown flag; 3.12+
    reads `-t` with the value 1 (`-tp`). kvpilot refuses both readings; vLLM here may run on 3.11."""
    return bool(parser.python < (3, 12) and use.arg[1:2] != "-" and "=" in use.arg and not reply["ok"]
                and "unrecognized arguments" in reply["error"])


def names(parser: ServeParser, flag: str, error: str) -> bool:
    """Whether an argparse error is about `flag` ("argument --tensor-parallel-size/-tp: ...")."""
    return f"argument {'/'.join(parser.strings_of[flag])}: " in error


def reached(parser: ServeParser, reply: dict[str, Any], base: dict[str, Any], use: serve_args.FlagUse) -> bool:
    """Whether vLLM's parse of a probe shows the argument landed on its flag."""
    flag = use.flag or ""
    if not reply["ok"]:
        error = reply["error"]
        if flag == "--help" and reply["status"] == 0:
            return True
        if "." in use.arg.partition("=")[0] and parser.nargs_of.get(use.option or "") == 0:
            # `--switch.k V` becomes `--switch '{"k": V}'`: the switch is set, its JSON left over
            return bool(error.startswith("unrecognized arguments: {"))
        if flag == "--model":  # vLLM moves --model's value to the front: the spec's model is left over
            return "unrecognized arguments" in error or names(parser, flag, error)
        return names(parser, flag, error)
    values = reply["values"]
    if flag == "--config":  # vLLM splices the file's flags in (host: 4.3.2.1) or keeps --config=FILE
        return bool(values["host"] == CONFIG_HOST or values["config"] != base["config"])
    if flag == "--model":  # moved to the model's place, or (`--model.k V`) the --model option itself
        return bool(values["model_tag"] == OWNED_PROBE["--model"] or values["model"] != base["model"])
    dest = parser.dest_of[flag]
    if flag in TYPED and "." in use.arg.partition("=")[0]:
        # `--name.k V` becomes `--name '{"k": V}'`: a string flag (--otlp-traces-endpoint) takes that JSON
        # as its value, so the flag was reached, with the JSON rather than the probe's value.
        return bool(values[dest] != base[dest])
    if flag in TYPED:  # the probe's value, which the spec may happen to hold too
        return bool(values[dest] == TYPED[flag].type(PROBE_VALUE[TYPED[flag].type]))
    return bool(values[dest] != base[dest])


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(doc=specs(), extra=extra_args())
def test_vllm_parses_rendered_commands_to_the_spec_and_kvpilot_refuses_exactly_what_reaches_it(
        vllm_parser: ServeParser, doc: dict[str, Any], extra: list[str], tmp_path_factory: Any) -> None:
    isvc = InferenceService.model_validate(doc)
    base = engine_args(isvc)
    base_reply = vllm_parser.parse(base)
    assert base_reply["ok"], (base, base_reply)
    base_values = base_reply["values"]
    for dest, value in expected_values(vllm_parser, isvc).items():
        assert base_values[dest] == value, (dest, base)

    problems = dict(engine.extra_args_problems(tuple(extra)))
    full = vllm_parser.parse([*base, *extra])
    event(f"kvpilot {'refuses' if problems else 'accepts'}, vLLM {'parses' if full['ok'] else 'refuses'}")
    if not problems:
        if full["ok"]:
            for dest in guarded_dests(vllm_parser):
                assert full["values"][dest] == base_values[dest], (dest, extra)
            assert full["values"]["config"] is None
        else:
            assert "ambiguous option" not in full["error"], (extra, full)
            for flag in GUARDED:
                assert not names(vllm_parser, flag, full["error"]), (extra, full)
        return
    config = tmp_path_factory.getbasetemp() / "probe-config.yaml"
    # kvpilot's own flags come after a spliced file's and win; --host is one the vLLM command leaves unset.
    config.write_text(f"host: {CONFIG_HOST}\n")
    for use in serve_args.vllm_resolver(engine._RENDERED).resolve(extra):
        if use.index not in problems:
            continue
        reply = vllm_parser.parse(probe(vllm_parser, base, use, config))
        event("refused as ambiguous" if use.ambiguous else f"refused: {use.flag}")
        if use.ambiguous:
            assert not reply["ok"] and reply["error"] == use.ambiguity, (use, reply)
        else:
            assert use.flag and use.flag in problems[use.index]
            assert whole_on_3_11(vllm_parser, use, reply) or reached(vllm_parser, reply, base_values, use), (use, reply)


def test_the_issue_examples_pass_vllm_but_not_kvpilot(vllm_parser: ServeParser) -> None:
    """extraArgs that used to pass `kvpilot validate`: vLLM takes them as the typed flags."""
    base = ["m", "--max-num-batched-tokens", "2048", "--max-num-seqs", "256", "--gpu-memory-utilization", "0.92"]
    extra = ["--max-num-batched=4096", "--max_num_se", "512", "--gpu-mem=0.5"]
    reply = vllm_parser.parse([*base, *extra])
    assert reply["ok"], reply
    values = reply["values"]
    assert (values["max_num_batched_tokens"], values["max_num_seqs"], values["gpu_memory_utilization"]) == (
        4096, 512, 0.5)
    problems = dict(engine.extra_args_problems(tuple(extra)))
    assert sorted(problems) == [0, 1, 3]
    assert "--max-num-seqs" in problems[1]
    # vLLM 0.32 also has --max-num-scheduled-tokens: `--max-num-s` is ambiguous there, in kvpilot's words too
    reply = vllm_parser.parse([*base, "--max-num-s=512"])
    assert not reply["ok"]
    assert problems_of(["--max-num-s=512"]) == f"{reply['error']}: vLLM refuses to start; write the flag in full"


def problems_of(extra: list[str]) -> str:
    [(_, message)] = engine.extra_args_problems(tuple(extra))
    return message


def spellings_of(option: str, strings: list[str]) -> list[str]:
    """`option` in full, as its shortest unambiguous prefix, and with `_` for every `-` of a long name."""
    out = [option]
    for k in range(3 if option.startswith("--") else 2, len(option)):
        if [s for s in strings if s.startswith(option[:k])] == [option]:
            out.append(option[:k])
            break
    if option.startswith("--") and "-" in option[2:]:
        out.append("--" + option[2:].replace("-", "_"))
    return out


def test_every_vllm_flag_in_each_spelling_is_refused_exactly_when_it_reaches_a_guarded_flag(
        vllm_parser: ServeParser) -> None:
    """Each of vLLM's flags, in full, as its shortest prefix and with underscores, with `=` and with a
    space: kvpilot refuses it iff vLLM reads it as a typed or owned flag, naming that flag; what
    kvpilot accepts leaves every typed and owned value as the spec has it."""
    isvc = InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "s"},
        "spec": {"model": "org/m", "servedModelName": "m", "replicas": 2}})
    base = engine_args(isvc)
    base_values = vllm_parser.parse(base)["values"]
    strings = [s for a in vllm_parser.actions for s in a["options"]]
    guarded = {s for f in GUARDED for s in vllm_parser.strings_of[f]}
    parsed = 0
    for action in vllm_parser.actions:
        switch = action["nargs"] == 0
        values = [None] if switch else [str(action["choices"][0])] if action["choices"] else ["1", "auto", "{}", "x"]
        value = next((v for v in values if v is None or vllm_parser.parse([*base, action["options"][0], v])["ok"]),
                     values[0])
        for option in action["options"]:
            for spelled in spellings_of(option, strings):
                forms = [[spelled]] if switch else [[spelled, value], [f"{spelled}={value}"]]
                for extra in forms:
                    problems = dict(engine.extra_args_problems(tuple(extra)))
                    reply = vllm_parser.parse([*base, *extra])
                    if option in guarded:
                        flag = next(f for f in GUARDED if option in vllm_parser.strings_of[f])
                        assert list(problems) == [0] and flag in problems[0], (extra, problems)
                        continue
                    assert problems == {}, (extra, problems)
                    if reply["ok"]:
                        parsed += 1
                        for dest in guarded_dests(vllm_parser):
                            assert reply["values"][dest] == base_values[dest], (extra, dest)
                    else:
                        assert not any(names(vllm_parser, f, reply["error"]) for f in GUARDED), (extra, reply)
    assert parsed > 500  # most of vLLM's flags parse with the values tried: the check above ran on them


def test_each_guarded_flag_in_each_spelling_reaches_that_flag_in_vllm(vllm_parser: ServeParser,
                                                                        tmp_path: Path) -> None:
    """Every typed and owned flag (and -tp), written in full, as its shortest unambiguous prefix and with
    `_`, with `=` and with a space: kvpilot names the flag, and vLLM's parse of the probe shows it set
    (--config: the file's flags spliced in; --model: its value moved to the model's place; --help: exit 0)."""
    isvc = InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "s"},
        "spec": {"model": "org/m", "replicas": 2}})
    base = engine_args(isvc)
    base_values = vllm_parser.parse(base)["values"]
    config = tmp_path / "probe-config.yaml"
    config.write_text(f"host: {CONFIG_HOST}\n")
    strings = [s for a in vllm_parser.actions for s in a["options"]]
    resolver = serve_args.vllm_resolver(engine._RENDERED)
    checked = 0
    for flag in GUARDED:
        for option in vllm_parser.strings_of[flag]:
            for spelled in spellings_of(option, strings):
                switch = vllm_parser.nargs_of[option] == 0
                for extra in [[spelled]] if switch else [[spelled, "v"], [f"{spelled}=v"]]:
                    problems = dict(engine.extra_args_problems(tuple(extra)))
                    assert list(problems) == [0] and flag in problems[0], (extra, problems)
                    [use] = resolver.resolve(extra)
                    reply = vllm_parser.parse(probe(vllm_parser, base, use, config))
                    assert whole_on_3_11(vllm_parser, use, reply) or reached(vllm_parser, reply, base_values, use), (
                        extra, reply)
                    checked += 1
    assert checked >= 3 * len(GUARDED)
