"""A trace through the twin's scheduler, and the step-by-step comparison with vLLM's.

A step record is one `schedule()` call: `{"step", "scheduled": {request id: tokens},
"preempted", "resumed", "finished"}` (id lists, sorted), `finished` naming the requests whose
last token came out of that step.  Arrivals follow the rule the vLLM side uses (see
traces.py): before the `arrival_step`-th step, and an idle engine jumps to the next arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from harness.conformance.traces import Trace
from kvpilot.twin.scheduler import WAITING, Request, Scheduler

Step = dict[str, Any]


def twin_scheduler(config: dict[str, Any]) -> Scheduler:
    return Scheduler(
        num_gpu_blocks=config["num_gpu_blocks"], block_size=config["block_size"],
        max_num_batched_tokens=config["max_num_batched_tokens"], max_num_seqs=config["max_num_seqs"],
        long_prefill_token_threshold=config.get("long_prefill_token_threshold", 0),
        enable_prefix_caching=config["enable_prefix_caching"], watermark=config.get("watermark", 0.0),
        prefill_schedule_interval=config.get("prefill_schedule_interval", 1),
        async_scheduling=config["async_scheduling"],
    )


def replay_twin(trace: Trace) -> list[Step]:
    config = trace["config"]
    sched = twin_scheduler(config)
    bs = config["block_size"]
    pending = deque(sorted(enumerate(trace["requests"]), key=lambda ir: (ir[1]["arrival_step"], ir[0])))
    steps: list[Step] = []
    every: dict[str, Request] = {}
    k = 0
    while pending or sched.running or sched.waiting:
        if not (sched.running or sched.waiting):
            k = max(k, pending[0][1]["arrival_step"] - 1)
        k += 1
        while pending and pending[0][1]["arrival_step"] <= k:
            _, r = pending.popleft()
            blocks = r["prefix_len"] // bs if r.get("prefix_group") is not None else 0
            req = every[r["id"]] = Request(r["id"], r["prompt_len"], r["max_tokens"], float(k),
                                           f"g{r['prefix_group']}" if blocks else None, blocks)
            sched.add(req)
        before = {rid: (req.status, req.num_preemptions) for rid, req in sched.requests.items()}
        outcome = sched.step(k)
        scheduled, finished = outcome.scheduled, outcome.finished
        steps.append({
            "step": k,
            "scheduled": {req.request_id: abs(req.sched) for req in scheduled},
            "preempted": sorted(rid for rid, (_, p) in before.items() if every[rid].num_preemptions > p),
            "resumed": sorted(req.request_id for req in scheduled
                              if before[req.request_id][0] == WAITING and req.num_preemptions > 0),
            "finished": sorted(req.request_id for req in finished),
        })
    return steps


@dataclass
class Comparison:
    """How two step sequences compare: steps compared (the longer length), steps that differ,
    and the first difference spelled out."""

    steps: int = 0
    differing: int = 0
    first: str | None = None
    differing_steps: list[int] = field(default_factory=list)


def compare_steps(twin: list[Step], vllm: list[Step]) -> Comparison:
    out = Comparison(steps=max(len(twin), len(vllm)))
    for i in range(out.steps):
        a = twin[i] if i < len(twin) else None
        b = vllm[i] if i < len(vllm) else None
        if a == b:
            continue
        out.differing += 1
        out.differing_steps.append(i + 1)
        if out.first is None:
            out.first = f"step #{i + 1}: twin {a} vs vLLM {b}"
    return out
