"""Operator at scale: N InferenceServices against KMock, one real `kvpilot operator` process.

Prints reconcile latency (create -> first status write, both as KMock received them) p50/p99,
the time until every object has its status, and the operator process's peak RSS (VmHWM from
/proc/<pid>/status).  Goal: peak RSS <= 150 MB at 1,000 objects.

    python benchmarks/operator_scale.py [--count 1000] [--concurrency 8] [--real] [--smoke]

--real runs the same burst against a real control plane instead (make control-plane; see
benchmarks/operator_scale_real.py), counting the operator's API calls from kube-apiserver's audit log.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.kmock_api import KMockAPI, kopf_operator, wait_for  # noqa: E402

NAMESPACES = ("team-a", "team-b", "team-c", "team-d")


def proc_status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def latencies(api: KMockAPI) -> dict[str, float]:
    """Per object: arrival of its first status PATCH minus arrival of its creating POST."""
    created: dict[str, float] = {}
    first_status: dict[str, float] = {}
    for t, method, path, name in list(api.emulator.timed_calls):
        parts = path.strip("/").split("/")  # apis/kvpilot.dev/v1alpha1/namespaces/NS/inferenceservices[/N[/status]]
        if len(parts) < 6 or parts[5] != "inferenceservices" or name is None:
            continue
        key = f"{parts[4]}/{name}"
        if method == "POST" and len(parts) == 6:
            created.setdefault(key, t)
        elif method == "PATCH" and len(parts) == 8 and parts[7] == "status":
            first_status.setdefault(key, t)
    return {k: first_status[k] - created[k] for k in created if k in first_status}


def make(i: int) -> dict[str, Any]:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": f"svc-{i:04d}", "namespace": NAMESPACES[i % len(NAMESPACES)]},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 1 + i % 3,
                 "engine": {"maxNumBatchedTokens": 1024 * (1 + i % 8)}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=1000, help="InferenceServices to create (default 1000)")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel creating clients (default 8)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds to wait for all statuses")
    parser.add_argument("--real", action="store_true",
                        help="against a real kube-apiserver, controllers and kwok nodes instead of KMock")
    parser.add_argument("--smoke", action="store_true", help="20 InferenceServices: the same path in seconds (CI)")
    args = parser.parse_args()
    if args.smoke:
        args.count, args.concurrency, args.timeout = 20, 4, 120.0
    if args.real:
        from benchmarks.operator_scale_real import run

        return run(args.count, args.concurrency, args.timeout, NAMESPACES, make, percentile, proc_status_kb,
                   cpu_seconds)

    with tempfile.TemporaryDirectory() as tmp, KMockAPI() as api, kopf_operator(api, Path(tmp)) as op:
        pid = op.proc.pid
        idle_kb = proc_status_kb(pid, "VmRSS")

        def create(i: int) -> None:
            api.create_isvc(make(i))

        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(create, range(args.count)))
        created_s = time.monotonic() - started
        wait_for(lambda: len(latencies(api)) >= args.count, timeout=args.timeout, interval=1.0,
                 what=f"the first status of all {args.count} InferenceServices")
        all_done_s = time.monotonic() - started
        # Deployment events keep coming for a moment after the last first-status; let them settle.
        time.sleep(3)
        peak_kb = proc_status_kb(pid, "VmHWM")
        rss_kb = proc_status_kb(pid, "VmRSS")
        values = list(latencies(api).values())
        calls = len(api.calls)
        operator_cpu = cpu_seconds(pid)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    kmock_cpu = usage.ru_utime + usage.ru_stime

    print(f"InferenceServices created:        {args.count} in {created_s:.1f} s "
          f"({args.count / created_s:.0f}/s, {args.concurrency} clients)")
    print(f"all reconciled (first status):    {all_done_s:.1f} s after the first create; "
          f"{calls} API calls in all")
    print(f"reconcile latency create->status: p50 {statistics.median(values) * 1000:.0f} ms, "
          f"p99 {percentile(values, 99) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms")
    print(f"CPU seconds used:                 operator {operator_cpu:.1f} s, KMock + clients {kmock_cpu:.1f} s "
          f"(load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    print(f"operator RSS before the load:     {idle_kb / 1024:.1f} MB")
    print(f"operator RSS after the load:      {rss_kb / 1024:.1f} MB")
    print(f"operator peak RSS (VmHWM):        {peak_kb / 1024:.1f} MB (goal <= 150 MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
