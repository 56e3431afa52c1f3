"""`kvpilot tuner` as a process, against KMock with the operator running and a real Prometheus.

No engine pods exist here (KMock runs no containers), so Prometheus has no traffic to show: the
tuner must pick the service up, say so in status.tuning (phase Paused), serve its metrics, and
never touch the engine - the "never change the engine blind" rule, end to end.  It must also
stop promptly on SIGTERM while paused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.kmock_api import KMockAPI, OperatorProcess, free_port, wait_for
from harness.prometheus import PrometheusServer, require_prometheus
from harness.tuner_process import stop_cleanly

pytestmark = pytest.mark.integration

NS = "tuning"
REPO = Path(__file__).resolve().parents[3]


def _isvc(name: str, enabled: bool, **tuning: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1,
                 "engine": {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256},
                 "tuning": {"enabled": enabled, "maxTrials": 3, "trialSeconds": 10, "warmupSeconds": 0, **tuning}},
    }


@dataclass
class TunerProcess:
    proc: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int

    def log(self) -> str:
        return self.log_path.read_text()

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"tuner exited {self.proc.returncode}:\n{self.log()[-3000:]}")


@contextmanager
def tuner_process(api: KMockAPI, prom: PrometheusServer, tmp_path: Path, poll: float) -> Iterator[TunerProcess]:
    """`kvpilot tuner` as the chart runs it (the storage URL from the environment); stopped with SIGTERM,
    which it must obey promptly and cleanly (exit 0), whatever the test found."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    metrics_port = free_port()
    log_path = tmp_path / "tuner.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", prom.url,
             "--metrics-port", str(metrics_port), "--resync", "1", "--poll", str(poll)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            # The storage comes from the environment, as the chart passes it (test_chart_tenancy.py).
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                 "KVPILOT_TUNER_STORAGE": f"sqlite:///{tmp_path / 'tuner.db'}"},
        )
    tuner = TunerProcess(proc, log_path, metrics_port)
    try:
        yield tuner
    finally:
        stop_cleanly(proc, tuner.log)


