"""How long a new vLLM replica takes from its pod starting until it serves: the twin's start-up model.

A replica asked for now carries load only after this time, so the fleet planner forecasts the load
over it (kvpilot.fleet.planner) and the fleet twin delays new replicas by it (kvpilot.twin.fleet).

vLLM's start-up, as its log shows it (V1 engine, one line per part):

    process   Python imports, the engine core process, the device and distributed set-up, up to
              "Starting to load model";
    weights   "Loading weights took X seconds": one rank's shard of the weights (the memory plan's
              `weight_bytes_per_rank`), the ranks reading in parallel at the node's bandwidth from
              wherever the model lives;
    compile   "torch.compile takes X s in total": Dynamo's bytecode transform (the whole model traced:
              grows with the layers) and Inductor compiling the piecewise graph (about the same for
              every dense decoder); from vLLM's compile cache Inductor's part is a load, Dynamo's is not;
    profile   the memory-profiling forward pass and the KV cache's allocation;
    graphs    "Graph capturing finished in X secs": one CUDA graph per capture size (none with
              --enforce-eager);
    server    the API server starting, then the kubelet's startup probe seeing it (half its period on
              average).

Calibrated on the two real start-ups in shared/data/gpu-serving (vLLM 0.11.0, CodeLlama-34B, 62.9 GiB of
bf16 weights, TP 1 on an H100, model from a node cache, compile cache cold): 105.3 s and 110.6 s from the
first log line to the API server. That is all the start-up data there is: the per-layer split of the
compile time and the compile cache's saving are vLLM's design read from its log lines, not measured
here, and other storage is a different `weights_gib_per_s` (the one number worth setting per cluster).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from kvpilot.twin.hardware import GiB
from kvpilot.twin.memory import weight_bytes_per_rank
from kvpilot.twin.models import ModelSpec

# From the two logs (means of the two runs; see the module docstring).
PROCESS_S = 17.1  # first log line -> "Starting to load model": 17.15 and 17.10 s
WEIGHTS_GIB_PER_S = 1.08  # 62.86 GiB in 59.08 and 57.66 s
DYNAMO_S_PER_LAYER = 4.76 / 48  # "Dynamo bytecode transform time": 4.79 and 4.73 s, 48 layers
INDUCTOR_S = 16.1  # "Compiling a graph for dynamic shape takes": 16.32 and 15.89 s
INDUCTOR_CACHED_S = 2.0  # loading the compiled graph from vLLM's cache: not in the data, an assumption
PROFILE_S = 6.5  # init engine minus compile minus graphs: 4.8 and 8.2 s
GRAPHS_S = 4.0  # 2 and 6 s for vLLM 0.11's 67 capture sizes
DEFAULT_CAPTURE_SIZES = 67
SERVER_S = 0.45  # "init engine" -> "Starting vLLM API server": 0.49 and 0.39 s
STARTUP_PROBE_PERIOD_S = 10.0  # the operator's startup probe (kvpilot.operator.builders.deployment)


@dataclass(frozen=True)
class ColdStart:
    """One replica's start-up, by part, in seconds."""

    process_s: float
    weights_s: float
    compile_s: float
    profile_s: float
    graphs_s: float
    server_s: float

    @property
    def total_s(self) -> float:
        return self.process_s + self.weights_s + self.compile_s + self.profile_s + self.graphs_s + self.server_s

    def parts(self) -> dict[str, float]:
        return {"process": self.process_s, "weights": self.weights_s, "compile": self.compile_s,
                "profile": self.profile_s, "graphs": self.graphs_s, "server": self.server_s}


def predict_cold_start(model: ModelSpec, *, tensor_parallel_size: int = 1, enforce_eager: bool = False,
                       compile_cached: bool = False, weights_gib_per_s: float = WEIGHTS_GIB_PER_S,
                       capture_sizes: int = DEFAULT_CAPTURE_SIZES,
                       startup_probe_period_s: float = STARTUP_PROBE_PERIOD_S) -> ColdStart:
    """The start-up of one replica of `model`: see the module docstring for each part's source."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1 (got {tensor_parallel_size})")
    if weights_gib_per_s <= 0:
        raise ValueError(f"weights_gib_per_s must be > 0 (got {weights_gib_per_s})")
    # What one rank loads is what it holds (vLLM's "Model loading took X GiB"): the memory plan's figure.
    weights = weight_bytes_per_rank(model, tensor_parallel_size) / GiB / weights_gib_per_s
    if enforce_eager:
        compile_s, graphs = 0.0, 0.0  # --enforce-eager: neither torch.compile nor CUDA graphs
    else:
        inductor = INDUCTOR_CACHED_S if compile_cached else INDUCTOR_S
        compile_s = DYNAMO_S_PER_LAYER * model.num_hidden_layers + inductor
        graphs = GRAPHS_S * capture_sizes / DEFAULT_CAPTURE_SIZES
    return ColdStart(process_s=PROCESS_S, weights_s=weights, compile_s=compile_s, profile_s=PROFILE_S,
                     graphs_s=graphs, server_s=SERVER_S + startup_probe_period_s / 2)


# -- reading a real start-up from vLLM's log, to compare the model with ----------------------------------------

_STAMP = re.compile(r"^(?:\w+ )?(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d+)")
_PARTS = {
    "weights_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "compile_s": re.compile(r"torch\.compile takes ([\d.]+) s in total"),
    "graphs_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) seconds"),
}


def _when(line: str) -> datetime | None:
    m = _STAMP.match(line)
    return datetime.fromisoformat(m.group(1).replace(",", ".")) if m else None


def read_startup_log(text: str) -> ColdStart:
    """A vLLM V1 server log's start-up, by the parts `predict_cold_start` models (server: 0 probe time).

    Raises ValueError naming the line that is missing when the log is not a whole start-up."""
    lines = text.splitlines()
    first = next((t for t in map(_when, lines) if t is not None), None)
    load = next((_when(x) for x in lines if "Starting to load model" in x), None)
    api = next((_when(x) for x in lines if "Starting vLLM API server" in x), None)
    init = next((_when(x) for x in lines if _PARTS["init_engine_s"].search(x)), None)
    found: dict[str, float] = {}
    for key, pattern in _PARTS.items():
        for line in lines:
            if m := pattern.search(line):
                found[key] = float(m.group(1))
                break
    missing = [k for k, v in (("a time-stamped line", first), ("'Starting to load model'", load),
                              ("'Starting vLLM API server'", api), ("'init engine ... took'", init)) if v is None]
    missing += [f"'{_PARTS[k].pattern}'" for k in ("weights_s", "init_engine_s") if k not in found]
    if missing or first is None or load is None or api is None or init is None:
        raise ValueError(f"not a whole vLLM start-up log: no {', '.join(missing)}")
    compile_s, graphs = found.get("compile_s", 0.0), found.get("graphs_s", 0.0)
    weights_end = (load - first).total_seconds() + found["weights_s"]
    engine_start = (init - first).total_seconds() - found["init_engine_s"]
    return ColdStart(process_s=(load - first).total_seconds(), weights_s=found["weights_s"], compile_s=compile_s,
                     profile_s=found["init_engine_s"] - compile_s - graphs + max(0.0, engine_start - weights_end),
                     graphs_s=graphs, server_s=(api - init).total_seconds())
