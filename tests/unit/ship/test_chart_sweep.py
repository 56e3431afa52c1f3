"""The chart's offline sweep (sweep.enabled): `kvpilot tune --offline --join` in the pods of a Job
with `parallelism` N on the tuner's PostgreSQL study.  Rendered offline with Helm's own engine; the
value set "sweep" (chart.py) also runs through test_chart.py's lint, strict Kubernetes validation
(1.30 and 1.33), restricted Pod Security Standard and resources checks.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from harness.chart import CHART, NAMESPACE, RELEASE, VALUE_SETS, find, one, render, validate_values

helm_python = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is not installed (pip install -e '.[test]')"
)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed"
)

POSTGRES = {"storage": {"type": "postgresql", "postgresql": {"existingSecret": "kvpilot-optuna-db"}}}
DB_EGRESS = {"to": [{"ipBlock": {"cidr": "10.0.5.7/32"}}], "ports": [{"port": 5432, "protocol": "TCP"}]}
# The sweep with NetworkPolicies on, the database reached through the tuner's extra egress.
WITH_POLICIES = {**VALUE_SETS["sweep"], "networkPolicy": {"enabled": True, "tuner": {"extraEgress": [DB_EGRESS]},
                                                          "engine": {"enabled": False}}}


def _job(values: dict[str, Any] | str = "sweep") -> dict[str, Any]:
    return one(render(values), "Job")


def _container(job: dict[str, Any]) -> dict[str, Any]:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_no_sweep_by_default() -> None:
    assert find(render("default"), "Job") == []
    assert find(render("postgresql"), "Job") == []


@pytest.mark.parametrize("kube_version", ["1.30", "1.33"])
def test_the_job_renders_and_validates_strictly(kube_version: str) -> None:
    for obj in (_job(), one(render(WITH_POLICIES), "NetworkPolicy", "-sweep")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an unknown field is a failure
            kubernetes_validate.validate(obj, kube_version, strict=True)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_parallelism_and_completions_are_the_pods_asked_for(n: int) -> None:
    job = _job({"tuner": POSTGRES, "sweep": {"enabled": True, "parallelism": n, "trials": 10}})
    spec = job["spec"]
    # Each pod works until the study's budget is finished: as many completions as pods.
    assert spec["parallelism"] == spec["completions"] == n
    assert spec["backoffLimit"] == 6 and spec["ttlSecondsAfterFinished"] == 86400
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False


def test_the_pods_run_the_offline_question_joined_with_the_study_budget() -> None:
    from kvpilot.cli import build_parser

    c = _container(_job())
    args = c["args"]
    parsed = build_parser().parse_args(args)  # the real CLI accepts what the chart writes
    assert parsed.offline and parsed.join
    assert parsed.trials == 45 and parsed.study_name == "llama-h100-chat"
    assert (parsed.model, parsed.gpu, parsed.workload, parsed.slo) == (
        "Llama-3.1-8B", "H100-80GB", "chat", "ttft=0.5,itl=0.05")
    assert (parsed.heartbeat_interval, parsed.grace_period) == (10, 60)
    assert parsed.report == ""  # no report file on the read-only root
    # The URL with its password comes from the tuner's Secret, never on the command line.
    (env,) = c["env"]
    assert env == {"name": "KVPILOT_TUNER_STORAGE",
                   "valueFrom": {"secretKeyRef": {"name": "kvpilot-optuna-db", "key": "url"}}}
    assert [a for a in args if "storage" in a.lower() or "$(" in a] == []


def test_the_pods_have_the_tuner_pod_security() -> None:
    objects = render("sweep")
    job_pod = one(objects, "Job")["spec"]["template"]["spec"]
    tuner_pod = one(objects, "Deployment", "-tuner")["spec"]["template"]["spec"]
    assert job_pod["securityContext"] == tuner_pod["securityContext"]
    assert job_pod["containers"][0]["securityContext"] == tuner_pod["containers"][0]["securityContext"]
    assert job_pod["containers"][0]["image"] == tuner_pod["containers"][0]["image"]


def test_other_sweep_values_are_another_job() -> None:
    """A Job's pod template cannot change: `helm upgrade` with another question creates a new Job."""
    a = _job()["metadata"]["name"]
    values = {**VALUE_SETS["sweep"], "sweep": {**VALUE_SETS["sweep"]["sweep"], "trials": 90}}
    b = _job(values)["metadata"]["name"]
    assert a != b and a.startswith("kvp-kvpilot-sweep-") and len(a) <= 63


