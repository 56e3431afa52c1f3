"""The offline applier: the engine twin in virtual time (no HTTP, no Prometheus).

A trial's config becomes a twin `Engine`; its capacity is the highest Poisson request rate at
which both p99s (TTFT and ITL) stay within the SLO, found by `core.capacity.find_capacity`.

Each probe is one virtual-time run of a fixed request sequence: lengths and unit-rate arrival
gaps are drawn once per seed and scaled by 1/rate, so every rate (and every config) sees the same
requests (common random numbers: differences come from the config, not from the dice).  A run
stops as soon as more than 1% of its requests (or token gaps) already missed the SLO: the p99
cannot come back under it, and over-capacity runs, whose queues grow without bound, are the slow
ones.  That, plus caching by (config, rate), keeps a capacity search well under a second for
small models.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvpilot.tuner.core.capacity import CapacityResult, find_capacity
from kvpilot.tuner.core.objective import SLO, Goal, Measurement, Outcome, infeasible, score
from kvpilot.tuner.core.space import EngineParams

# --- workloads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: fixed, uniform (lo..hi) or lognormal (median, sigma), clipped."""

    kind: str = "fixed"
    a: float = 512  # fixed value | uniform low | lognormal median
    b: float = 0.0  # uniform high | lognormal sigma
    lo: int = 1
    hi: int = 32768

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise ValueError(f"length kind must be fixed, uniform or lognormal, got {self.kind!r}")
        if self.a < 1:
            raise ValueError(f"length must be >= 1, got {self.a}")

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            v = self.a
        elif self.kind == "uniform":
            v = rng.uniform(self.a, max(self.a, self.b))
        else:
            v = self.a * math.exp(rng.gauss(0.0, self.b))
        return int(min(max(round(v), self.lo), self.hi))

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + max(self.a, self.b)) / 2
        return self.a * math.exp(self.b**2 / 2)

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """`512`, `uniform:128:1024`, `lognormal:800:0.7`."""
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            kind, a, b = parts[0], float(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0
        except ValueError:
            raise ValueError(f"lengths: expected N, uniform:LO:HI or lognormal:MEDIAN:SIGMA, got {text!r}") from None
        return cls(kind, a, b)

    def as_text(self) -> str:
        if self.kind == "fixed":
            return f"{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class Workload:
    """Poisson (cv 1) or gamma (other cv) arrivals with independent prompt and output lengths."""

    prompt: Lengths = field(default_factory=lambda: Lengths("lognormal", 512, 0.8, 16, 6144))
    output: Lengths = field(default_factory=lambda: Lengths("lognormal", 160, 0.7, 8, 1024))
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps (1 = Poisson)
    num_requests: int = 160
    name: str = "chat"

    def requests(self, seed: int) -> list[tuple[float, int, int]]:
        """(unit-rate arrival time, prompt tokens, output tokens), the same for every rate."""
        rng = random.Random(seed)
        t = 0.0
        out = []
        shape = 1.0 / (self.cv**2)
        for _ in range(self.num_requests):
            t += rng.gammavariate(shape, 1.0 / shape)
            out.append((t, self.prompt.draw(rng), self.output.draw(rng)))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "prompt": self.prompt.as_text(), "output": self.output.as_text(),
                "cv": self.cv, "numRequests": self.num_requests}


WORKLOADS: dict[str, Workload] = {
    # Chat: medium prompts, medium answers (ShareGPT-like spread).
    "chat": Workload(),
    # RAG / summarisation: long prompts, short answers: prefill-heavy, the token budget matters most.
    "rag": Workload(Lengths("lognormal", 2048, 0.5, 256, 7168), Lengths("lognormal", 96, 0.5, 8, 512),
                    name="rag"),
    # Code completion / agents: short prompts, long answers: decode-heavy, KV and seqs matter most.
    "decode": Workload(Lengths("lognormal", 256, 0.6, 16, 2048), Lengths("lognormal", 400, 0.5, 32, 1536),
                       name="decode"),
    # Bursty chat traffic.
    "bursty": Workload(cv=2.5, name="bursty"),
}


