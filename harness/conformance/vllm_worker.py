"""vLLM's own V1 scheduler, driven step by step in-process with no model: the reference side.

    <vllm venv>/bin/python vllm_worker.py --model DIR      # JSON lines: a trace in, its steps out

Runs inside the real-vLLM venv and imports nothing from kvpilot (kvpilot is not installed
there): the protocol is plain JSON.  Each input line is a trace (`{"config": {...}, "requests":
[...]}`, see harness.conformance.traces); each output line is `{"steps": [...]}` or
`{"error": "..."}`.  A step is one `schedule()` call: `{"step": k, "scheduled": {id: tokens},
"preempted": [...], "resumed": [...], "finished": [...]}`, where `finished` lists the requests
whose last token came out of that step's batch.

The engine loop is emulated as vLLM's engine core runs it: `EngineCore.step` (schedule, execute,
update) for synchronous scheduling, and `EngineCore.step_with_batch_queue` with two batches in
flight for `AsyncScheduler`, assuming a batch is never finished before the engine blocks on it
(the GPU is busy).  The "model" samples one token for every scheduled request whose prompt is
done, as a model runner does (a partial prefill samples nothing); each request's tokens are its
own, so only prompts with shared prefixes share cache blocks.

A request arrives before the schedule() call numbered `arrival_step`; while the engine has
nothing to do, the call count jumps to the next arrival (an idle engine core waits).  With
`prefill_schedule_interval` > 1 the loop is the data-parallel engine core's (one rank, in
lockstep with itself, synchronous scheduling): `schedule(throttle_prefills)` off the cadence of
steps counted since the engine last went idle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def prompt_token_ids(req: dict[str, Any], index: int) -> list[int]:
    """Shared-prefix tokens are the same for a group; every other token is the request's own."""
    n, p, group = req["prompt_len"], req.get("prefix_len", 0), req.get("prefix_group")
    ids = []
    if group is not None and p:
        ids = [(group * 7919 + j) % 100_000 + 1 for j in range(min(p, n))]
    base = 200_000 + index * 10_000_000
    ids += [base + j for j in range(n - len(ids))]
    return ids