def test_the_sweep_pods_reach_only_dns_and_the_database() -> None:
    # Off by default, as every policy but the webhook's own.
    assert [p["metadata"]["name"] for p in find(render("sweep"), "NetworkPolicy")] == ["kvp-kvpilot-webhook"]
    policy = one(render(WITH_POLICIES), "NetworkPolicy", "-sweep")
    labels = _job()["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["ingress"] == []
    assert DB_EGRESS in policy["spec"]["egress"]


def test_sweep_with_sqlite_is_refused_naming_the_setting(tmp_path: Path) -> None:
    values = {"sweep": {"enabled": True}}
    with pytest.raises(helm_python.HelmValuesError, match="/tuner/storage/type"):
        validate_values(values)
    with pytest.raises(helm_python.HelmValuesError, match="/tuner/storage/type"):
        render(values)
    # Past the schema (`helm install --skip-schema-validation`), the template refuses it in words.
    copy = tmp_path / "kvpilot"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    chart = helm_python.Chart.load(str(copy))
    try:
        with pytest.raises(helm_python.HelmError,
                           match=r"sweep.enabled needs tuner.storage.type=postgresql .*SQLite file is locked"):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    finally:
        chart.close()


@pytest.mark.parametrize(
    ("sweep", "where"),
    [
        ({"parallelism": 0}, "/sweep/parallelism"),
        ({"trials": "60"}, "/sweep/trials"),
        ({"args": "--gpu=A100-80GB"}, "/sweep/args"),
        ({"paralelism": 2}, "paralelism"),
    ],
    ids=["zero-pods", "string-trials", "args-not-a-list", "typo"],
)
def test_schema_rejects_bad_sweep_values(sweep: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError, match=where):
        validate_values({"tuner": POSTGRES, "sweep": {"enabled": True, **sweep}})


def test_grace_period_must_exceed_the_heartbeat_interval() -> None:
    with pytest.raises(helm_python.HelmError, match="sweep.gracePeriodSeconds"):
        render({"tuner": POSTGRES, "sweep": {"enabled": True, "heartbeatIntervalSeconds": 30,
                                             "gracePeriodSeconds": 30}})


def test_the_readme_sweep_install_renders_the_job_it_describes() -> None:
    """charts/kvpilot/README.md's `helm upgrade --install ... --set sweep...` renders, and the Job runs its question."""
    import json
    import re
    import shlex

    from kvpilot.cli import build_parser

    text = (CHART / "README.md").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("helm upgrade --install") and "sweep.enabled" in ln]
    argv = shlex.split(line)
    values: dict[str, Any] = {}
    for flag, setting in zip(argv, argv[1:], strict=False):
        if flag not in ("--set", "--set-json"):
            continue
        key, _, raw = setting.partition("=")
        value: Any = json.loads(raw) if flag == "--set-json" else (
            int(raw) if re.fullmatch(r"\d+", raw) else {"true": True, "false": False}.get(raw, raw))
        node = values
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    validate_values(values)
    job = _job(values)
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == values["sweep"]["parallelism"]
    parsed = build_parser().parse_args(_container(job)["args"])
    assert parsed.join and parsed.trials == values["sweep"]["trials"]
    assert parsed.study_name == values["sweep"]["studyName"]
    assert [f"--{k.replace('_', '-')}={getattr(parsed, k)}" for k in ("model", "gpu", "workload", "slo")] \
        == values["sweep"]["args"]
