"""The kvpilot image, built from the Dockerfile with podman (scripts/build-image.sh) and run as the chart
runs it: its own numeric user, a read-only root filesystem and a writable /tmp only.

Slow (a debootstrap base, cached under ~/.cache, and a podman build): marked `image`.  Needs root and
apt on a Debian host to install podman; elsewhere the build script says so and these tests skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.twin_process import free_port

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/kvpilot:test"
CONF = ROOT / "scripts" / "podman" / "containers.conf"
# What the chart sets: pod securityContext runAsUser 65532, readOnlyRootFilesystem, an emptyDir at /tmp.
RUN = ["podman", "run", "--rm", "--runtime", "runc", "--read-only", "--read-only-tmpfs=false",
       "--tmpfs", "/tmp:rw,size=256m"]
VENV_GOAL_MIB = 200


def report(config: pytest.Config, line: str) -> None:
    """A figure for the CI log, whatever the capture mode (the venv's size is what this image is about)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if capture is None or reporter is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def _env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONF)}


def podman_run(*args: str, entrypoint: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [*RUN, *(["--entrypoint", entrypoint] if entrypoint else []), IMAGE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())


@pytest.fixture(scope="session")
def image(pytestconfig: pytest.Config) -> str:
    if os.geteuid() != 0:
        pytest.skip("building the image needs root (debootstrap, podman's rootful storage)")
    proc = subprocess.run([str(ROOT / "scripts" / "build-image.sh")], capture_output=True, text=True,
                          env={**os.environ, "IMAGE": IMAGE}, timeout=3000, cwd=ROOT)
    if proc.returncode == 2:
        pytest.skip(f"cannot build the image here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report(pytestconfig, f"\n{proc.stdout.strip().splitlines()[-1]}")
    return IMAGE


def test_runs_as_the_charts_numeric_user(image: str) -> None:
    proc = podman_run("-c", "import os; print(os.getuid(), os.getgid())", entrypoint="python3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["65532", "65532"]


def test_only_tmp_is_writable(image: str) -> None:
    probe = (
        "import os, json\n"
        "ok = []\n"
        "for d in ['/', '/tmp', '/opt/kvpilot', '/opt/kvpilot/lib', '/etc', '/var', '/var/tmp', '/run', '/root',"
        " '/home', '/usr/local', '/srv']:\n"
        "    if not os.path.isdir(d): continue\n"
        "    try:\n"
        "        open(os.path.join(d, '.w'), 'w').close(); os.remove(os.path.join(d, '.w')); ok.append(d)\n"
        "    except OSError: pass\n"
        "print(json.dumps(ok))\n"
    )
    proc = podman_run("-c", probe, entrypoint="python3")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["/tmp"]
    # As root too, the filesystem itself is read-only: not just permissions.
    as_root = subprocess.run([*RUN, "--user", "0", "--entrypoint", "python3", image, "-c", probe],
                             capture_output=True, text=True, timeout=120, env=_env())
    assert json.loads(as_root.stdout) == ["/tmp"], as_root.stderr


def test_version_and_operator_help(image: str) -> None:
    from kvpilot import __version__

    version = podman_run("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"kvpilot {__version__}"
    helped = podman_run("operator", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "usage: kvpilot operator" in helped.stdout


@pytest.fixture
def twin(image: str) -> Iterator[int]:
    port = free_port()
    name = f"kvpilot-twin-{port}"
    subprocess.run([*RUN, "-d", "--name", name, "--network", "host", image, "twin", "serve",
                    "--model", "Llama-3.1-8B", "--gpu", "H100-80GB", "--host", "127.0.0.1", "--port", str(port)],
                   check=True, capture_output=True, text=True, timeout=120, env=_env())
    try:
        yield port
    finally:
        logs = subprocess.run(["podman", "logs", name], capture_output=True, text=True, env=_env(), timeout=60)
        subprocess.run(["podman", "stop", "-t", "10", name], capture_output=True, env=_env(), timeout=60)
        if logs.returncode == 0 and "Traceback" in logs.stdout + logs.stderr:
            pytest.fail(f"the twin logged a traceback:\n{(logs.stdout + logs.stderr)[-3000:]}")


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read()


def test_twin_serve_answers_health_and_a_completion(twin: int) -> None:
    base = f"http://127.0.0.1:{twin}"
    deadline = time.monotonic() + 90
    while True:
        try:
            status, _ = _get(base + "/health")
            if status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the twin in the container never answered /health"
        time.sleep(0.2)
    body = json.dumps({"model": "Llama-3.1-8B", "prompt": "Hello", "max_tokens": 8}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        out = json.loads(resp.read())
    assert out["object"] == "text_completion"
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["text"]


def test_no_compiler_in_the_final_stage(image: str) -> None:
    compilers = ["gcc", "cc", "c++", "g++", "clang", "tcc", "make", "ld", "as"]
    probe = f"import json, shutil; print(json.dumps({{c: shutil.which(c) for c in {compilers!r}}}))"
    proc = podman_run("-c", probe, entrypoint="python3")
    assert proc.returncode == 0, proc.stderr
    assert {c: p for c, p in json.loads(proc.stdout).items() if p} == {}
    no_pip = podman_run("-c", "import importlib.util as u; print(u.find_spec('pip'))", entrypoint="/opt/kvpilot/bin/python")
    assert no_pip.stdout.strip() == "None", "pip is left in the runtime venv"


def test_the_runtime_venv_holds_what_runs_and_no_more(image: str, pytestconfig: pytest.Config) -> None:
    script = (
        "import importlib.util as u, json, subprocess\n"
        "from kvpilot.tuner.storage import check_storage_url\n"
        "check_storage_url('postgresql://kv:pw@db:5432/kv')\n"  # the chart's postgresql storage: driver present
        "mib = int(subprocess.run(['du', '-sm', '/opt/kvpilot'], capture_output=True, text=True).stdout.split()[0])\n"
        "print(json.dumps({'mib': mib, 'absent': [m for m in ('matplotlib', 'kubernetes', 'pytest')"
        " if u.find_spec(m) is None]}))\n"
    )
    proc = podman_run("-c", script, entrypoint="/opt/kvpilot/bin/python")
    assert proc.returncode == 0, proc.stderr
    facts = json.loads(proc.stdout)
    assert facts["absent"] == ["matplotlib", "kubernetes", "pytest"]
    report(pytestconfig, f"\nimage venv /opt/kvpilot: {facts['mib']} MiB (goal < {VENV_GOAL_MIB})")


def test_an_offline_tune_runs_in_the_image_without_the_report_extra(image: str) -> None:
    proc = podman_run("tune", "--offline", "-q", "--trials", "2", "--workload", "prompt=128,output=16",
                      "--probe-seconds", "20", "--storage", "sqlite:////tmp/s.db", "--report", "/tmp/r.html", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "maxNumBatchedTokens" in proc.stdout
    assert "report: /tmp/r.html" in proc.stderr
