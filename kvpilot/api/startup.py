"""vLLM's start-up failures, read from its own words: the one parser of vLLM's start-up error text.

`startup_failure(text)` and `memory_report(text)`, used by the operator (a pod's termination message or
log) and the tuner (to grade a failed config).  The shapes of vLLM's messages: docs/architecture.md,
"vLLM's start-up failures".
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

_UNIT = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}
_SIZE = r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B)"

_KV_SHORT = re.compile(
    _SIZE + r" KV cache is needed, which is larger than the available KV cache memory \(" + _SIZE + r"\)",
    re.IGNORECASE,
)
_MAX_LEN = re.compile(
    r"max seq len \(([0-9]+)\) is larger than the maximum number of tokens that can be stored in KV cache "
    r"\(([0-9]+)\)",
    re.IGNORECASE,
)
_NO_CACHE = re.compile(r"No available memory for the cache blocks", re.IGNORECASE)
_NO_CACHE_NUMBERS = re.compile(
    r"requested " + _SIZE + r"; model weights take " + _SIZE + r"; PyTorch activation peak memory takes "
    + _SIZE + r"; non-torch memory takes " + _SIZE,
    re.IGNORECASE,
)
# The twin's weights message, and PyTorch's / vLLM's CUDA OOM wording.
_WEIGHTS = re.compile(r"they need " + _SIZE + r" per GPU .*? of which " + _SIZE + r" is free", re.IGNORECASE)
_CUDA_OOM = re.compile(r"Tried to allocate " + _SIZE + r".*? of which " + _SIZE + r" is free", re.IGNORECASE)
# The GPU's wording, and the CPU backend's (where --gpu-memory-utilization is a fraction of a NUMA
# node's memory): "Available memory on node 0 (3.86/16.0 GiB) on startup is less than desired CPU
# memory utilization (0.92, 14.72 GiB)".
_UTIL_TOO_HIGH = re.compile(
    r"(?:Free memory on device|Available memory on node) \S+ \(([0-9.]+)/[0-9.]+ GiB\) on startup is less than "
    r"desired [GC]PU memory utilization \([0-9.]+, " + _SIZE + r"\)",
    re.IGNORECASE,
)
# The CPU backend's second check, once the model is loaded: the fraction it asked for, less what the
# worker process already holds, is the KV cache.  "Available memory on node 0 (13.95/17.09 GiB) on kv
# cache allocation is less than requested memory for kv (-0.78/0.17 GiB)": KV -0.78 of the 0.17 GiB
# asked for, so the worker holds 0.95 GiB.  A KV size at or below zero is a fraction too low to leave
# any KV cache (no_cache); a positive one is more than the node has free (gpu_short).
_CPU_KV_ALLOCATION = re.compile(
    r"Available memory on node \S+ \(([0-9.]+)/([0-9.]+) GiB\) on kv cache allocation is less than requested "
    r"memory for kv \((-?[0-9.]+)/([0-9.]+) GiB\)",
    re.IGNORECASE,
)
_OOM = re.compile(r"out of memory", re.IGNORECASE)

# What vLLM V1 prints when its engine could not start, whatever the cause: a worker's "WorkerProc
# failed to start." (the root cause follows), the engine core's "EngineCore failed to start." and its
# "WorkerProc initialization failed ... See stack trace for root cause.", and the API server's closing
# "Engine core initialization failed. See root cause above."  They say that it failed, never why: the
# cause line is another one.
_STARTUP_MARKERS = re.compile(
    r"Engine core initialization failed|EngineCore failed to start|WorkerProc failed to start|"
    r"WorkerProc initialization failed",
    re.IGNORECASE,
)
# A Python exception line (`ValueError: ...`, `torch.OutOfMemoryError: ...`), after vLLM's prefixes.
_EXCEPTION = re.compile(r"\b(?:[A-Za-z_][\w.]*)?(?:Error|Exception): \S")

TIERS = 3  # Shortfall tiers 0..2


def _bytes(number: str, unit: str) -> float:
    return float(number) * _UNIT[unit.lower()]


def _share(missing: float, needed: float) -> float:
    return 0.0 if needed <= 0 else min(max(missing / needed, 0.0), 1.0)


@dataclass(frozen=True)
class Shortfall:
    """How far a config that could not start was from starting.

    tier 0: the KV cache short of one max_model_len sequence, 1: no KV cache at all, 2: the GPU
    itself short.  A lower tier is always nearer to starting; within a tier, `fraction` (0..1) is
    the share of what was needed that was missing.
    """

    tier: int
    fraction: float

    @property
    def distance(self) -> float:
        """One number ordering every memory failure: tier + fraction, in [0, TIERS]."""
        return self.tier + self.fraction


@dataclass(frozen=True)
class StartupMemory:
    """The numbers a memory start-up failure reports, in bytes (None where it reports none).

    kind: "kv_short" (`needed` for one max_model_len sequence vs `available`), "no_cache"
    (`requested` vs weights + activation + non-torch), "gpu_short" (`needed` vs `available` on the
    GPU).  The twin raises these numbers as fields; a real vLLM's are read from its text
    (`memory_report`).
    """

    kind: str
    needed: float | None = None
    available: float | None = None
    requested: float | None = None
    weights: float | None = None
    activation: float | None = None
    non_torch: float | None = None
    # A kv_short message cut short may say it in tokens only: max_model_len vs the tokens that fit.
    max_model_len: float | None = None
    tokens_fit: float | None = None
    # The device's whole memory, where the message says it (vLLM's CPU backend: the NUMA node's).
    total: float | None = None

    def shortfall(self) -> Shortfall:
        if self.kind == "kv_short":
            if self.needed is None and self.max_model_len:
                return Shortfall(0, _share(self.max_model_len - (self.tokens_fit or 0.0), self.max_model_len))
            return Shortfall(0, _share((self.needed or 0.0) - (self.available or 0.0), self.needed or 0.0))
        if self.kind == "no_cache":
            if self.requested is None or self.weights is None:
                return Shortfall(1, 0.0)
            fixed = self.weights + (self.activation or 0.0) + (self.non_torch or 0.0)
            return Shortfall(1, _share(fixed - self.requested, fixed))
        if self.needed is None or self.available is None:
            return Shortfall(2, 1.0)
        return Shortfall(2, _share(self.needed - self.available, self.needed))

    def as_dict(self) -> dict[str, float | str]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StartupMemory:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def memory_report(message: str) -> StartupMemory | None:
    """The memory failure vLLM's start-up text reports, or None where it reports none."""
    if m := _KV_SHORT.search(message):
        return StartupMemory("kv_short", needed=_bytes(*m.group(1, 2)), available=_bytes(*m.group(3, 4)))
    if m := _MAX_LEN.search(message):  # the same failure in tokens (a message cut short still has these)
        return StartupMemory("kv_short", max_model_len=float(m.group(1)), tokens_fit=float(m.group(2)))
    if _NO_CACHE.search(message):
        if m := _NO_CACHE_NUMBERS.search(message):
            return StartupMemory("no_cache", requested=_bytes(*m.group(1, 2)), weights=_bytes(*m.group(3, 4)),
                                 activation=_bytes(*m.group(5, 6)), non_torch=_bytes(*m.group(7, 8)))
        return StartupMemory("no_cache")
    if m := _WEIGHTS.search(message) or _CUDA_OOM.search(message):
        return StartupMemory("gpu_short", needed=_bytes(*m.group(1, 2)), available=_bytes(*m.group(3, 4)))
    if m := _CPU_KV_ALLOCATION.search(message):
        available, total, kv, requested = (float(g) * 2**30 for g in m.group(1, 2, 3, 4))
        if kv <= 0:  # the worker's own memory (weights, runtime) already exceeds the fraction
            return StartupMemory("no_cache", requested=requested, weights=requested - kv, activation=0.0,
                                 non_torch=0.0, total=total)
        return StartupMemory("gpu_short", needed=kv, available=available, total=total)
    if m := _UTIL_TOO_HIGH.search(message):
        return StartupMemory("gpu_short", needed=_bytes(*m.group(2, 3)), available=float(m.group(1)) * 2**30)
    if _OOM.search(message):
        return StartupMemory("gpu_short")
    return None


