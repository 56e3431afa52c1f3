"""Every manifest `kvpilot render` prints validates against the Kubernetes schemas (strict)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from kvpilot.cli import main
from tests.unit.operator.fixtures import isvc_dict

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

OWN_FIXTURES = {
    "twin-one-replica-no-prestop": isvc_dict(replicas=1, engine={"kind": "twin"}, resources={"gpus": 0},
                                             rollout={"preStopSeconds": 0, "maxSurge": 1}),
    "kv-bytes-tp2-surge0": isvc_dict(replicas=3, engine={"kvCacheMemoryBytes": 21474836480, "tensorParallelSize": 2},
                                     resources={"gpus": 2, "cpu": "16"}, rollout={"maxSurge": 0},
                                     hfTokenSecret={"name": "hf"}),
}


def render(path: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["render", "-f", str(path)])
    return code, out.getvalue(), err.getvalue()


def _inputs(tmp_path: Path) -> list[Path]:
    paths = list(EXAMPLES)
    for name, obj in OWN_FIXTURES.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(obj))
        paths.append(path)
    return paths


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_rendered_manifests_validate_strictly(tmp_path: Path, version: str) -> None:
    kinds_seen: set[str] = set()
    for path in _inputs(tmp_path):
        code, out, err = render(path)
        assert code == 0, err
        docs = [d for d in yaml.safe_load_all(out) if d]
        assert docs, f"nothing rendered for {path.name}"
        for doc in docs:
            kinds_seen.add(doc["kind"])
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # custom resources: kubernetes-validate has no schema for them
            kubernetes_validate.validate(doc, version, strict=True)
    assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule"} <= kinds_seen


def test_examples_exist() -> None:
    assert EXAMPLES, "examples/*.yaml are the lead's; the render test needs them"


def test_render_refuses_an_invalid_object_with_the_field_path(tmp_path: Path) -> None:
    for engine, where in [({"maxNumSeqs": 0}, "spec.engine.maxNumSeqs"),
                          ({"extraArgs": ["--max-num-batched-tokens", "4"]}, "spec.engine.extraArgs[0]")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(isvc_dict(engine=engine)))
        code, out, err = render(path)
        assert code == 1
        assert out == ""
        assert where in err
        assert "Traceback" not in err


def test_render_of_a_missing_file_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    code, _, err = render(tmp_path / "nope.yaml")
    assert code == 1
    assert "cannot read" in err


def test_render_without_monitoring(tmp_path: Path) -> None:
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(isvc_dict()))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(["render", "-f", str(path), "--no-monitoring"]) == 0
    assert [d["kind"] for d in yaml.safe_load_all(out.getvalue())] == ["Deployment", "Service",
                                                                        "PodDisruptionBudget"]
