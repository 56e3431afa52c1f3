"""`kvpilot tune --local` as a user runs it, a real process with a real `kvpilot twin serve` engine:
SIGTERM stops the engine with it, a Prometheus that never shows the engine ends the run with a reason,
a finished run writes its report, and a warm start on a measured device tries the twin's picks first."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from harness.live_tuning import BackgroundLoad
from harness.prometheus import PrometheusServer, require_prometheus
from kvpilot.tuner.adapters.local import free_port
from tests.support.tiny_device import PROFILE, tiny_model_dir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]
ENGINE = [sys.executable, "-m", "kvpilot.cli", "twin", "serve", "--model", "Qwen2.5-0.5B", "--gpu", "H100-80GB",
          "--max-model-len", "4096", "--shutdown-timeout", "2", "--max-num-batched-tokens", "512",
          "--gpu-memory-utilization", "0.8", "--max-num-seqs", "16"]


def answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_until(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def tune_local(tmp_path: Path, port: int, slots: tuple[int, int], *extra: str) -> Iterator[subprocess.Popen[str]]:
    log = (tmp_path / "tune.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.cli", "tune", "--local", "--storage", f"sqlite:///{tmp_path}/s.db",
         "--slots", f"{slots[0]},{slots[1]}", *extra, "--", *ENGINE, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        # Whatever the outcome, no engine this test started outlives it.
        for pid in re.findall(r"started engine pid (\d+)", (tmp_path / "tune.log").read_text()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)


def test_sigterm_stops_the_engine_it_started(tmp_path: Path) -> None:
    port, slots, dead = free_port(), (free_port(), free_port()), free_port()
    with tune_local(tmp_path, port, slots, "--prometheus", f"http://127.0.0.1:{dead}", "--poll", "0.2",
                    "--report", "") as proc:
        wait_until(lambda: healthy(port), 90, "the engine behind the forwarder")
        assert answers(slots[0])
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode != 0
        assert not answers(slots[0]), "the engine outlived `kvpilot tune --local` on its port"
        assert not answers(port)
        assert "Traceback" not in (tmp_path / "tune.log").read_text()


def test_a_prometheus_that_never_answers_ends_the_run_with_the_reason(tmp_path: Path) -> None:
    port, slots, dead = free_port(), (free_port(), free_port()), free_port()
    with tune_local(tmp_path, port, slots, "--prometheus", f"http://127.0.0.1:{dead}", "--poll", "0.2",
                    "--signals-timeout", "2", "--report", "") as proc:
        proc.wait(120)
        err = (tmp_path / "tune.log").read_text()
        assert proc.returncode == 2, err[-2000:]
        assert f"Prometheus at http://127.0.0.1:{dead}" in err and "check --prometheus" in err
        assert "Traceback" not in err
        assert not answers(slots[0])


def test_a_finished_run_writes_its_report(tmp_path: Path) -> None:
    require_prometheus()
    port, slots = free_port(), (free_port(), free_port())
    prom = PrometheusServer(targets=[f"127.0.0.1:{p}" for p in slots], job="twin")
    prom.start()
    # Open loop at 12 req/s of short requests (what the live-loop test sends).
    load = BackgroundLoad(f"http://127.0.0.1:{port}", rate=12.0, seed=5, max_tokens=16, prompt_words=32,
                          request_timeout_s=30.0)
    try:
        with tune_local(tmp_path, port, slots, "--prometheus", prom.url, "--selector", 'job="twin"',
                        "--slo", "ttft=0.25,itl=0.1", "--trials", "1", "--warmup", "1", "--window", "3",
                        "--poll", "0.5", "--fast-burn-window", "3", "--report", "out/local.html") as proc:
            wait_until(lambda: healthy(port), 90, "the engine behind the forwarder")
            load.start()
            out, _ = proc.communicate(timeout=240)
            err = (tmp_path / "tune.log").read_text()
            assert proc.returncode == 0, err[-3000:]
    finally:
        load.stop()
        prom.stop()
    assert "maxNumBatchedTokens" in out
    text = (tmp_path / "out" / "local.html").read_text()
    assert "p99 TTFT &lt;= 0.25 s, p99 ITL &lt;= 0.1 s" in text
    assert "the worse of p99 TTFT / SLO and p99 ITL / SLO over a 3 s window" in text


def test_a_canary_run_measures_the_trial_engine_beside_the_stable_one(tmp_path: Path) -> None:
    from tests.integration.tuner.test_canary_local import Load

    require_prometheus()
    port, slots, canary = free_port(), (free_port(), free_port()), free_port()
    tracks = {"stable": [f"127.0.0.1:{p}" for p in slots], "canary": [f"127.0.0.1:{canary}"]}
    prom = PrometheusServer(scrape_configs=[
        {"job_name": f"twin-{track}",
         "static_configs": [{"targets": targets, "labels": {"job": "twin", "kvpilot_dev_track": track}}]}
        for track, targets in tracks.items()])
    prom.start()
    load = Load(f"http://127.0.0.1:{port}")
    try:
        # Trial 0 is the engine in force (measured in place), trial 1 vLLM's defaults: a canary.
        with tune_local(tmp_path, port, slots, "--prometheus", prom.url, "--selector", 'job="twin"',
                        "--slo", "ttft=0.25,itl=0.1", "--trials", "2", "--warmup", "1", "--window", "6",
                        "--poll", "3", "--fast-burn-window", "6", "--report", "", "--trial-strategy", "canary",
                        "--canary-port", str(canary), "--canary-weight", "0.25") as proc:
            wait_until(lambda: healthy(port), 90, "the engine behind the forwarder")
            t0 = time.monotonic()
            load.start()
            out, _ = proc.communicate(timeout=240)
            ended = time.monotonic() - t0
            err = (tmp_path / "tune.log").read_text()
            assert proc.returncode == 0, err[-3000:]
    finally:
        load.stopping = True
        prom.stop()
    result = load.stop()
    # The run's own end takes the forwarder down: requests from its last seconds on may fail.  None before.
    failed = [r for r in result.failed() if r.start < ended - 5.0]
    assert "canary pid" in err and f"on port {canary} takes 25% of new connections" in err
    assert f"canary on port {canary} stopped" in err
    assert "Traceback" not in err
    assert not answers(canary), "the canary outlived the run"
    assert not failed, [(r.index, r.error) for r in failed[:5]]
    assert "maxNumBatchedTokens" in out


def test_a_warm_start_on_a_measured_device_tries_the_twins_best_first(tmp_path: Path) -> None:
    """`--warm-start --device-profile`: the twin of the engine's own model (a local config.json) on the CPU
    profile fitted on real vLLM is searched under the workload Prometheus shows; its picks are the
    trials after the engine in force, at the search space's configs."""
    require_prometheus()
    model = tiny_model_dir(tmp_path)
    port, slots = free_port(), (free_port(), free_port())
    prom = PrometheusServer(targets=[f"127.0.0.1:{p}" for p in slots], job="twin")
    prom.start()
    load = BackgroundLoad(f"http://127.0.0.1:{port}", rate=4.0, seed=5, max_tokens=16, prompt_words=64,
                          request_timeout_s=30.0)
    # The engine is the twin of the same model on the same device (what the warm start models).
    engine = [sys.executable, "-m", "kvpilot.cli", "twin", "serve", "--model-config", str(model),
              "--device-profile", str(PROFILE), "--max-model-len", "2048", "--shutdown-timeout", "2",
              "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.1", "--max-num-seqs", "8"]
    log = (tmp_path / "tune.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.cli", "tune", "--local", "--storage", f"sqlite:///{tmp_path}/s.db",
         "--slots", f"{slots[0]},{slots[1]}", "--prometheus", prom.url, "--selector", 'job="twin"',
         "--slo", "ttft=1.0,itl=0.1", "--trials", "2", "--warmup", "2", "--window", "3", "--poll", "0.5",
         "--fast-burn-window", "3", "--report", "", "--warm-start", "--warm-start-trials", "4",
         "--model", str(model), "--device-profile", str(PROFILE), "--max-model-len", "2048",
         "--tokens", "64:2048", "--util", "0.10:0.20", "--seqs", "4:16", "--", *engine, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        wait_until(lambda: healthy(port), 90, "the engine behind the forwarder")
        load.start()
        out, _ = proc.communicate(timeout=300)
        err = (tmp_path / "tune.log").read_text()
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        load.stop()
        prom.stop()
        for pid in re.findall(r"started engine pid (\d+)", (tmp_path / "tune.log").read_text()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)
    assert "warm start: the twin's best" in err and "Traceback" not in err
    # Two live trials: the engine in force, then the twin's first pick (before vLLM's defaults).  The
    # table is on stderr (stdout is the block alone): its rows follow the header and its rule.
    table = err[err.index("  #  tokens"):].splitlines()[2:]
    rows = []
    for line in table:
        if not line.strip()[:1].isdigit():
            break
        rows.append(line.split())
    assert sorted(r[-1] for r in rows) == ["current", "warmStart"], err[-3000:]
    assert yaml.safe_load(out)["spec"]["engine"], out
