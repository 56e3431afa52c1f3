"""A process and its descendants as /proc shows them: CPU seconds and memory, for the hostile-request
tests and benchmarks, which bound what one request costs the server and its parse workers."""

from __future__ import annotations

import os


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (the twin server's body-parsing workers)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
    return pids


def cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each process in the tree of `pid`."""
    out = {}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        # The root's own time, and also that of the children it has reaped (a worker killed for a
        # client that left takes its CPU time out of the live processes).
        ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if p == pid else 0)
        out[p] = ticks / os.sysconf("SC_CLK_TCK")
    return out


def memory_mb(pid: int, field: str = "VmRSS") -> dict[int, float]:
    """A /proc/PID/status memory field (VmRSS now, VmHWM the peak) of each process in the tree, in MiB."""
    out = {}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                out[p] = next(int(line.split()[1]) / 1024 for line in f if line.startswith(f"{field}:"))
        except (FileNotFoundError, StopIteration):
            continue
    return out


def growth(before: dict[int, float], after: dict[int, float]) -> float:
    """What the tree grew by between two readings (a process new since `before` counts whole)."""
    return sum(value - before.get(p, 0.0) for p, value in after.items())
