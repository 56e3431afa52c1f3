"""The replica planner in a real `kvpilot tuner` process: KMock (with the scale subresource) and a real
`kvpilot operator`, a real Prometheus scraping two synthetic vLLM engines whose request rate the test sets.

Raising the load of a service with `actor: kvpilot` makes the tuner write spec.replicas up through the
scale subresource (field manager kvpilot-planner, so the operator's Scaled Event names it), post a
LoadRising Event, set the Scaling condition and publish the count on its /metrics; for `actor: external`
the published count moves and spec.replicas does not.  Before any load is scraped the count is held.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.kmock_api import KMockAPI, OperatorProcess, free_port, wait_for
from harness.prometheus import PrometheusServer, require_prometheus
from harness.synthetic_vllm import SyntheticVllm
from harness.tuner_process import stop_cleanly
from kvpilot.api import vllm
from kvpilot.api.vocabulary import SERIES_LABEL_INFERENCESERVICE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NS = "autoscaling"
REPO = Path(__file__).resolve().parents[3]
LOW, HIGH = 2.0, 80.0  # req/s: well under one replica's capacity; several replicas' worth


def _isvc(name: str, actor: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1,
                 "engine": {"maxNumBatchedTokens": 2048, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 256},
                 # Room above any forecast, and a pace that lets it through in one step: the reason is then
                 # the load's, not a limit's.
                 "autoscaling": {"actor": actor, "minReplicas": 1, "maxReplicas": 100, "behavior": {
                     "scaleUp": {"policies": [{"type": "Pods", "value": 100, "periodSeconds": 15}]}}}},
    }


@contextmanager
def tuner(api: KMockAPI, prom: PrometheusServer, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    port = free_port()
    log_path = tmp_path / "tuner.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.cli", "tuner", "--prometheus", prom.url, "--namespace", NS,
             "--storage", f"sqlite:///{tmp_path / 'tuner.db'}", "--metrics-port", str(port), "--resync", "1",
             "--scrape-interval", "1"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            env={**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"})
    try:
        yield proc, port, log_path
    finally:
        stop_cleanly(proc, log_path.read_text)


def gauges(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except urllib.error.URLError:
        return {}  # not listening yet
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def desired(port: int, name: str) -> float | None:
    return gauges(port).get(("kvpilot_desired_replicas", (("inferenceservice", name), ("namespace", NS))))


def reason_of(port: int, name: str) -> str | None:
    on = [dict(labels)["reason"] for (metric, labels), v in gauges(port).items()
          if metric == "kvpilot_autoscaling_decision" and dict(labels).get("inferenceservice") == name and v == 1]
    return on[0] if len(on) == 1 else None


def planner_events(api: KMockAPI, name: str) -> list[dict[str, Any]]:
    return [e for e in api.events(NS) if e.get("source", {}).get("component") == "kvpilot-planner"
            and e.get("involvedObject", {}).get("name") == name]


def test_load_rising_scales_up_through_the_scale_subresource_and_external_only_publishes(
        api: KMockAPI, operator: OperatorProcess, tmp_path: Path) -> None:
    require_prometheus()
    with ExitStack() as stack:
        engines = {name: stack.enter_context(SyntheticVllm(LOW, tokens=(512, 128))) for name in ("acting", "external")}
        prom = stack.enter_context(PrometheusServer(scrape_configs=[
            {"job_name": name, "static_configs": [{"targets": [engine.target], "labels": {
                "namespace": NS, SERIES_LABEL_INFERENCESERVICE: name}}]} for name, engine in engines.items()]))
        # The planner's 4 s rate window full of the steady low load before it first reads: a rate still
        # filling in reads as a rising trend, which its forecast would act on.
        prom.wait_for(f"min(count_over_time({vllm.METRIC_TTFT}_count[10s])) >= 8", timeout=30)
        api.create_isvc(_isvc("acting", "kvpilot"))
        api.create_isvc(_isvc("external", "external"))
        proc, port, log_path = stack.enter_context(tuner(api, prom, tmp_path))

        def alive() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"tuner exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            return True

        # At the low load one replica carries it: both published, nothing written.
        def at_demand(name: str) -> bool:
            return alive() and desired(port, name) == 1 and reason_of(port, name) == "AtDemand"

        for name in engines:
            wait_for(lambda: at_demand(name), timeout=90, interval=0.5, what=f"{name}: 1 replica desired, AtDemand")  # noqa: B023
        assert api.get_isvc(NS, "acting")["spec"]["replicas"] == 1
        assert planner_events(api, "acting") == []
        # The GPUs one replica holds, for the dashboard's GPUs against load (tensorParallelSize 1 here).
        assert gauges(port).get(("kvpilot_replica_gpus", (("inferenceservice", "acting"), ("namespace", NS)))) == 1

        for engine in engines.values():
            engine.set_rate(HIGH)
        acting = wait_for(lambda: alive() and (o := api.get_isvc(NS, "acting"))["spec"]["replicas"] > 1 and o,
                          timeout=60, interval=0.5, what="acting: spec.replicas written up")
        # Through the scale subresource, under the planner's name.
        (owner,) = [f for f in acting["metadata"]["managedFields"] if "f:replicas" in f["fieldsV1"].get("f:spec", {})]
        assert (owner["manager"], owner["subresource"]) == ("kvpilot-planner", "scale")
        ev = wait_for(lambda: [e for e in planner_events(api, "acting") if e["reason"] == "LoadRising"],
                      timeout=30, what="a LoadRising Event")
        assert ev[0]["type"] == "Normal" and ev[0]["message"].startswith("Scaling from 1 to "), ev
        wait_for(lambda: alive() and (desired(port, "acting") or 0) > 1, timeout=30, what="the gauge up")
        cond = wait_for(lambda: [c for c in (api.get_isvc(NS, "acting").get("status") or {}).get("conditions", [])
                                 if c["type"] == "Scaling"], timeout=30, what="the Scaling condition")
        assert cond[0]["status"] == "True" and cond[0]["lastTransitionTime"], cond
        # The operator's Scaled Event names the planner.
        wait_for(lambda: any("written by kvpilot-planner through the scale subresource" in e.get("message", "")
                             for e in api.events(NS) if e.get("reason") == "Scaled"), timeout=60,
                 what="the operator's Scaled Event naming kvpilot-planner")

        # External: the published count moves, spec.replicas is not the planner's to write.
        wait_for(lambda: alive() and (desired(port, "external") or 0) > 1, timeout=60, interval=0.5,
                 what="external: the gauge up")
        external = api.get_isvc(NS, "external")
        assert external["spec"]["replicas"] == 1
        assert planner_events(api, "external") == []
        assert not [c for c in (external.get("status") or {}).get("conditions", []) if c["type"] == "Scaling"]
        assert ("PATCH", f"/apis/kvpilot.dev/v1alpha1/namespaces/{NS}/inferenceservices/external/scale") \
            not in api.calls
