"""A host's speed now, read against the observations its profile was fitted on
(benchmarks/twin_vs_vllm.py --probe): `probe_scale` the factor, `rescaled` the profile on a host that
many times as slow.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import numpy as np

from kvpilot.twin.calibration.served import predict
from kvpilot.twin.profiles import DeviceProfile
from kvpilot.twin.steptime import StepTimeParams

# This shared 2-core host does not keep one speed.  Between a calibration and the replay five minutes
# after it (2026-12-03 13:12-13:30 UTC), a lone decode step of the calibration ran 32-45% faster than
# the morning's while a lone prompt's prefill ran 10-27% slower, and the replay then found the server
# slower than either; two repeats of one trace differed by up to 50% in p50 ITL.  A profile fitted
# minutes earlier describes another machine.  So before each repeat the case's own server is probed
# (lone decodes and lone prompts, as the calibration measures them) and the twin runs that repeat on
# the profile slowed or sped up uniformly (every time term multiplied, the device's peaks divided, by
# one factor) to the geometric mean of the probe's measured over predicted times.  One factor, not
# one for fixed costs and one for arithmetic: on this tiny model a decode step is half weight reads,
# so the two are not told apart by so small a probe.  The probe is not the trace: the twin never sees
# the figures it is judged on, only the machine's speed of the minute.
PROBE_DECODES = ((1, 16), (8, 512))  # (sequences, prompt tokens)
PROBE_PROMPTS = (256, 1024)
PROBE_LIMITS = (0.5, 2.0)  # a factor outside is a probe gone wrong, not a host
# Every constant in seconds (launch floors, the engine's CPU overheads, the frontend's costs).
TIME_TERMS = tuple(f.name for f in fields(StepTimeParams) if f.name.endswith("_s"))


def rescaled(profile: DeviceProfile, factor: float) -> DeviceProfile:
    """The profile on a host `factor` times as slow: every step, every frontend cost that long."""
    params = replace(profile.step_time, **{k: getattr(profile.step_time, k) * factor for k in TIME_TERMS})
    device = replace(profile.device, bf16_flops=profile.device.bf16_flops / factor,
                     hbm_bandwidth=profile.device.hbm_bandwidth / factor)
    return DeviceProfile(device, params, profile.source)


def _probe_key(o: dict[str, Any]) -> tuple[str, int, int]:
    return o["kind"], int(o.get("n") or 1), int(o["prompt"])


def probe_scale(model: Any, profile: DeviceProfile, probes: list[dict[str, Any]],
                reference: list[dict[str, Any]] | None = None) -> float:
    """How much slower than at calibration the host ran the probe: the geometric mean over the probe's
    observations of measured over predicted, each divided by the same ratio of the calibration's own
    observation of that kind (`reference`, the observations the profile was fitted on; 1 where it has
    none), so a fit that is 10% long on one observation does not read as a host 10% fast; held within
    PROBE_LIMITS.  (A uniform factor scales every prediction by itself.  The calibration prefilled its
    prompts in chunks of CAL_BUDGET: its fit's miss on a prompt is taken as the same at the case's
    budget.)  An observation that measured nothing (NaN) is left out; with none left the factor is 1."""
    def measured_over_predicted(obs: list[dict[str, Any]]) -> np.ndarray:
        return np.array([o["seconds"] for o in obs]) / predict(model, profile.device, profile.step_time, obs)

    ratios = measured_over_predicted(probes)
    ref = {_probe_key(o): o for o in reference or () if o["kind"] in ("decode", "prefill")}
    matched = [i for i, o in enumerate(probes) if _probe_key(o) in ref]
    if matched:
        ratios[matched] /= measured_over_predicted([ref[_probe_key(probes[i])] for i in matched])
    ratios = ratios[np.isfinite(ratios) & (ratios > 0)]
    factor = float(np.exp(np.mean(np.log(ratios)))) if len(ratios) else 1.0
    return min(PROBE_LIMITS[1], max(PROBE_LIMITS[0], factor))