def parse_workload(text: str | Mapping[str, Any]) -> Workload:
    """A preset name (chat, rag, decode, bursty) or `prompt=...,output=...,cv=...,requests=...`."""
    if isinstance(text, Mapping):
        base = WORKLOADS[str(text.get("preset", "chat"))] if "preset" in text else Workload(name="custom")
        kw: dict[str, Any] = {}
        if "prompt" in text:
            kw["prompt"] = Lengths.parse(str(text["prompt"]))
        if "output" in text:
            kw["output"] = Lengths.parse(str(text["output"]))
        if "cv" in text:
            kw["cv"] = float(text["cv"])
        if "numRequests" in text:
            kw["num_requests"] = int(text["numRequests"])
        if "name" in text:
            kw["name"] = str(text["name"])
        return replace(base, **kw)
    if text in WORKLOADS:
        return WORKLOADS[text]
    items: dict[str, Any] = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in ("prompt", "output", "cv", "requests", "preset"):
            raise ValueError(
                f"--workload: expected a preset ({', '.join(WORKLOADS)}) or "
                f"prompt=LEN,output=LEN[,cv=X][,requests=N], got {part!r}"
            )
        items["numRequests" if key == "requests" else key] = value
    return parse_workload(items)


# --- the twin ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TwinTarget:
    """What the twin simulates: a model on a GPU, optionally perturbed (efficiencies and overheads)."""

    model: str = "Llama-3.1-8B"
    gpu: str = "H100-80GB"
    max_model_len: int = 8192
    tensor_parallel_size: int = 1
    perturb: tuple[tuple[str, float], ...] = ()  # StepTimeParams field -> multiplier

    def engine_config(self, params: EngineParams) -> Any:
        from kvpilot.twin.engine import EngineConfig
        from kvpilot.twin.hardware import resolve_gpu
        from kvpilot.twin.models import resolve_model
        from kvpilot.twin.steptime import params_for

        gpu = resolve_gpu(self.gpu)
        stp = None  # the twin's calibration for the GPU's architecture
        if self.perturb:
            base = params_for(gpu)
            stp = replace(base, **{k: getattr(base, k) * f for k, f in self.perturb})
        return EngineConfig.resolve(
            resolve_model(self.model), gpu,
            max_num_batched_tokens=params.max_num_batched_tokens,
            max_num_seqs=params.max_num_seqs,
            gpu_memory_utilization=params.gpu_memory_utilization,
            max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
            step_time_params=stp,
        )

    def vllm_defaults(self) -> EngineParams:
        from kvpilot.twin.hardware import resolve_gpu, serve_defaults

        return EngineParams.vllm_defaults(serve_defaults(resolve_gpu(self.gpu)))

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


class TwinEvaluator:
    """Capacity of configs on one target and workload.  Results are cached by (config, rate)."""

    def __init__(self, target: TwinTarget, workload: Workload, slo: SLO, seed: int = 0) -> None:
        self.target, self.workload, self.slo, self.seed = target, workload, slo, seed
        self._requests = workload.requests(seed)
        self._runs: dict[tuple[EngineParams, float], RunStats] = {}
        self._caps: dict[EngineParams, CapacityResult | str] = {}
        self.simulations = 0
        self.hint = 1.0

    # -- one virtual-time run -------------------------------------------------------------
    def run(self, params: EngineParams, rate: float) -> RunStats:
        """Serve the request sequence at `rate` req/s.  Raises EngineStartupError."""
        key = (params, round(rate, 6))
        if key in self._runs:
            return self._runs[key]
        from kvpilot.twin.engine import Engine

        engine = Engine(self.target.engine_config(params))
        self.simulations += 1
        stats = _serve(engine, self._requests, rate, self.slo)
        self._runs[key] = stats
        return stats

    # -- capacity -------------------------------------------------------------------------
    def capacity(self, params: EngineParams) -> CapacityResult | str:
        """The capacity search for `params`, or the start-up error text."""
        if params in self._caps:
            return self._caps[params]
        from kvpilot.twin.memory import EngineStartupError

        def probe(rate: float) -> tuple[float, float]:
            s = self.run(params, rate)
            return s.ttft_p99, s.itl_p99

        try:
            res: CapacityResult | str = find_capacity(
                probe, self.slo.ttft_seconds, self.slo.itl_seconds, hint=self.hint, rel_tol=0.02
            )
        except EngineStartupError as exc:
            res = str(exc)
        except ValueError as exc:  # a request the config cannot serve (longer than max_model_len)
            res = str(exc)
        if isinstance(res, CapacityResult) and res.capacity > 0:
            self.hint = res.capacity  # the next search starts near the last answer
        self._caps[params] = res
        return res

    def evaluate(self, params: EngineParams) -> Outcome:
        """The capacity goal's outcome for one config."""
        res = self.capacity(params)
        if isinstance(res, str):
            return infeasible(Goal.CAPACITY, "StartupFailed", res.splitlines()[0][:300])
        if res.at_capacity is not None:
            ttft, itl = res.at_capacity
        else:
            _, ttft, itl, _ = min(res.probes, key=lambda p: p[0])
        m = Measurement(ttft_p99=ttft, itl_p99=itl, request_rate=res.capacity, capacity=res.capacity,
                        extra={"simulations": float(res.simulations)})
        return score(Goal.CAPACITY, m, self.slo)


