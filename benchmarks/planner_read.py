"""What one read of the planner in the tuner costs (kvpilot/tuner/capacity.py): the twin's envelope for a
(config, token mix) the first time, the p99 prediction for a per-replica rate, and a cached read.

    python benchmarks/planner_read.py

Bed: Llama-3-8B-Instruct on an H100-80GB twin at vLLM-like settings (maxNumBatchedTokens 2048, maxNumSeqs
256, gpuMemoryUtilization 0.9), TwinCapacity's defaults (10 rates, 120 s each, a 1500-request flood),
mixes of 512/128 and 2000/150 mean prompt/output tokens.  Prints seconds per read and the capacity found.
The planner reads every --scrape-interval (30 s by default): a first read must fit well inside it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpilot.api import InferenceService  # noqa: E402
from kvpilot.tuner.capacity import TwinCapacity  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a coarser envelope (4 rates of 30 s): the same path")
    args = parser.parse_args()
    isvc = InferenceService.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "b", "namespace": "b"},
        "spec": {"model": "meta-llama/Meta-Llama-3-8B-Instruct", "replicas": 2,
                 "engine": {"maxNumBatchedTokens": 2048, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.9},
                 "autoscaling": {"maxReplicas": 10}}})
    cap = TwinCapacity(points=4, duration_s=30.0, flood_requests=300) if args.smoke else TwinCapacity()
    print(f"{'read':<34} {'seconds':>8} {'twin req/s':>11} {'corrected':>10}")
    for label, mix, measured in (("first read, mix 512/128", (512.0, 128.0), (None, None)),
                                 ("cached, same mix", (530.0, 125.0), (None, None)),
                                 ("cached envelope, p99 correction", (512.0, 128.0), (0.3, 0.03)),
                                 ("cached, same rate bucket", (512.0, 128.0), (0.3, 0.03)),
                                 ("first read, mix 2000/150", (2000.0, 150.0), (None, None))):
        started = time.perf_counter()
        c = cap.capacity(isvc, *mix, rate=20.0, replicas=2, ttft_p99_s=measured[0], itl_p99_s=measured[1])
        print(f"{label:<34} {time.perf_counter() - started:8.3f} {c.twin_rps:11.2f} {c.per_replica_rps:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
