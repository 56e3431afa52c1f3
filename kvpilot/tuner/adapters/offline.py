"""The offline applier: the engine twin in virtual time (no HTTP, no Prometheus).

`TwinEvaluator`: a trial's config becomes a twin `Engine` and its value the capacity
`core.capacity.find_capacity` finds (or, for the gpus goal, the GPUs that capacity needs for a load). What capacity means and how it is measured: docs/architecture.md,
"Capacity, offline".
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kvpilot.fleet.regime import TARGET_UTILIZATION, gpus_needed
from kvpilot.tuner.core.capacity import CapacityResult, find_capacity
from kvpilot.tuner.core.objective import SLO, Goal, Measurement, Outcome, infeasible, score
from kvpilot.tuner.core.space import EngineParams
from kvpilot.tuner.core.startup import StartupMemory
from kvpilot.twin.profiles import DeviceProfile
from kvpilot.twin.workload import PRESETS, LengthDist, Workload, WorkloadError

__all__ = ["PRESETS", "RunStats", "StartupFailed", "TwinEvaluator", "TwinTarget", "Workload", "WorkloadError", "parse_workload",
           "workload_from_estimate"]

# Seconds of arrivals each capacity probe serves, and the warm-up at its start that is not measured.
PROBE_SECONDS = 150.0
WARMUP_SECONDS = 30.0
# Requests drawn at a time for a probe's unit-rate sequence.
UNIT_BLOCK = 4096
# A probed rate passes when an upper confidence bound of each p99, not the p99 of one finite run,
# is within the SLO: near its capacity a config's p99 moves little with the rate and a run's p99
# is noisy, so the bare p99 would let a lucky run set a capacity that the next run misses.
CONFIDENCE = 0.95
# ... and it must pass on two request sequences: near saturation a p99 depends on the arrival
# sequence (a burst of long prompts) more than the run's own confidence bound shows, and an
# optimiser picking the best of many configs would otherwise pick the luckiest sequence.
PATHS = 2


def parse_workload(text: str) -> Workload:
    """The twin's workload language (a preset, or a spec); the rate is the capacity search's.  A trace is
    read here, once, so that a missing or malformed file is refused before a study exists (every trial
    would otherwise fail on it, and a rerun resume into the same failures)."""
    workload = Workload.parse(text)
    if workload.arrival == "trace" and len(workload.generate(num_requests=1).arrival_s) == 0:
        raise WorkloadError(f"trace {workload.trace_path!r} has no requests")
    return workload

# --- the twin ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TwinTarget:
    """What the twin simulates: a model on a GPU, optionally perturbed (efficiencies and overheads).

    `model` is a preset name (or a Hugging Face id of one), or, as `vllm serve` takes it, a local model
    directory (or its config.json): the twin reads the shapes from its config.json.  `device_profile`,
    when given, is the device instead of the `gpu` preset: its peaks and its fitted step-time constants
    (kvpilot.twin.profiles; e.g. vLLM on this host's CPU), so the twin simulates what was measured."""

    model: str = "Llama-3.1-8B"
    gpu: str = "H100-80GB"
    max_model_len: int = 8192
    tensor_parallel_size: int = 1
    perturb: tuple[tuple[str, float], ...] = ()  # StepTimeParams field -> multiplier
    device_profile: DeviceProfile | None = None

    def gpu_spec(self) -> Any:
        """The device simulated: the profile's, else the `gpu` preset (UnknownGpuError names the presets)."""
        from kvpilot.twin.hardware import resolve_gpu

        return self.device_profile.device if self.device_profile is not None else resolve_gpu(self.gpu)

    def model_spec(self) -> Any:
        """The model: a local config.json (a directory holding one, or the file) when `model` names one
        that exists, else the preset (ModelSpecError lists them)."""
        from kvpilot.twin.models import load_model_config, resolve_model

        path = Path(self.model)
        if (path / "config.json").is_file() or (path.suffix == ".json" and path.is_file()):
            return load_model_config(path)
        return resolve_model(self.model)

    def engine_config(self, params: EngineParams) -> Any:
        from kvpilot.twin.engine import EngineConfig
        from kvpilot.twin.steptime import params_for

        gpu = self.gpu_spec()
        # The profile's fitted constants, else the twin's calibration for the GPU's architecture.
        stp = self.device_profile.step_time if self.device_profile is not None else None
        if self.perturb:
            base = stp or params_for(gpu)
            stp = replace(base, **{k: getattr(base, k) * f for k, f in self.perturb})
        return EngineConfig.resolve(
            self.model_spec(), gpu,
            max_num_batched_tokens=params.max_num_batched_tokens,
            max_num_seqs=params.max_num_seqs,
            gpu_memory_utilization=params.gpu_memory_utilization,
            max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
            step_time_params=stp,
        )

    def vllm_defaults(self) -> EngineParams:
        from kvpilot.twin.hardware import serve_defaults

        return EngineParams.vllm_defaults(serve_defaults(self.gpu_spec()))

    def perturbed(self, seed: int, spread: float = 0.2) -> TwinTarget:
        """The same target with its efficiency factors and overheads each off by up to `spread`."""
        from kvpilot.twin.steptime import StepTimeParams

        rng = random.Random(seed)
        names = [f for f in StepTimeParams.__dataclass_fields__ if f.endswith(("_eff", "_s"))]
        return replace(self, perturb=tuple((n, 1.0 + rng.uniform(-spread, spread)) for n in names))


@dataclass(frozen=True)
class RunStats:
    ttft_p99: float
    itl_p99: float
    completed: int
    stopped_early: bool
    preemptions: int
    kv_usage_peak: float


@dataclass(frozen=True)
class StartupFailed:
    """A config the twin could not start, in vLLM's words, with the numbers of a memory failure."""

    message: str
    memory: StartupMemory | None = None

    @classmethod
    def of(cls, exc: Any) -> StartupFailed:
        """From the twin's EngineStartupError: its fields carry the numbers (no text is parsed)."""
        if exc.kind == "config":
            return cls(str(exc))
        return cls(str(exc), StartupMemory(exc.kind, needed=exc.needed, available=exc.available,
                                           requested=exc.requested, weights=exc.weights,
                                           activation=exc.activation, non_torch=exc.non_torch))


def _p99s_at_capacity(res: CapacityResult) -> tuple[float, float]:
    """The p99 TTFT and ITL at the capacity found; where none was (no rate met the SLO), the lightest
    probe's, which says how far the config is from it."""
    if res.at_capacity is not None:
        return res.at_capacity
    _, ttft, itl, _ = min(res.probes, key=lambda p: p[0])
    return ttft, itl


class TwinEvaluator:
    """Capacity of configs on one target and workload, or their latency at a given rate.  Results
    are cached by (config, rate)."""

    def __init__(self, target: TwinTarget, workload: Workload, slo: SLO, seed: int = 0,
                 probe_s: float = PROBE_SECONDS, warmup_s: float = WARMUP_SECONDS, paths: int = PATHS) -> None:
        if not 0 <= warmup_s < probe_s:
            raise ValueError(f"the warm-up ({warmup_s:g} s) must be shorter than the probe ({probe_s:g} s)")
        if paths < 1:
            raise ValueError(f"paths must be >= 1, got {paths}")
        self.target, self.workload, self.slo, self.seed = target, workload, slo, seed
        self.probe_s, self.warmup_s, self.paths = probe_s, warmup_s, paths
        # Per path: its requests at rate 1, enough for the highest rate probed so far.
        self._units: list[Any] = [None] * paths
        self._runs: dict[tuple[EngineParams, float], RunStats] = {}
        # By config and hint: the bisection ends where its bracket from the hint leads, so one config
        # searched from two hints may answer two capacities a tolerance apart.
        self._caps: dict[tuple[EngineParams, float], CapacityResult | StartupFailed] = {}
        self._latency: dict[tuple[EngineParams, float], Outcome] = {}
        self.simulations = 0
        self.hint = 1.0

    def requests(self, rate: float, path: int = 0) -> Any:
        """A path's requests at `rate`: the first `probe_s` seconds of its unit-rate sequence."""
        need = rate * self.probe_s
        unit = self._units[path]
        while unit is None or unit.arrival_s[-1] < need:
            # Extended by blocks, each drawn from its own seed, so a longer sequence starts with the
            # shorter one: every rate (and every config) keeps seeing the same first requests.
            block = 0 if unit is None else len(unit) // UNIT_BLOCK
            more = self.workload.with_rate(1.0).generate(num_requests=UNIT_BLOCK, seed=(self.seed, path, block))
            unit = more if unit is None else unit.then(more)
        self._units[path] = unit
        batch = unit.at_rate(rate)
        return batch.head(int(np.searchsorted(batch.arrival_s, self.probe_s)))

    # -- one virtual-time run -------------------------------------------------------------
    def run(self, params: EngineParams, rate: float) -> RunStats:
        """Serve each path's requests at `rate` req/s; the worse p99s of the paths.  A path that
        misses the SLO ends the probe (the others cannot make it pass).  Raises EngineStartupError."""
        batches = [self.requests(rate, k) for k in range(self.paths)]
        key = (params, round(rate, 6))
        if key in self._runs:
            return self._runs[key]
        from kvpilot.twin.engine import Engine
        from kvpilot.twin.offline import drive, observed_p99

        worst: RunStats | None = None
        for batch in batches:
            engine = Engine(self.target.engine_config(params))
            self.simulations += 1
            trace = drive(engine, batch, window_s=self.probe_s, stop_on_miss=self.slo,
                          measure_from_s=self.warmup_s)
            ttft, itl = observed_p99(trace, self.warmup_s, confidence=CONFIDENCE)
            stats = RunStats(ttft, itl, len(trace.done), trace.stopped, engine.scheduler.num_preemptions_total,
                             trace.usage_max)
            worst = stats if worst is None else RunStats(
                max(worst.ttft_p99, ttft), max(worst.itl_p99, itl), min(worst.completed, stats.completed),
                worst.stopped_early or stats.stopped_early, max(worst.preemptions, stats.preemptions),
                max(worst.kv_usage_peak, stats.kv_usage_peak))
            if ttft > self.slo.ttft_seconds or itl > self.slo.itl_seconds:
                break
        assert worst is not None
        self._runs[key] = worst
        return worst

    # -- capacity -------------------------------------------------------------------------
    def capacity(self, params: EngineParams) -> CapacityResult | StartupFailed:
        """The capacity search for `params`, or why the twin could not start (or serve) it."""
        key = (params, self.hint)
        if key in self._caps:
            return self._hinted(self._caps[key])
        from kvpilot.twin.memory import EngineStartupError

        def probe(rate: float) -> tuple[float, float]:
            s = self.run(params, rate)
            return s.ttft_p99, s.itl_p99

        try:
            res: CapacityResult | StartupFailed = find_capacity(
                probe, self.slo.ttft_seconds, self.slo.itl_seconds, hint=self.hint, rel_tol=0.02
            )
        except EngineStartupError as exc:
            res = StartupFailed.of(exc)
        except ValueError as exc:  # a request the config cannot serve (longer than max_model_len)
            res = StartupFailed(str(exc))
        self._caps[key] = res
        return self._hinted(res)

    def _hinted(self, res: CapacityResult | StartupFailed) -> CapacityResult | StartupFailed:
        if isinstance(res, CapacityResult) and res.capacity > 0:
            self.hint = res.capacity  # the next search starts near the last answer
        return res

    def resume(self, capacities: Iterable[float | None]) -> None:
        """Carry on from a study an earlier process searched (the capacities it found, in trial
        order): the next search starts from the hint that process would have had, so a run resumed
        after a kill finds the capacities the uninterrupted run found."""
        for capacity in capacities:
            if capacity is not None and capacity > 0:
                self.hint = capacity

    def evaluate(self, params: EngineParams) -> Outcome:
        """The capacity goal's outcome for one config."""
        res = self.capacity(params)
        if isinstance(res, StartupFailed):
            return infeasible(Goal.CAPACITY, "StartupFailed", res.message.splitlines()[0][:300], memory=res.memory)
        ttft, itl = _p99s_at_capacity(res)
        m = Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=res.capacity, capacity=res.capacity,
                        extra={"simulations": float(res.simulations)})
        return score(Goal.CAPACITY, m, self.slo)

    # -- GPUs for a load (a service that autoscales) ---------------------------------------
    def gpus(self, params: EngineParams, rate: float, target_utilization: float = TARGET_UTILIZATION) -> Outcome:
        """The gpus goal's outcome for one config: the GPUs its replicas need to carry `rate` req/s of
        this workload's mix within the SLO (`fleet.regime.gpus_needed` over the capacity search's
        answer, times the target's tensor-parallel size)."""
        res = self.capacity(params)
        if isinstance(res, StartupFailed):
            return infeasible(Goal.GPUS, "StartupFailed", res.message.splitlines()[0][:300], memory=res.memory)
        ttft, itl = _p99s_at_capacity(res)
        need = gpus_needed(rate, res.capacity, tensor_parallel_size=self.target.tensor_parallel_size,
                           target_utilization=target_utilization) if res.capacity > 0 else None
        m = Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=rate, capacity=res.capacity, gpus=need,
                        extra={"simulations": float(res.simulations)})
        return score(Goal.GPUS, m, self.slo)

    # -- latency at a given load ----------------------------------------------------------
    def latency(self, params: EngineParams, rate: float) -> Outcome:
        """The latency goal's outcome for one config at `rate` req/s (a live study's measured load):
        each path served to its last request (no early stop, so a config that misses the SLO is
        graded by how far), p99 TTFT and p99 ITL of its requests after the warm-up as the live
        tuner reads them (`histogram_quantile` over vLLM's buckets: `twin.offline.read_p99`),
        averaged over the paths (a ranking wants the likeliest p99, not a bound on it)."""
        key = (params, round(rate, 6))
        if key in self._latency:
            return self._latency[key]
        from kvpilot.twin.engine import Engine
        from kvpilot.twin.memory import EngineStartupError
        from kvpilot.twin.offline import drive, read_p99

        try:
            p99s = []
            for path in range(self.paths):
                engine = Engine(self.target.engine_config(params))
                self.simulations += 1
                trace = drive(engine, self.requests(rate, path), window_s=self.probe_s)
                p99s.append(read_p99(trace, self.warmup_s))
        except EngineStartupError as exc:
            failed = StartupFailed.of(exc)
            out = infeasible(Goal.LATENCY, "StartupFailed", failed.message.splitlines()[0][:300], memory=failed.memory)
        except ValueError as exc:  # a request the config cannot serve (longer than max_model_len)
            out = infeasible(Goal.LATENCY, "StartupFailed", str(exc).splitlines()[0][:300])
        else:
            m = Measurement(ttft_p99=float(np.mean([t for t, _ in p99s])), itl_p99=float(np.mean([i for _, i in p99s])),
                            request_rate=rate, extra={"simulations": float(self.paths)})
            out = score(Goal.LATENCY, m, self.slo)
        self._latency[key] = out
        return out

    def evaluator(self, goal: Goal, rate: float | None = None) -> Any:
        """An `Evaluate` for `goal`: capacity, or latency or GPUs at `rate` req/s."""
        if goal is Goal.CAPACITY:
            return self.evaluate
        if rate is None or rate <= 0:
            raise ValueError(f"the {goal.value} goal is scored at a request rate > 0, got {rate}")
        if goal is Goal.GPUS:
            return lambda params: self.gpus(params, rate)
        return lambda params: self.latency(params, rate)


def workload_from_estimate(est: Any) -> Workload:
    """A twin workload shaped like a live one (a `core.warmstart.WorkloadEstimate`)."""
    return Workload(
        prompt=LengthDist("lognormal", est.prompt_median, est.prompt_sigma, 1, 32768),
        output=LengthDist("lognormal", est.output_median, est.output_sigma, 1, 8192),
        name="live",
    )
