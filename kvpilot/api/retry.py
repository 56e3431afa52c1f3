"""How long a Kubernetes API client waits before it tries a failed call again.

Bounded exponential backoff with jitter, as client-go and kopf do it, and the server's own word
first: a `Retry-After` is the least a retry waits (kopf's rule too, `enforce_retry_after=False`).
A wait the server asks for beyond `max_wait` is not slept through inside one call: the call gives up
at once and leaves the wait to whoever schedules the work again (kopf's TemporaryError delay).

The jitter comes from a `random.Random` the client owns, seeded from the settings where a run must
be reproducible; its only job is to keep many objects' retries from arriving in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """`retries` further attempts after the first; the n-th retry waits about base * factor**n, at
    most `cap`, spread by +-`jitter` (a fraction), and never less than a Retry-After."""

    retries: int = 5
    base: float = 0.2
    factor: float = 2.0
    cap: float = 5.0
    jitter: float = 0.25
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        problems = []
        if self.retries < 0:
            problems.append(f"retries must be >= 0 (got {self.retries})")
        if self.base < 0 or self.cap < 0 or self.max_wait < 0:
            problems.append(f"base, cap and max_wait must be >= 0 seconds (got {self.base}, {self.cap}, "
                            f"{self.max_wait})")
        if self.factor < 1:
            problems.append(f"factor must be >= 1 (got {self.factor})")
        if not 0 <= self.jitter < 1:
            problems.append(f"jitter must be a fraction in [0, 1) (got {self.jitter})")
        if problems:
            raise ValueError("; ".join(problems))

    def delay(self, retry: int, rng: random.Random, retry_after: float | None = None) -> float | None:
        """Seconds to wait before retry number `retry` (0 is the first retry), or None when there is
        no retry left or the server asked for more than `max_wait`."""
        if retry >= self.retries:
            return None
        if retry_after is not None and retry_after > self.max_wait:
            return None
        wait = min(self.cap, self.base * self.factor ** retry)
        wait *= 1 + self.jitter * (2 * rng.random() - 1)
        return max(wait, retry_after or 0.0)

    def escalating(self, attempt: int, rng: random.Random, *, base: float, cap: float,
                   retry_after: float | None = None) -> float:
        """The wait before attempt `attempt` (0-based) of a job scheduled again and again, never given
        up (a rollback): base * factor**attempt up to `cap`, the same jitter, at least a Retry-After."""
        wait = min(cap, base * self.factor ** min(attempt, 64))
        wait *= 1 + self.jitter * (2 * rng.random() - 1)
        return max(wait, retry_after or 0.0)