def test_tuner_process_pauses_without_traffic_and_leaves_the_engine_alone(
    api: KMockAPI, operator: OperatorProcess, tmp_path: Path
) -> None:
    require_prometheus()
    with PrometheusServer(targets=[]) as prom:
        api.create_isvc(_isvc("tuned", True))
        api.create_isvc(_isvc("untouched", False))
        # A tenant naming a database of its choosing (KMock has no CRD schema to refuse the field):
        # the cluster-wide tuner must never open it.
        tenant_db = tmp_path / "tenant" / "chosen.db"
        api.create_isvc(_isvc("tenant", True, storage=f"sqlite:///{tenant_db}"))
        with tuner_process(api, prom, tmp_path, poll=1) as tuner:
            def tuning(name: str) -> dict[str, Any]:
                return dict((api.get_isvc(NS, name).get("status") or {}).get("tuning") or {})

            def paused() -> bool:
                tuner.alive()
                return tuning("tuned").get("phase") == "Paused"

            wait_for(paused, timeout=90, interval=0.2, what="status.tuning.phase Paused")
            t = tuning("tuned")
            assert t["study"].startswith("tuning.tuned.latency.")
            assert "NoTraffic" in t["message"] or "NoData" in t["message"], t
            assert tuning("untouched") == {}
            wait_for(lambda: f"not tuning {NS}/tenant" in tuner.log(), timeout=30,
                     what="the tuner skipping the tenant's service")
            assert "spec.tuning.storage" in tuner.log()
            assert not tenant_db.parent.exists() and tuning("tenant") == {}
            import optuna

            studies = [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{tmp_path / 'tuner.db'}")]
            assert studies == [t["study"]]
            engine = api.get_isvc(NS, "tuned")["spec"]["engine"]
            assert engine == {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256}
            with urllib.request.urlopen(f"http://127.0.0.1:{tuner.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            assert "# TYPE kvpilot_tuning_trials_total counter" in text
            assert "# TYPE kvpilot_tuning_best_value gauge" in text
        # Still nothing applied: the engine fields are as the user wrote them, no trial annotation.
        obj = api.get_isvc(NS, "tuned")
        assert "kvpilot.dev/tuning-trial" not in (obj["metadata"].get("annotations") or {})


def test_the_budget_gate_holds_trials_back_says_why_and_follows_a_changed_spec(
    api: KMockAPI, operator: OperatorProcess, tmp_path: Path
) -> None:
    """Outside its maintenance window the tuner never starts a trial: status.tuning Paused/OutsideWindow,
    the Tuning condition False with that reason, one Event (not one per poll), kvpilot_tuning_paused.
    Removing the window applies to the running study at once; with no budget recording in Prometheus
    the gate then says BudgetUnknown rather than guess that the budget is full."""
    import datetime as dt

    require_prometheus()
    # A one-minute window three days away: the test cannot be inside it.
    day = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")[(dt.datetime.now(dt.UTC).weekday() + 3) % 7]
    gate = {"minRemaining": 0.5, "timeZone": "Europe/Berlin", "windows": [{"days": [day], "start": "12:00",
                                                                           "end": "12:01"}]}
    with PrometheusServer(targets=[]) as prom:
        api.create_isvc(_isvc("gated", True, budgetGate=gate))
        with tuner_process(api, prom, tmp_path, poll=0.5) as tuner:
            def tuning() -> dict[str, Any]:
                tuner.alive()
                return dict((api.get_isvc(NS, "gated").get("status") or {}).get("tuning") or {})

            def condition() -> dict[str, Any]:
                conds = (api.get_isvc(NS, "gated").get("status") or {}).get("conditions") or []
                return next((c for c in conds if c.get("type") == "Tuning"), {})

            def gate_events(reason: str) -> list[dict[str, Any]]:
                return [e for e in api.events(NS) if e.get("involvedObject", {}).get("name") == "gated"
                        and e.get("reason") == reason]

            wait_for(lambda: tuning().get("reason") == "OutsideWindow", timeout=90, interval=0.2,
                     what="status.tuning.reason OutsideWindow")
            assert tuning()["phase"] == "Paused"
            assert f"{day} 12:00-12:01 Europe/Berlin" in tuning()["message"]
            wait_for(lambda: condition().get("reason") == "OutsideWindow", timeout=30, interval=0.2,
                     what="the Tuning condition")
            assert condition()["status"] == "False"
            # Several polls later: still one Event for the pause.
            polls_then = tuner.log().count("reason=OutsideWindow")
            wait_for(lambda: tuner.log().count("reason=OutsideWindow") >= polls_then + 4, timeout=30,
                     what="more polls while paused")
            assert len(gate_events("OutsideWindow")) == 1
            with urllib.request.urlopen(f"http://127.0.0.1:{tuner.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            assert 'kvpilot_tuning_paused{name="gated",namespace="tuning",reason="OutsideWindow"} 1.0' in text
            assert 'kvpilot_tuning_paused{name="gated",namespace="tuning",reason="BudgetLow"} 0.0' in text

            # The user drops the window: the same worker reads the budget now, which Prometheus lacks.
            api.patch(api.isvc_path(NS, "gated"), {"spec": {"tuning": {"budgetGate": {"windows": []}}}})
            wait_for(lambda: tuning().get("reason") == "BudgetUnknown", timeout=30, interval=0.2,
                     what="status.tuning.reason BudgetUnknown")
            assert len(gate_events("BudgetUnknown")) == 1
            assert f"not tuning {NS}/gated" not in tuner.log()
            engine = api.get_isvc(NS, "gated")["spec"]["engine"]
            assert engine == {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256}
        assert "kvpilot.dev/tuning-trial" not in (api.get_isvc(NS, "gated")["metadata"].get("annotations") or {})
