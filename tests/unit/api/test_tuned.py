"""The tuned fields are declared once, in kvpilot.api.tuned, and every other place reads them.

Two kinds of check: each consumer covers exactly the declared fields, with the declared names, flags,
types, limits and defaults; and a changed declaration, in a fresh interpreter, reaches the CRD, the
rules, the models, the engine codec, the canary parser and the tuner's EngineParams and SearchSpace.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvpilot
from kvpilot.api import crd, engine, serving, tuned, vocabulary
from kvpilot.api.models import EngineSpec, InferenceServiceSpec, TuningSpace
from kvpilot.cli import main
from kvpilot.operator.builders import canary
from kvpilot.tuner.adapters.kubernetes import KubernetesApplier
from kvpilot.tuner.core.space import LOG2_PREFIX, TUNED_FIELDS, EngineParams, SearchSpace


def _schema() -> dict[str, Any]:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_names_everyone_uses_are_the_declared_ones() -> None:
    assert vocabulary.TUNED_ENGINE_FIELDS == tuned.TUNED_ENGINE_FIELDS == TUNED_FIELDS
    assert tuned.TUNED_ENGINE_FIELDS == ("maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs")
    assert set(tuned.ALWAYS_SET) | set(tuned.MAY_BE_UNSET) == set(tuned.TUNED)


@pytest.mark.parametrize("f", tuned.TUNED, ids=lambda f: f.name)
def test_spec_engine_has_the_declared_field(f: tuned.TunedField) -> None:
    info = EngineSpec.model_fields[f.attr]
    assert info.alias == f.name and info.default == f.default
    schema = _schema()["properties"]["engine"]["properties"][f.name]
    assert schema["type"] == ("integer" if f.type is int else "number")
    assert (schema["minimum"], schema["maximum"]) == (f.low, f.high)
    assert schema.get("exclusiveMinimum", False) == schema.get("exclusiveMaximum", False) == f.exclusive
    assert schema.get("nullable", False) == (f.default is None)
    assert engine.FLAG_OF[f.name] == f.flag
    assert next(e for e in engine.ENGINE_FLAGS if e.field == f.name).type is f.type


def test_the_tuning_space_is_the_declared_fields_with_their_default_ranges() -> None:
    assert list(TuningSpace.model_fields) == [f.attr for f in tuned.TUNED]
    assert TuningSpace().model_dump(by_alias=True) == {f.name: list(f.space) for f in tuned.TUNED}
    schema = _schema()["properties"]["tuning"]["properties"]["space"]
    assert list(schema["properties"]) == list(tuned.TUNED_ENGINE_FIELDS)
    for f in tuned.TUNED:
        assert schema["properties"][f.name]["default"] == list(f.space)
        assert {"message": f"{f.name} must lie inside {f.limits_text}", "fieldPath": f".{f.name}"}.items() <= next(
            r for r in schema["x-kubernetes-validations"] if r["message"].startswith(f"{f.name} must lie")
        ).items()


@pytest.mark.parametrize("f", tuned.TUNED, ids=lambda f: f.name)
def test_the_rules_check_the_declared_limits(f: tuned.TunedField) -> None:
    space = {g.name: list(g.space) for g in tuned.TUNED}
    space[f.name] = [f.type(f.low), f.space[1]]
    spec = {"model": "m", "replicas": 2, "tuning": {"space": space}}
    refused = re.escape(f"must lie inside {f.limits_text}")
    if f.exclusive:  # the limit itself is refused
        with pytest.raises(ValueError, match=refused):
            InferenceServiceSpec.model_validate(spec)
    else:  # the limit is allowed, one past it is not
        InferenceServiceSpec.model_validate(spec)
        space[f.name] = [f.space[0], f.type(f.high) + 1]
        with pytest.raises(ValueError, match=refused):
            InferenceServiceSpec.model_validate(spec)


def test_the_canary_annotation_takes_the_declared_fields_and_types() -> None:
    assert {f.name: f.type for f in tuned.TUNED} == canary._FIELD_TYPES


def test_the_engine_command_line_and_engine_info_carry_each_declared_field() -> None:
    spec = InferenceServiceSpec.model_validate({"model": "m", "replicas": 2})
    flags = serving.typed_flags(spec)
    for f in tuned.TUNED:  # always explicit: vLLM's value where the field is unset
        assert flags[flags.index(f.flag) + 1] == engine.format_value(spec.engine.in_force(f))  # type: ignore[arg-type]
    assert vocabulary.ENGINE_INFO_LABELS[2:-1] == tuple(f.attr for f in tuned.TUNED)


def test_engine_params_are_the_declared_fields() -> None:
    assert [x.name for x in dataclasses.fields(EngineParams)] == [f.attr for f in tuned.TUNED]
    p = EngineParams.from_spec({f.name: f.space[0] for f in tuned.TUNED})
    assert p.as_spec() == {f.name: f.type(f.space[0]) for f in tuned.TUNED}
    assert [type(v) for v in p.as_spec().values()] == [f.type for f in tuned.TUNED]
    assert SearchSpace().as_spec() == {f.name: list(f.space) for f in tuned.TUNED}
    assert p.label().split() == [f"{f.short}={f.shown(f.space[0])}" for f in tuned.TUNED]
    for scale in ("log", "pow2"):
        drawn = SearchSpace(scale=scale).distributions()
        assert [name.removeprefix(LOG2_PREFIX) for name in drawn] == list(tuned.TUNED_ENGINE_FIELDS)


def test_kvpilot_tune_takes_a_range_flag_for_each_declared_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    shown = capsys.readouterr().out
    for f in tuned.TUNED:
        assert f"--{f.short} MIN:MAX" in shown and f"{f.name} range" in shown


class _Api:
    def __init__(self, engine: dict[str, Any]) -> None:
        self.engine = engine

    def get(self, path: str) -> dict[str, Any]:
        return {"spec": {"engine": self.engine}}


def test_the_kubernetes_applier_reads_each_declared_field_in_force() -> None:
    applier = KubernetesApplier(_Api({}), "ns", "svc")  # type: ignore[arg-type]
    assert applier.current().as_spec() == {
        f.name: f.type(f.default if f.default is not None else f.unset_means) for f in tuned.TUNED
    }
    overridden = {"kvCacheMemoryBytes": 1 << 30}
    assert KubernetesApplier(_Api(overridden), "ns", "svc").current().gpu_memory_utilization == 0.0  # type: ignore[arg-type]


# A fresh interpreter: the declaration is changed before anything reads it (kvpilot.api's __init__
# imports the models, so the package is registered unexecuted, tuned.py patched, then __init__ run).
_CHANGED = r"""
import dataclasses, importlib.util, json, sys
spec = importlib.util.find_spec("kvpilot.api")
pkg = importlib.util.module_from_spec(spec)
sys.modules["kvpilot.api"] = pkg
import kvpilot.api.tuned as tuned
seqs = dataclasses.replace(tuned.MAX_NUM_SEQS, high=4096, space=(8, 512), default=128)
tuned.MAX_NUM_SEQS = seqs
tuned.TUNED = tuple(seqs if f.name == seqs.name else f for f in tuned.TUNED)
tuned.ALWAYS_SET = tuple(f for f in tuned.TUNED if f.unset_means is None)
tuned.MAY_BE_UNSET = tuple(f for f in tuned.TUNED if f.unset_means is not None)
spec.loader.exec_module(pkg)

