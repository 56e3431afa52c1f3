"""Run `kvpilot` commands on hostile inputs, each in its own forked process, and measure it.

    python -m tests.fuzz.harness < jobs.json > results.jsonl

A job is `{"id", "argv", "input"}` (`input` is base64; `{input}` in argv is replaced by the path of
a file holding it, named `input_name` when the job gives one, else input.yaml).  The harness imports kvpilot once, then forks one child per job: the child
runs `kvpilot.cli.main(argv)` with stdout and stderr in files and exits with its return code.  The
kernel measures the child (os.wait4): CPU seconds (user + system, which a loaded machine does not
inflate the way it inflates wall time) and peak resident memory, of which the part above the
child's own resident size when it started is the job's.  A child is also capped (RLIMIT_CPU, RLIMIT_AS), so a case
that ran away ends as a failed result rather than taking the machine down.

Each result line: id, returncode (or the signal that ended the child), cpu_s, peak_rss_mb (above
the child's start), stdout and stderr (their first and last 4 KiB, and their length).
"""

from __future__ import annotations

import base64
import json
import os
import resource
import sys
import tempfile
import time

SELF_TEST = "--harness-self-test"  # argv: SELF_TEST MB CPU_SECONDS
CPU_CAP_S = 30  # far past the 2 s goal: only a runaway case reaches it
MEMORY_CAP_BYTES = 2 << 30  # address space the child may add to what it inherits


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _warm_up() -> None:
    # Everything the commands import, imported before the forks, so a child measures its job only.
    import kvpilot.api.crd  # noqa: F401
    import kvpilot.api.validation  # noqa: F401
    import kvpilot.cli
    import kvpilot.operator.builders  # noqa: F401
    import kvpilot.slo.rules  # noqa: F401
    import kvpilot.slo.signals  # noqa: F401

    kvpilot.cli.build_parser()


def _child(argv: list[str], out_path: str, err_path: str, rss_path: str) -> None:
    # The child's resident size as it starts (fork does not count all the parent's pages in it):
    # the job's own memory is its peak above this.
    with open(rss_path, "w") as f:
        f.write(str(_rss_bytes()))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_CAP_S, CPU_CAP_S + 5))
    limit = _vm_bytes() + MEMORY_CAP_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    code = 99
    try:
        from kvpilot.cli import main

        if argv[:1] == [SELF_TEST]:  # calibration: allocate and spin, so a test can see both measured
            block = bytearray(int(argv[1]) << 20)
            block[::4096] = b"x" * len(block[::4096])
            deadline = time.process_time() + float(argv[2])
            while time.process_time() < deadline:
                pass
            os._exit(0)
        sys.stdin = open(0)  # noqa: SIM115 - the child exits right after
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 98
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(int(code))


def _read_head(path: str) -> tuple[str, int]:
    """The first and the last 4 KiB of a file (all of it when shorter), and its size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= 8192:
            return f.read().decode("utf-8", "replace"), size
        head = f.read(4096)
        f.seek(size - 4096)
        return (head + b"\n...\n" + f.read()).decode("utf-8", "replace"), size


def run_job(job: dict, workdir: str) -> dict:
    data = base64.b64decode(job["input"])
    in_path = os.path.join(workdir, job.get("input_name", "input.yaml"))  # a command may read the name
    with open(in_path, "wb") as f:
        f.write(data)
    argv = [in_path if a == "{input}" else a for a in job["argv"]]
    out_path, err_path = os.path.join(workdir, "out"), os.path.join(workdir, "err")
    rss_path = os.path.join(workdir, "rss")
    pid = os.fork()
    if pid == 0:
        _child(argv, out_path, err_path, rss_path)
    _, status, usage = os.wait4(pid, 0)
    with open(rss_path) as f:
        base_rss = int(f.read() or 0)
    out, out_len = _read_head(out_path)
    err, err_len = _read_head(err_path)
    return {
        "id": job["id"],
        "returncode": os.waitstatus_to_exitcode(status),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 4),
        "peak_rss_mb": round(max(0, usage.ru_maxrss * 1024 - base_rss) / 2**20, 1),
        "stdout": out, "stdout_len": out_len, "stderr": err, "stderr_len": err_len,
    }


def main() -> int:
    jobs = json.load(sys.stdin)
    _warm_up()
    with tempfile.TemporaryDirectory(prefix="kvpilot-fuzz-") as workdir:
        for job in jobs:
            print(json.dumps(run_job(job, workdir)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
