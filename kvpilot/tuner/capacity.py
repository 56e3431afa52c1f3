"""One replica's sustained capacity within the SLO, for the planner in the tuner: the engine twin's
envelope of the config in force at the token mix Prometheus sees, corrected by the ratio of the
measured p99s to the twin's prediction at the same per-replica load (`corrected_capacity`).

The twin costs a second or so per envelope, so envelopes are kept per (model, GPU, config, SLO, mix
bucket) and shared by every service's scaler; the p99 prediction per (those, rate bucket).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpilot.fleet.planner import corrected_capacity
from kvpilot.tuner.scaling import mix_bucket

if TYPE_CHECKING:
    from kvpilot.api import InferenceService

# No token histograms scraped (an engine older than vLLM 0.6, or no requests finished yet): the
# ShareGPT mix the twin's chat preset serves.
DEFAULT_MIX = "prompt=sharegpt,output=sharegpt"
# The spread of the lognormal the twin draws a bucket's lengths from (a mean alone is measured).
MIX_SIGMA = 0.5


class NoCapacityModel(Exception):
    """The twin cannot simulate this service (no preset for its model or GPU)."""


@dataclass(frozen=True)
class Capacity:
    per_replica_rps: float  # corrected
    twin_rps: float
    mix: str


def mix_spec(prompt_tokens: float, output_tokens: float) -> str:
    if prompt_tokens <= 0 or output_tokens <= 0:
        return DEFAULT_MIX
    p, o = mix_bucket(prompt_tokens, output_tokens)
    # Medians of lognormals whose means are the bucket's (mean = median * exp(sigma^2 / 2)).
    scale = math.exp(MIX_SIGMA ** 2 / 2)
    return (f"prompt=lognormal/{max(1, round(p / scale))}/{MIX_SIGMA},"
            f"output=lognormal/{max(1, round(o / scale))}/{MIX_SIGMA}")


class TwinCapacity:
    def __init__(self, *, points: int = 10, duration_s: float = 120.0, flood_requests: int = 1500) -> None:
        self.points, self.duration_s, self.flood_requests = points, duration_s, flood_requests
        self._lock = threading.Lock()
        self._envelopes: dict[tuple[Any, ...], Any] = {}
        self._p99s: dict[tuple[Any, ...], tuple[float, float]] = {}

    def _engine(self, isvc: InferenceService) -> tuple[Any, Any, tuple[Any, ...]]:
        from kvpilot.api.slo import SLO
        from kvpilot.api.tuned import TUNED
        from kvpilot.tuner.adapters.offline import TwinTarget
        from kvpilot.tuner.core.space import EngineParams

        spec = isvc.spec
        params = EngineParams.from_spec({f.name: spec.engine.in_force(f) or 0 for f in TUNED})
        twin = TwinTarget(model=spec.model, gpu=spec.engine.twin.gpu, max_model_len=spec.engine.max_model_len or 8192,
                          tensor_parallel_size=spec.engine.tensor_parallel_size)
        try:
            config = twin.engine_config(params)
        except (ValueError, KeyError) as exc:
            raise NoCapacityModel(f"the engine twin cannot simulate {spec.model} on {twin.gpu}: {exc}") from None
        slo = SLO(spec.slo.ttft_seconds, spec.slo.itl_seconds)
        key = (spec.model, twin.gpu, twin.max_model_len, twin.tensor_parallel_size, params, slo)
        return config, slo, key

    def capacity(self, isvc: InferenceService, prompt_tokens: float, output_tokens: float, *, rate: float,
                 replicas: int, ttft_p99_s: float | None, itl_p99_s: float | None) -> Capacity:
        """The per-replica capacity at this mix, corrected by the measured p99s at `rate` over `replicas`."""
        from kvpilot.twin.fleet import measure_envelope

        config, slo, key = self._engine(isvc)
        mix = mix_spec(prompt_tokens, output_tokens)
        with self._lock:  # one twin run at a time: the tuner's CPU is shared with its trials
            envelope = self._envelopes.get((*key, mix))
            if envelope is None:
                envelope = measure_envelope(config, mix, slo, points=self.points, duration_s=self.duration_s,
                                            flood_requests=self.flood_requests)
                self._envelopes[(*key, mix)] = envelope
        twin_rps = float(envelope.capacity_rps)
        if replicas <= 0 or rate <= 0 or (not ttft_p99_s and not itl_p99_s):
            return Capacity(twin_rps, twin_rps, mix)
        predicted = self._predicted_p99s(config, slo, key, mix, rate / replicas)
        # The SLI the fleet misses the prediction on most sets the correction.
        pairs = [(p, m) for p, m in zip(predicted, (ttft_p99_s, itl_p99_s), strict=True) if p > 0 and m]
        if not pairs:
            return Capacity(twin_rps, twin_rps, mix)
        p, m = max(pairs, key=lambda pm: (pm[1] or 0.0) / pm[0])
        return Capacity(corrected_capacity(twin_rps, p, m), twin_rps, mix)

    def _predicted_p99s(self, config: Any, slo: Any, key: tuple[Any, ...], mix: str,
                        per_replica_rate: float) -> tuple[float, float]:
        """The twin's (TTFT, ITL) p99s at a per-replica rate, on a 10% grid of rates."""
        from kvpilot.twin.offline import simulate

        step = round(math.log(max(per_replica_rate, 1e-3), 1.1))
        rate = 1.1 ** step
        with self._lock:
            found = self._p99s.get((*key, mix, step))
            if found is None:
                report = simulate(config, f"poisson:rate={rate:.6g},{mix}", duration_s=self.duration_s, slo=slo)
                found = (float(report.ttft_s["p99"]), float(report.itl_s["p99"]))
                self._p99s[(*key, mix, step)] = found
        return found
