"""The latency objective as one value: p99 time to first token and p99 inter-token latency.

The twin's offline runs score goodput against it, the tuner scores trials against it, and
`spec.slo` of an InferenceService carries the same two targets (with the error-budget part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# An SLO whose error budget is smaller than this cannot be measured from request counts, and its
# burn rate (error ratio / budget) divides by what rounds to zero.
MIN_ERROR_BUDGET = 1e-6


@dataclass(frozen=True)
class SLO:
    ttft_seconds: float = 0.5
    itl_seconds: float = 0.05

    def __post_init__(self) -> None:
        for name, v in (("ttftSeconds", self.ttft_seconds), ("itlSeconds", self.itl_seconds)):
            if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ValueError(f"spec.slo.{name}: must be a positive number of seconds, got {v!r}")

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft=0.5,itl=0.05` (seconds; either may be left out), as `--slo` takes it."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "itl"):
                raise ValueError(f"--slo: expected ttft=SECONDS,itl=SECONDS (e.g. ttft=0.5,itl=0.05), got {part!r}")
            try:
                v = float(raw)
            except ValueError:
                raise ValueError(f"--slo: {key}={raw} is not a number of seconds") from None
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"--slo: {key} must be a positive number of seconds, got {raw!r}")
            values[key] = v
        return cls(ttft_seconds=values.get("ttft", 0.5), itl_seconds=values.get("itl", 0.05))

    def as_text(self) -> str:
        return f"ttft={self.ttft_seconds:g},itl={self.itl_seconds:g}"
