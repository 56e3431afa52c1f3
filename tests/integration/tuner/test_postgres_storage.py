"""The study on a real PostgreSQL (harness/postgres.py), the storage the chart's
`tuner.storage.type=postgresql` points the tuner at.

- `kvpilot tune --offline` keeps its study there, and a rerun resumes it;
- a run SIGKILLed mid-trial resumes without losing a complete trial, the cut trial FAIL and its
  config measured again, as on SQLite (tests/unit/tuner/test_study.py);
- optuna-dashboard reads the same study over HTTP;
- `--workers 2` runs the budget on one study, no config measured twice;
- the password, passed in $KVPILOT_TUNER_STORAGE, is on no command line and in no output, for
  `kvpilot tune` and for the in-cluster `kvpilot tuner`, which refuses it in --storage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.postgres import PostgresServer, postgres_server, postgres_url  # noqa: F401 - fixtures
from kvpilot.api.vocabulary import ENV_TUNER_STORAGE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
STUDY = "pg-offline"
# Small and quick: a trial takes well under a second on the twin at 20 s of virtual arrivals.
TUNE = ["tune", "--offline", "--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "-q",
        "--workload", "prompt=256,output=32", "--slo", "ttft=0.5,itl=0.05", "--report", "",
        "--study-name", STUDY]


def _env(storage: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(ENV_TUNER_STORAGE, None)
    if storage is not None:
        env[ENV_TUNER_STORAGE] = storage
    return env


def kvpilot(*argv: str, storage: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`kvpilot ARGV` with the storage URL in the environment, never on the command line."""
    return subprocess.run([sys.executable, "-m", "kvpilot.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=_env(storage), timeout=timeout)


def trials(url: str, name: str = STUDY) -> list:  # type: ignore[type-arg]
    import optuna

    return list(optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False))


def wait_for(pred, timeout: float, what: str, interval: float = 0.1) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


def test_offline_study_lives_in_postgres_and_a_rerun_resumes_it(
    postgres_url: str, postgres_server: PostgresServer, tmp_path: Path  # noqa: F811
) -> None:
    from optuna.trial import TrialState

    first = kvpilot(*TUNE, "--trials", "3", "--probe-seconds", "20", storage=postgres_url, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    done = trials(postgres_url)
    assert [t.state for t in done] == [TrialState.COMPLETE] * 3
    # What is printed names the storage with its password masked.
    assert postgres_server.password not in first.stdout + first.stderr
    assert f"kvpilot:***@127.0.0.1:{postgres_server.port}" in first.stderr
    # The rerun opens the same study, says so, and adds only the trials the larger budget asks for.
    again = kvpilot(*TUNE, "--trials", "5", "--probe-seconds", "20", storage=postgres_url, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming: 3 trials done" in again.stderr
    after = trials(postgres_url)
    assert [t.state for t in after] == [TrialState.COMPLETE] * 5
    assert [t.params for t in after[:3]] == [t.params for t in done]
    assert not (tmp_path / "out").exists(), "the SQLite default was used instead of the PostgreSQL study"


def test_a_run_killed_mid_trial_measures_the_cut_trial_again_under_its_number(
    postgres_url: str, tmp_path: Path  # noqa: F811
) -> None:
    from optuna.trial import TrialState

    # Longer probes: a trial runs for seconds, so the run is caught mid-trial.
    args = [*TUNE, "--trials", "4", "--probe-seconds", "120"]
    log = (tmp_path / "killed.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=tmp_path, env=_env(postgres_url))
    def measuring(ts: list[Any]) -> bool:
        # A trial in progress whose whole config is drawn (a trial just asked for has no params yet, and
        # the sampler draws them one by one: a kill between two draws leaves a partial config).
        return any(t.state == TrialState.COMPLETE for t in ts) and ts[-1].state == TrialState.RUNNING \
            and set(ts[-1].params) >= {"maxNumBatchedTokens", "gpuMemoryUtilization", "maxNumSeqs"}

    try:
        def complete_and_running() -> bool:
            assert proc.poll() is None, f"the run ended before it was killed: {(tmp_path / 'killed.log').read_text()}"
            try:
                return measuring(trials(postgres_url))
            except KeyError:  # the study is not created yet
                return False

        # Freeze the run where the study shows a trial in progress, then kill it there: a SIGKILL
        # sent on a stale look could land between two trials.
        while True:
            wait_for(complete_and_running, 180, "a complete trial and one in progress")
            proc.send_signal(signal.SIGSTOP)
            if measuring(trials(postgres_url)):
                proc.kill()
                break
            proc.send_signal(signal.SIGCONT)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
    before = trials(postgres_url)
    complete = [t for t in before if t.state == TrialState.COMPLETE]
    cut = before[-1]
    assert complete and cut.state == TrialState.RUNNING and cut.params

    resumed = kvpilot(*args, storage=postgres_url, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming: {len(complete)} trials done" in resumed.stderr
    after = trials(postgres_url)
    # Every trial complete before the kill is kept as it was.
    for t in complete:
        kept = after[t.number]
        assert (kept.state, kept.params, kept.value) == (TrialState.COMPLETE, t.params, t.value)
    # The cut trial is measured again under its own number, with its config: the rerun's study is
    # the one a run never killed would have made, no trial failed.
    redo = after[cut.number]
    assert redo.state == TrialState.COMPLETE and redo.params == cut.params
    assert redo.user_attrs["source"] == cut.user_attrs.get("source", "sampler")
    assert [t.state for t in after] == [TrialState.COMPLETE] * 4


def test_two_workers_run_the_budget_on_one_study_without_measuring_a_config_twice(
    postgres_url: str, tmp_path: Path  # noqa: F811
) -> None:
    from optuna.trial import TrialState

    run = kvpilot(*TUNE, "--trials", "10", "--probe-seconds", "20", "--workers", "2", storage=postgres_url,
                  cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    every = trials(postgres_url)
    measured = [t for t in every if t.state == TrialState.COMPLETE]
    # The budget, no more (each worker runs its share) and no less.
    assert len(measured) == 10
    assert not [t for t in every if t.state == TrialState.RUNNING]
    configs = [tuple(sorted(t.user_attrs["engine"].items())) for t in measured]
    assert len(set(configs)) == len(configs), "a config was measured twice"
    # Failed trials are only drawn duplicates, given back before they were measured.
    assert all(t.user_attrs.get("reason") == "Duplicate" for t in every if t.state == TrialState.FAIL)
    # A rerun with the same budget finds it spent.
    again = kvpilot(*TUNE, "--trials", "10", "--probe-seconds", "20", "--workers", "2", storage=postgres_url,
                    cwd=tmp_path)
    assert again.returncode == 0 and "resuming: 10 trials done" in again.stderr
    assert len(trials(postgres_url)) == len(every)


def test_optuna_dashboard_reads_the_study_kvpilot_keeps_in_postgres(
    postgres_url: str, tmp_path: Path  # noqa: F811
) -> None:
    """optuna-dashboard over the same storage, as a user would open it: the study, its trials and the
    engine each one measured, over real HTTP."""
    import json
    import urllib.request

    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is in kvpilot's test extra")
    from harness.prometheus import free_port

    run = kvpilot(*TUNE, "--trials", "3", "--probe-seconds", "20", storage=postgres_url, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    port = free_port()
    serve = ("import os, sys; from optuna_dashboard import run_server; "
             f"run_server(os.environ['{ENV_TUNER_STORAGE}'], host='127.0.0.1', port=int(sys.argv[1]))")
    log = (tmp_path / "dashboard.log").open("w")
    dashboard = subprocess.Popen([sys.executable, "-c", serve, str(port)], stdout=log, stderr=subprocess.STDOUT,
                                 cwd=tmp_path, env=_env(postgres_url))

    def get(path: str) -> dict:  # type: ignore[type-arg]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            body: dict = json.loads(resp.read())  # type: ignore[type-arg]
            return body

    def listing() -> bool:
        assert dashboard.poll() is None, (tmp_path / "dashboard.log").read_text()[-3000:]
        try:
            get("/api/studies")
            return True
        except OSError:
            return False

    try:
        wait_for(listing, 60, "optuna-dashboard's /api/studies")
        studies = get("/api/studies")["study_summaries"]
        assert [s["study_name"] for s in studies] == [STUDY]
        detail = get(f"/api/studies/{studies[0]['study_id']}")
        assert [t["state"] for t in detail["trials"]] == ["Complete"] * 3
        engines = [{a["key"]: a["value"] for a in t["user_attrs"]}["engine"] for t in detail["trials"]]
        assert all("maxNumBatchedTokens" in json.loads(e) for e in engines), engines
        assert detail["best_trials"], "no best trial: the dashboard did not read the values"
    finally:
        dashboard.terminate()
        try:
            dashboard.wait(15)
        except subprocess.TimeoutExpired:
            dashboard.kill()
            dashboard.wait(10)
        log.close()


@pytest.fixture
def prometheus() -> Iterator[str]:
    from harness.prometheus import PrometheusServer, require_prometheus

    require_prometheus()
    with PrometheusServer(targets=[]) as prom:
        yield prom.url


def test_incluster_tuner_reads_the_postgres_url_from_the_environment_and_never_shows_its_password(
    postgres_url: str, postgres_server: PostgresServer, prometheus: str, tmp_path: Path  # noqa: F811
) -> None:
    """The chart's postgresql path: the Secret's URL reaches `kvpilot tuner` as $KVPILOT_TUNER_STORAGE."""
    from harness.kmock_api import KMockAPI, kopf_operator

    password = postgres_server.password
    # Given on the command line, the URL is refused before anything connects, without echoing it.
    refused = kvpilot("tuner", "--storage", postgres_url, "--prometheus", prometheus, storage=None, cwd=tmp_path,
                      timeout=60)
    assert refused.returncode == 2
    assert f"pass the URL in ${ENV_TUNER_STORAGE} instead" in refused.stderr
    assert password not in refused.stdout + refused.stderr

    (tmp_path / "operator").mkdir()
    with KMockAPI() as api, kopf_operator(api, tmp_path / "operator"):
        ns = "tuning"
        api.create_isvc({
            "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "tuned", "namespace": ns},
            "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1,
                     "engine": {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256},
                     "tuning": {"enabled": True, "maxTrials": 3, "trialSeconds": 10, "warmupSeconds": 0}},
        })
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=ns)
        log_path = tmp_path / "tuner.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", prometheus,
                 "--metrics-port", "0", "--resync", "1", "--poll", "1"],
                stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                env={**_env(postgres_url), "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"},
            )
        try:
            import optuna

            def study_in_postgres() -> bool:
                assert proc.poll() is None, f"tuner exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                return any(s.study_name.startswith(f"{ns}.tuned.") for s in
                           optuna.get_all_study_summaries(storage=postgres_url))

            wait_for(study_in_postgres, 90, "the tuner's study in PostgreSQL", interval=0.5)
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
            assert password not in cmdline and "postgresql" not in cmdline
            assert password not in log_path.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        assert password not in log_path.read_text()