def _serve(engine: Any, requests: list[tuple[float, int, int]], rate: float, slo: SLO) -> RunStats:
    """Virtual-time serving loop with an early stop once the SLO is certainly missed."""
    n = len(requests)
    skip = n // 10  # the first tenth warms the engine up from empty: not counted
    counted = n - skip
    expected_gaps = sum(max(o - 1, 0) for _, _, o in requests[skip:])
    ttft_budget = int(0.01 * counted)  # more misses than this and the p99 is over the SLO
    itl_budget = int(0.01 * expected_gaps)
    arrivals = [(a / rate, p, o) for a, p, o in requests]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    arrival_of: dict[str, float] = {}
    ttfts: list[float] = []
    gaps: list[float] = []
    ttft_miss = itl_miss = 0
    pending: dict[str, float] = {}  # arrived (and counted), no first token yet
    preemptions = 0
    kv_peak = 0.0
    t = 0.0
    i = 0
    done = 0
    steps = 0
    stopped = False
    slo_ttft, slo_itl = slo.ttft_seconds, slo.itl_seconds
    while done < n:
        while i < n and arrivals[i][0] <= t:
            a, p, o = arrivals[i]
            rid = str(i)
            engine.add_request(rid, p, o, a)
            arrival_of[rid] = a
            if i >= skip:
                pending[rid] = a
            i += 1
        if not engine.has_unfinished_requests():
            t = arrivals[i][0]
            continue
        out = engine.step()
        t += out.duration_s
        preemptions += out.num_preemptions
        if out.kv_cache_usage > kv_peak:
            kv_peak = out.kv_cache_usage
        for o in out.outputs:
            if not o.new_token_count:
                continue
            rid = o.request_id
            measured = int(rid) >= skip
            if rid not in first:
                first[rid] = t
                pending.pop(rid, None)
                ttft = t - arrival_of[rid]
                if measured:
                    ttfts.append(ttft)
                    if ttft > slo_ttft:
                        ttft_miss += 1
            else:
                gap = t - last[rid]
                if measured:
                    gaps.append(gap)
                    if gap > slo_itl:
                        itl_miss += 1
            last[rid] = t
            if o.finished:
                done += 1
        steps += 1
        if not steps % 32:
            # Requests still waiting for their first token longer than the SLO are misses already.
            late = sum(1 for a in pending.values() if t - a > slo_ttft)
            if ttft_miss + late > ttft_budget:
                ttft_miss += late
        if ttft_miss > ttft_budget or itl_miss > itl_budget:
            stopped = True
            break
    if stopped:
        inf = float("inf")
        return RunStats(
            inf if ttft_miss > ttft_budget else _p99(ttfts), inf if itl_miss > itl_budget else _p99(gaps),
            done, True, preemptions, kv_peak,
        )
    return RunStats(_p99(ttfts), _p99(gaps), done, False, preemptions, kv_peak)


def _p99(xs: list[float]) -> float:
    if not xs:
        return 0.0
    return float(np.percentile(np.asarray(xs), 99))


def workload_from_estimate(est: Any, num_requests: int = 160) -> Workload:
    """A twin workload shaped like a live one (a `core.warmstart.WorkloadEstimate`)."""
    return Workload(
        prompt=Lengths("lognormal", est.prompt_median, est.prompt_sigma, 1, 32768),
        output=Lengths("lognormal", est.output_median, est.output_sigma, 1, 8192),
        num_requests=num_requests, name="live",
    )
