"""`kvpilot tune --local` gives up, saying why, when Prometheus never shows the engine.

The live loop pauses while signals are missing and waits for them to come back, which is right once
tuning is under way (a Prometheus restart, a lull in traffic).  But a run whose signals never arrive
at all -- a wrong --prometheus URL, a Prometheus that does not scrape the engine, no load -- would
otherwise wait forever.  This wraps the signal source: until the first good reading, it lets the loop
pause for up to `timeout_s`, then ends the run with the last reason and what to check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvpilot.tuner.core.loop import SignalsUnavailable
from kvpilot.tuner.core.objective import Measurement

T = TypeVar("T")


class SignalsNeverCame(Exception):
    """No usable signal since the start of the run, for longer than the timeout."""


class FirstSignalsWatchdog:
    def __init__(self, inner: Any, timeout_s: float, hint: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner, self.timeout_s, self.hint, self.clock = inner, timeout_s, hint, clock
        self.started = clock()
        self.seen = False

    def _guard(self, call: Callable[[], T]) -> T:
        try:
            value = call()
        except SignalsUnavailable as exc:
            waited = self.clock() - self.started
            if not self.seen and self.timeout_s > 0 and waited >= self.timeout_s:
                raise SignalsNeverCame(
                    f"no signals after {waited:.0f}s ({exc.reason}: {exc.message}); {self.hint}") from None
            raise
        self.seen = True
        return value

    def burn_rate(self, window_s: float, track: Any = None) -> float:
        if track is None:
            return self._guard(lambda: self.inner.burn_rate(window_s))
        return self._guard(lambda: self.inner.burn_rate(window_s, track=track))

    def measure(self, window_s: float) -> Measurement:
        return self._guard(lambda: self.inner.measure(window_s))

    def measure_tracks(self, window_s: float) -> tuple[Measurement, Measurement]:
        return self._guard(lambda: self.inner.measure_tracks(window_s))

    def __getattr__(self, name: str) -> Any:  # request_rate, quantiles, ...: as the wrapped source
        return getattr(self.inner, name)
