"""Polish: now and then, try a neighbour of the best config instead of a TPE draw.

TPE is good at finding the right region and poor at finishing in it: with 20 trials its
"good" group is the best one or two trials, and its candidates scatter around them on every
knob at once.  vLLM's knobs have a clear local structure (one more step of KV-cache fraction,
a step up or down of the token budget or sequence cap), and the last few percent of capacity is often
exactly one such step away -- a memory-bound model gains from the next step of
gpuMemoryUtilization, which TPE reaches only by luck.  So after the start-up, every
`POLISH_EVERY`-th trial is a neighbour of the best config so far, one step along one knob,
not yet tried and not ruled out by a memory failure.  The other trials stay TPE's, so the
search still leaves a local optimum when TPE finds a better region.

Measured effect (with and without): benchmarks/README-tuner.md.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from kvpilot.tuner.core.space import EngineParams, SearchSpace

POLISH_EVERY = 3
UTIL_STEPS_PER_RANGE = 5  # a polish step of the fraction: a fifth of its range (0.05 on 0.70..0.95)


def polish_turn(finished: int, n_startup: int, every: int = POLISH_EVERY) -> bool:
    """Is the next trial (after `finished` counted trials) a polish trial?  Never during start-up."""
    k = finished - n_startup - 1
    return k >= 0 and k % every == 0


def util_step(space: SearchSpace) -> float:
    lo, hi = space.gpu_memory_utilization
    steps = max(1, round((hi - lo) / UTIL_STEPS_PER_RANGE / space.util_step))
    return round(steps * space.util_step, 4)


def neighbours(params: EngineParams, space: SearchSpace) -> list[EngineParams]:
    """One step along one knob (for the integers x2 or /2 on a powers-of-two space, a half-octave
    on a log-scale one; for the fraction a fifth of its range), kept inside the space with the
    token budget >= the sequence cap; `params` excluded."""
    t, u, s = params.max_num_batched_tokens, params.gpu_memory_utilization, params.max_num_seqs
    du = util_step(space)
    f = 2.0 if space.scale == "pow2" else math.sqrt(2.0)
    out: list[EngineParams] = []
    for tokens, util, seqs in (
        (t, u + du, s), (t, u - du, s), (round(t * f), u, s), (round(t / f), u, s),
        (t, u, round(s * f)), (t, u, round(s / f)),
    ):
        if tokens < 1 or seqs < 1:
            continue
        q = space.clip(EngineParams(max(tokens, seqs), util, seqs))
        if q != params and q not in out and space.contains(q):
            out.append(q)
    return out


def pick_neighbour(params: EngineParams, space: SearchSpace, tried: set[EngineParams], *,
                   util_floor: Callable[[int, int], float], seed: object) -> EngineParams | None:
    """An untried neighbour that no memory failure rules out, in a seeded random order."""
    candidates = [
        q for q in neighbours(params, space)
        if q not in tried and q.gpu_memory_utilization + 1e-9 >= util_floor(q.max_num_batched_tokens, q.max_num_seqs)
    ]
    if not candidates:
        return None
    random.Random(str(seed)).shuffle(candidates)
    return candidates[0]