# The longest cause line kept: vLLM's memory messages run to ~450 characters.
CAUSE_CHARS = 600


def cause_line(text: str) -> str:
    """The line of an engine's output that says why it died: the last one reporting a memory failure
    (its numbers grade the config), else the last exception line other than vLLM's generic
    "Engine core initialization failed", else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if memory_report(ln) is not None:
            return ln[:CAUSE_CHARS]
    for ln in reversed(lines):
        if _EXCEPTION.search(ln) and not _STARTUP_MARKERS.search(ln):
            return ln[:CAUSE_CHARS]
    return lines[-1][:CAUSE_CHARS] if lines else "(no output)"


@dataclass(frozen=True)
class StartupFailure:
    """What vLLM's output says about an engine that could not start."""

    cause: str  # the line that says why (`cause_line`)
    memory: StartupMemory | None  # its numbers, when the cause is a memory failure
    # The text names no root cause but says it is further up the log ("See root cause above"):
    # reading more of the log (the dead container's) may find it.
    cause_above: bool


def startup_failure(text: str) -> StartupFailure | None:
    """vLLM's start-up failure in `text` (a termination message, a log's tail), or None when the text
    is not one: a memory failure, or vLLM's own "engine could not start" wording."""
    cause = cause_line(text)
    memory = memory_report(cause)
    if memory is None and not _STARTUP_MARKERS.search(text):
        return None
    return StartupFailure(cause, memory, cause_above=memory is None and bool(_STARTUP_MARKERS.search(cause)))
