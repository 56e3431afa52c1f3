"""Request traces for the differential check, and the scheduler configuration each runs under.

A trace is plain JSON, the same for both sides: `config` (the scheduler's knobs, named as vLLM
names them) and `requests`, each `{"id", "arrival_step", "prompt_len", "max_tokens",
"prefix_group", "prefix_len"}`.  A request arrives before the engine's `arrival_step`-th
`schedule()` call; requests of one `prefix_group` share their first `prefix_len` prompt tokens,
every other token is the request's own.  Outputs never end early (vLLM's `ignore_eos`).

A family fixes the scheduling mode and draws the rest at random, always with every request
fitting the KV pool on its own (vLLM would otherwise wait for it forever):

    sync            synchronous scheduling (vLLM's CPU build, `--no-async-scheduling`), no prefix caching
    sync-prefix     synchronous, prefix caching on, shared prefixes, pools down to a few blocks
    async           AsyncScheduler with two batches in flight (vLLM's GPU default), no prefix caching
    async-prefix    async, prefix caching on, shared prefixes
    dp-interval     synchronous, `--prefill-schedule-interval` 2-4 as vLLM's data-parallel engine core
                    applies it, prefix caching on or off
"""

from __future__ import annotations

import random
from typing import Any

FAMILIES = ("sync", "sync-prefix", "async", "async-prefix", "dp-interval")
MAX_MODEL_LEN = 4096  # the tiny reference model's context; every request stays within it

Trace = dict[str, Any]


def family_flags(family: str) -> tuple[bool, bool | None, bool]:
    """(async_scheduling, enable_prefix_caching or None for either, prefill interval on)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown trace family {family!r}: one of {', '.join(FAMILIES)}")
    return family.startswith("async"), (True if family.endswith("-prefix") else None if family == "dp-interval"
                                        else False), family == "dp-interval"


def random_trace(family: str, rng: random.Random) -> Trace:
    async_scheduling, prefix, interval = family_flags(family)
    if prefix is None:
        prefix = rng.random() < 0.5
    bs = rng.choice((16, 16, 32))
    budget = rng.choice((128, 256, 512, 1024, 2048))
    seqs = min(budget, rng.choice((2, 4, 8, 16, 32)))
    threshold = rng.choice((0, 0, 32, 64, 256))
    n = rng.randint(2, 36)
    horizon = rng.choice((1, 10, 40, 120))
    groups = rng.randint(1, 3) if prefix else 0
    group_len = {g: rng.randint(1, 40) * bs // rng.choice((1, 2)) for g in range(groups)}
    requests: list[dict[str, Any]] = []
    for i in range(n):
        prompt = int(rng.choice((rng.randint(1, 64), rng.randint(1, 600), int(10 ** rng.uniform(0, 3.2)))))
        group = rng.randrange(groups) if groups and rng.random() < 0.7 else None
        plen = 0
        if group is not None:
            plen = group_len[group]
            prompt = plen + max(1, prompt // 2)  # at least one token of its own after the prefix
        max_tokens = rng.choice((1, rng.randint(1, 16), rng.randint(1, 200)))
        prompt = min(prompt, MAX_MODEL_LEN - max_tokens)
        plen = min(plen, prompt - 1) if group is not None else 0
        requests.append({"id": f"r{i}", "arrival_step": rng.randint(1, horizon), "prompt_len": prompt,
                         "max_tokens": max_tokens, "prefix_group": group, "prefix_len": plen})
    biggest = max(-(-(r["prompt_len"] + r["max_tokens"]) // bs) for r in requests)
    total = sum(-(-(r["prompt_len"] + r["max_tokens"]) // bs) for r in requests)
    # Pools from barely one request (constant preemption) to roomy; +1 for vLLM's null block.
    blocks = rng.choice((biggest + 1 + rng.randint(0, 3), biggest + 1 + rng.randint(0, max(1, total // 4)),
                         biggest + 1 + total))
    config = {
        "block_size": bs, "max_num_batched_tokens": budget, "max_num_seqs": seqs, "num_gpu_blocks": blocks,
        "long_prefill_token_threshold": threshold, "enable_prefix_caching": prefix,
        "async_scheduling": async_scheduling, "watermark": rng.choice((0.0, 0.0, 0.0, 0.01, 0.05)),
        "prefill_schedule_interval": rng.randint(2, 4) if interval else 1,
    }
    return {"family": family, "config": config, "requests": requests}


def random_traces(family: str, count: int, seed: int) -> list[Trace]:
    rng = random.Random(f"{family}/{seed}")
    return [random_trace(family, rng) for _ in range(count)]
