"""How far a config that could not start was from starting: read from vLLM's start-up error.

`memory_shortfall` grades a start-up failure by tier and shortfall so the sampler sees how near it was
(None for a message of no known shape); `memory_floor` rules out configs below a failed one. The tiers:
docs/architecture.md, "Grading a config that could not start".
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's start-up text is read in one place (kvpilot.api.startup): the operator reads the same
# words from a pod's termination message.
from kvpilot.api.startup import TIERS, Shortfall, StartupMemory, memory_report

__all__ = ["TIERS", "MemoryFailure", "Shortfall", "StartupMemory", "UtilFloor", "memory_floor", "memory_report",
           "memory_shortfall", "read_memory_failure"]


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
        # The device's memory: as the message says it, else the request over the fraction (the
        # request's two decimals of a GiB, divided by a small fraction, would blur it).
        total = report.total or (report.requested / util if util > 0 else None)
        return MemoryFailure(tokens, util, seqs, total=total,
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
