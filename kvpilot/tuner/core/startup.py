"""How far a config that could not start was from starting: read from vLLM's start-up error.

A start-up failure told to the sampler as one flat constant says "infeasible" and nothing more,
so TPE cannot tell a config that missed by a few hundred MiB from a hopeless one, and on a
memory-bound model (most of the grid cannot start) it has no gradient toward the configs that
can.  vLLM's start-up errors carry the numbers; the twin raises the same wording
(`kvpilot.twin.memory`).  Read them and grade the failure:

    tier 0  the KV cache cannot hold one `max_model_len` sequence
            "... X GiB KV cache is needed, which is larger than the available KV cache memory (Y GiB)"
            shortfall = (X - Y) / X, in units of that one sequence
    tier 1  nothing left for the KV cache at all
            "No available memory for the cache blocks ... (requested R GiB; model weights take W GiB;
            PyTorch activation peak memory takes A GiB; non-torch memory takes N GiB)"
            shortfall = (W + A + N - R) / (W + A + N); vLLM's own message has no numbers: 0
    tier 2  the GPU itself is short (weights or an allocation do not fit, or less memory is free
            than gpuMemoryUtilization asks for): shortfall = (asked - free) / asked

A lower tier is always nearer to starting (one more block of memory away from the next tier
down), and within a tier the shortfall orders configs by how much memory is missing.  A message
with none of these shapes (a crash, a failed rollout) gives None: the caller keeps its constant.
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
_UTIL_TOO_HIGH = re.compile(
    r"Free memory on device \S+ \(" + r"([0-9.]+)/[0-9.]+ GiB\) on startup is less than desired GPU memory "
    r"utilization \([0-9.]+, " + _SIZE + r"\)",
    re.IGNORECASE,
)
_OOM = re.compile(r"out of memory", re.IGNORECASE)

TIERS = 3  # tiers 0..2 above


@dataclass(frozen=True)
class Shortfall:
    tier: int  # 0: KV cache short of one sequence, 1: no KV cache at all, 2: GPU memory short
    fraction: float  # 0..1 within the tier: the share of what was needed that was missing

    @property
    def distance(self) -> float:
        """One number ordering every memory failure: tier + fraction, in [0, TIERS]."""
        return self.tier + self.fraction


def _bytes(number: str, unit: str) -> float:
    return float(number) * _UNIT[unit.lower()]


def _share(missing: float, needed: float) -> float:
    return 0.0 if needed <= 0 else min(max(missing / needed, 0.0), 1.0)


@dataclass(frozen=True)
class StartupMemory:
    """The numbers a memory start-up failure reports, in bytes (None where it reports none).

    kind: "kv_short" (tier 0: `needed` for one max_model_len sequence vs `available`),
    "no_cache" (tier 1: `requested` vs weights + activation + non-torch), "gpu_short" (tier 2:
    `needed` vs `available` on the GPU).  The twin raises these numbers as fields; a real vLLM's
    are read from its log (`memory_report`).
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
    """The memory failure a real vLLM's start-up log reports, or None where it reports none."""
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
    if m := _UTIL_TOO_HIGH.search(message):
        return StartupMemory("gpu_short", needed=_bytes(*m.group(2, 3)), available=float(m.group(1)) * 2**30)
    if _OOM.search(message):
        return StartupMemory("gpu_short")
    return None


def memory_shortfall(message: str) -> Shortfall | None:
    """The memory shortfall a start-up error reports, or None where it reports none."""
    report = memory_report(message)
    return report.shortfall() if report is not None else None


# -- the memory floor ----------------------------------------------------------------------
#
# A memory failure also says which configs cannot start either, so the sampler need not spend a
# trial (live: a rollout) finding out.  Less memory never helps: a config with a lower
# gpuMemoryUtilization, a bigger token budget or a higher sequence cap (both grow the profiling
# run's activation peak) than one that failed for memory fails too.  Where the message has
# numbers the bound is sharper: "No available memory ... (requested R; weights W; activation A;
# non-torch N)" at fraction u means the GPU holds R / u and any config needs at least
# (W + N + its own activation) of it, whatever its token budget.

@dataclass(frozen=True)
class MemoryFailure:
    """One config that could not start for lack of memory, and what its message says."""

    tokens: int
    util: float
    seqs: int
    total: float | None = None  # the GPU's memory, bytes (requested / fraction, where the message says)
    fixed: float | None = None  # weights + non-torch memory, bytes (needed by every config)
    activation: float | None = None  # this config's activation peak, bytes
    missing: float | None = None  # bytes more this config needed (one max_model_len sequence short)
    one_sequence: float | None = None  # KV cache bytes one max_model_len sequence needs (any config)


def read_memory_failure(tokens: int, util: float, seqs: int, report: StartupMemory | None) -> MemoryFailure | None:
    """The memory failure a start-up report says for a low fraction; None for any other failure.

    A GPU that is short whatever the fraction (weights too big, less free memory than asked)
    says nothing about a higher fraction, so it gives None too.
    """
    if report is None or report.kind == "gpu_short":
        return None
    if report.kind == "no_cache" and report.requested is not None and report.weights is not None:
        return MemoryFailure(tokens, util, seqs, total=report.requested / util if util > 0 else None,
                             fixed=report.weights + (report.non_torch or 0.0), activation=report.activation)
    if report.kind == "kv_short" and report.needed is not None:
        return MemoryFailure(tokens, util, seqs, missing=max(report.needed - (report.available or 0.0), 0.0),
                             one_sequence=report.needed)
    return MemoryFailure(tokens, util, seqs)


# The messages give sizes to two decimals of a GiB, so each number may be 0.005 GiB off; a bound
# made of four of them is lowered by their worst sum, so that it never rules out a config that starts.
ROUNDING_SLACK = 4 * 0.005 * 2**30


def memory_floor(failures: list[MemoryFailure], tokens: int, seqs: int, step: float) -> float:
    """The lowest gpuMemoryUtilization these failures leave possible for (tokens, seqs); 0.0: no bound.

    `step` is the fraction's resolution: a config that failed at u rules out u itself, so the
    next possible fraction is at least one step up.
    """
    totals = [f.total for f in failures if f.total]
    total = max(totals) if totals else None
    # Every config must also hold one max_model_len sequence in its KV cache.
    one_sequence = max((f.one_sequence for f in failures if f.one_sequence), default=0.0)
    floor = 0.0
    for f in failures:
        if f.fixed is not None and total:
            # Its activation scales with the token budget and the sequence cap; a smaller config's
            # is at least the failed one's times the smaller ratio (an affine peak with no negative part).
            scale = min(1.0, tokens / f.tokens, seqs / f.seqs)
            needed = f.fixed + (f.activation or 0.0) * scale + one_sequence - ROUNDING_SLACK
            floor = max(floor, needed / total)
        if tokens >= f.tokens and seqs >= f.seqs:  # at least as much activation: needs more than f had
            bound = f.util + step
            if f.missing is not None and total:
                bound = max(bound, f.util + (f.missing - ROUNDING_SLACK) / total)
            floor = max(floor, bound)
    return floor


class UtilFloor:
    """The lowest gpuMemoryUtilization a study's memory failures leave possible, per config."""

    def __init__(self, failures: list[MemoryFailure], step: float) -> None:
        self.failures, self.step = failures, step

    def __call__(self, tokens: int, seqs: int) -> float:
        return memory_floor(self.failures, tokens, seqs, self.step) if self.failures else 0.0