class Reference:
    def __init__(self, model_dir: str) -> None:
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        self.torch = torch
        self.CacheConfig, self.ModelConfig, self.SchedulerConfig = CacheConfig, ModelConfig, SchedulerConfig
        self.VllmConfig, self.SamplingParams = VllmConfig, SamplingParams
        self.get_hash_fn_by_name, self.get_request_block_hasher = get_hash_fn_by_name, get_request_block_hasher
        self.init_none_hash = init_none_hash
        self.Scheduler, self.AsyncScheduler = Scheduler, AsyncScheduler
        self.FullAttentionSpec, self.KVCacheConfig, self.KVCacheGroupSpec = (
            FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec)
        self.ModelRunnerOutput, self.Request, self.RequestStatus = ModelRunnerOutput, Request, RequestStatus
        self.StructuredOutputManager = StructuredOutputManager
        self.model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True)

    def scheduler(self, c: dict[str, Any]) -> Any:
        bs = c["block_size"]
        sched_config = self.SchedulerConfig(
            max_num_batched_tokens=c["max_num_batched_tokens"], max_num_seqs=c["max_num_seqs"],
            max_model_len=self.model_config.max_model_len, enable_chunked_prefill=True,
            long_prefill_token_threshold=c.get("long_prefill_token_threshold", 0),
            watermark=c.get("watermark", 0.0), async_scheduling=c["async_scheduling"],
            is_encoder_decoder=False,
        )
        cache_config = self.CacheConfig(block_size=bs, enable_prefix_caching=c["enable_prefix_caching"])
        vllm_config = self.VllmConfig(model_config=self.model_config, scheduler_config=sched_config,
                                      cache_config=cache_config)
        vllm_config.cache_config.num_gpu_blocks = c["num_gpu_blocks"]
        spec = self.FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=self.torch.bfloat16)
        kv_config = self.KVCacheConfig(num_blocks=c["num_gpu_blocks"], kv_cache_tensors=[],
                                       kv_cache_groups=[self.KVCacheGroupSpec(["layer.0"], spec)])
        cls = self.AsyncScheduler if c["async_scheduling"] else self.Scheduler
        return cls(vllm_config, kv_config, self.StructuredOutputManager(vllm_config), block_size=bs)

    def run(self, trace: dict[str, Any]) -> list[dict[str, Any]]:
        c = trace["config"]
        sched = self.scheduler(c)
        hasher = None
        if c["enable_prefix_caching"]:
            hash_fn = self.get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
            self.init_none_hash(hash_fn)
            hasher = self.get_request_block_hasher(c["block_size"], hash_fn)
        reqs = sorted(enumerate(trace["requests"]), key=lambda ir: (ir[1]["arrival_step"], ir[0]))
        pending = deque(reqs)
        tokens = {r["id"]: 50_000_000 + i * 10_000_000 for i, r in reqs}
        steps: list[dict[str, Any]] = []
        by_step: dict[int, dict[str, Any]] = {}
        in_flight: deque[tuple[int, Any, Any]] = deque()
        k = 0
        depth = 2 if c["async_scheduling"] else 1
        interval = c.get("prefill_schedule_interval", 1)
        wave_step = 0  # DPEngineCoreProc.step_counter: steps since the engine went busy

        def busy() -> bool:
            return sched.get_num_unfinished_requests() > 0

        def arrive(upto: int) -> None:
            while pending and pending[0][1]["arrival_step"] <= upto:
                i, r = pending.popleft()
                sp = self.SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, temperature=0.0)
                sched.add_request(self.Request(r["id"], prompt_token_ids(r, i), sp, None, arrival_time=float(k),
                                               block_hasher=hasher))

        def schedule() -> tuple[Any, Any, bool]:
            nonlocal k
            k += 1
            arrive(k)
            before = {rid: (r.status, r.num_preemptions) for rid, r in sched.requests.items()}
            # DPEngineCoreProc._should_throttle_prefills (the plain engine core never throttles).
            out = sched.schedule(interval > 1 and wave_step % interval != 0)
            scheduled = dict(out.num_scheduled_tokens)
            preempted = sorted(rid for rid, r in sched.requests.items()
                               if rid in before and r.num_preemptions > before[rid][1])
            resumed = sorted(rid for rid in scheduled if before.get(rid, (None,))[0] == self.RequestStatus.PREEMPTED)
            rec = {"step": k, "scheduled": scheduled, "preempted": preempted, "resumed": resumed, "finished": []}
            steps.append(rec)
            by_step[k] = rec
            # The model runner's answer, fixed now: a request samples when its prompt is done.
            ids = list(scheduled)
            sampled: list[list[int]] = []
            for rid in ids:
                r = sched.requests[rid]
                if r.is_prefill_chunk:
                    sampled.append([])
                else:
                    tokens[rid] += 1
                    sampled.append([tokens[rid] % 100_000_000])
            mro = self.ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: j for j, rid in enumerate(ids)},
                                         sampled_token_ids=sampled)
            return out, mro, out.total_num_scheduled_tokens > 0

        def update(step: int, out: Any, mro: Any) -> None:
            result = sched.update_from_output(out, mro)
            for eco in result.values():
                for o in eco.outputs:
                    if o.finish_reason is not None:
                        by_step[step]["finished"].append(o.request_id)

        while pending or busy() or in_flight:
            if not busy() and not in_flight:
                k = max(k, pending[0][1]["arrival_step"] - 1)
            if busy() or (pending and pending[0][1]["arrival_step"] <= k + 1):
                out, mro, executed = schedule()
                in_flight.appendleft((k, out, mro))
                # EngineCore.step_with_batch_queue: keep scheduling while the queue has room.
                if len(in_flight) < depth and (executed or busy()):
                    continue
            step, out, mro = in_flight.pop()
            update(step, out, mro)
            wave_step = wave_step + 1 if busy() else 0
        for rec in steps:
            rec["finished"].sort()
        return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM's V1 scheduler as a JSON-lines trace replayer")
    ap.add_argument("--model", required=True, help="a local model directory (config.json is all that is read)")
    args = ap.parse_args(argv)
    ref = Reference(args.model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply: dict[str, Any] = {"steps": ref.run(json.loads(line))}
        except Exception as e:  # reported to the caller, which shows it with the trace
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