from kvpilot.api import crd, engine
from kvpilot.cli import main
from kvpilot.api.models import InferenceServiceSpec, TuningSpace
from kvpilot.tuner.core.space import EngineParams, SearchSpace

schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
space_rules = schema["properties"]["tuning"]["properties"]["space"]["x-kubernetes-validations"]
try:
    InferenceServiceSpec.model_validate({"model": "m", "replicas": 2, "tuning": {"space": {"maxNumSeqs": [8, 8192]}}})
    refused = ""
except ValueError as exc:
    refused = str(exc)
print(json.dumps({
    "engineMax": schema["properties"]["engine"]["properties"]["maxNumSeqs"]["maximum"],
    "engineDefault": schema["properties"]["engine"]["properties"]["maxNumSeqs"]["default"],
    "spaceDefault": schema["properties"]["tuning"]["properties"]["space"]["properties"]["maxNumSeqs"]["default"],
    "spaceRule": [r["rule"] for r in space_rules if r["fieldPath"] == ".maxNumSeqs" and "<=" in r["rule"]],
    "model": TuningSpace().max_num_seqs,
    "rules": refused,
    "searchSpace": list(SearchSpace().max_num_seqs),
    "params": EngineParams.from_spec({"maxNumBatchedTokens": 512, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 8}).as_flags(),
}))
"""


def test_a_changed_declaration_reaches_every_consumer() -> None:
    here = str(Path(kvpilot.__file__).resolve().parents[1])  # this checkout, not another kvpilot installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", _CHANGED], capture_output=True, text=True, check=True, env=env).stdout
    seen = json.loads(out)
    assert seen["engineMax"] == 4096 and seen["engineDefault"] == 128
    assert seen["spaceDefault"] == seen["model"] == seen["searchSpace"] == [8, 512]
    assert seen["spaceRule"] == ["size(self.maxNumSeqs) != 2 || (self.maxNumSeqs[0] >= 1 && self.maxNumSeqs[1] <= 4096)"]
    assert "maxNumSeqs" in seen["rules"] and "must lie inside [1, 4096]" in seen["rules"]
    assert "--max-num-seqs" in seen["params"]
