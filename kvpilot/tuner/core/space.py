"""The search space: vLLM's token budget, KV-cache memory fraction and sequence cap.

Names follow the InferenceService's `spec.engine` fields (camelCase), so a trial's params read
exactly like the engine block they become.

`maxNumBatchedTokens >= maxNumSeqs` must hold (vLLM refuses to start otherwise).  The space keeps
both ranges fixed and clamps the token budget up to the sequence cap after sampling, rather than
making the token range depend on the sampled sequence cap: a conditional range changes the
distribution from trial to trial, and Optuna's multivariate TPE then falls back to sampling each
parameter on its own, losing exactly the correlation (bigger budget <-> fewer KV blocks) it
should learn.  Rejecting would waste trials.  Clamping maps a bad corner onto its nearest valid
config; the raw draw stays in the trial's params and the applied engine in its user attrs.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from optuna.distributions import BaseDistribution, FloatDistribution, IntDistribution

from kvpilot.api.engine import ServeDefaults, render_flags
from kvpilot.api.tuned import (
    GPU_MEMORY_UTILIZATION,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    TUNED,
    TUNED_ENGINE_FIELDS,
)

TUNED_FIELDS: tuple[str, ...] = TUNED_ENGINE_FIELDS
PARAM_TOKENS, PARAM_GPU_UTIL, PARAM_SEQS = MAX_NUM_BATCHED_TOKENS.name, GPU_MEMORY_UTILIZATION.name, MAX_NUM_SEQS.name

GPU_UTIL_STEP = 0.01
# The integer knobs: drawn on a log scale, or as powers of two (pow2 resolution).  The fraction is drawn
# on a grid of util_step.
_INTEGER = tuple(f for f in TUNED if f.type is int)
LOG2_PREFIX = "log2"  # pow2 resolution: the trial param is the exponent, e.g. log2maxNumSeqs


def _pow2_exponents(lo: int, hi: int) -> tuple[int, int]:
    """Exponents of the powers of two inside [lo, hi]; (0, -1) when there are none."""
    if lo < 1 or hi < lo:
        return (0, -1)
    a, b = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    return (a, b) if a <= b else (0, -1)


class SpaceError(ValueError):
    """A search space or engine setting that cannot be used; `path` names the field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True, order=True)
class EngineParams:
    """The three tuned engine settings, as vLLM takes them."""

    max_num_batched_tokens: int
    gpu_memory_utilization: float
    max_num_seqs: int

    def __post_init__(self) -> None:
        # Each field as its declared type; a fraction rounded so equal configs compare (and hash) equal.
        for f in TUNED:
            value = f.type(getattr(self, f.attr))
            object.__setattr__(self, f.attr, round(value, 4) if f.type is float else value)

    def as_spec(self) -> dict[str, Any]:
        """The `spec.engine` fields (camelCase, as on the wire)."""
        return {f.name: getattr(self, f.attr) for f in TUNED}

    def as_flags(self) -> list[str]:
        """The `vllm serve` / `kvpilot twin serve` flags, rendered by the API's engine codec."""
        return render_flags(self.as_spec())

    def label(self) -> str:
        """`tokens=2048 util=0.90 seqs=256`: logs, and the keys of benchmark results."""
        return " ".join(f"{f.short}={f.shown(getattr(self, f.attr))}" for f in TUNED)

    @classmethod
    def from_spec(cls, engine: Mapping[str, Any]) -> EngineParams:
        """From a camelCase engine mapping (a trial's params, a spec.engine dict, user attrs)."""
        try:
            values: dict[str, Any] = {f.attr: f.type(engine[f.name]) for f in TUNED}
            return cls(**values)
        except KeyError as exc:
            raise SpaceError(f"spec.engine.{exc.args[0]}", "is required for tuning") from None
        except (TypeError, ValueError) as exc:
            raise SpaceError("spec.engine", f"tuned fields must be numbers: {exc}") from None

    @classmethod
    def vllm_defaults(cls, defaults: ServeDefaults) -> EngineParams:
        """What `vllm serve` resolves on a GPU (`kvpilot.api.engine.serve_defaults`) when none of
        the three flags is given."""
        return cls.from_spec(defaults.as_spec())


@dataclass(frozen=True)
class SearchSpace:
    """Ranges for the three tuned fields, as in `spec.tuning.space` ([min, max] each)."""

    max_num_batched_tokens: tuple[int, int] = cast(tuple[int, int], MAX_NUM_BATCHED_TOKENS.space)
    gpu_memory_utilization: tuple[float, float] = GPU_MEMORY_UTILIZATION.space
    max_num_seqs: tuple[int, int] = cast(tuple[int, int], MAX_NUM_SEQS.space)
    # Resolution: "log" draws any integer on a log scale; "pow2" draws powers of two only (the
    # benchmark grid's resolution, where every draw is a grid point and evaluations can be cached).
    scale: str = "log"
    util_step: float = GPU_UTIL_STEP

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            path, message = problems[0]
            raise SpaceError(path, message)
        lo, hi = self.gpu_memory_utilization
        object.__setattr__(self, "gpu_memory_utilization", (round(lo, 2), round(hi, 2)))

    def problems(self) -> list[tuple[str, str]]:
        """Every reason this space cannot be searched, as (field path, message)."""
        out: list[tuple[str, str]] = []
        base = "spec.tuning.space"
        for f in TUNED:
            lo, hi = getattr(self, f.attr)
            # An integer knob from its legal minimum up; the fraction from one step up to 1.
            floor, ceil = (GPU_UTIL_STEP, 1.0) if f.type is float else (f.low, None)
            path = f"{base}.{f.name}"
            if not lo < hi:
                out.append((path, f"needs [min, max] with min < max, got [{lo}, {hi}]"))
            if lo < floor:
                out.append((path, f"min must be >= {floor}, got {lo}"))
            if ceil is not None and hi > ceil:
                out.append((path, f"max must be <= {ceil}, got {hi}"))
        if self.scale not in ("log", "pow2"):
            out.append((f"{base}.scale", f"must be 'log' or 'pow2', got {self.scale!r}"))
        if self.scale == "pow2":
            for f in _INTEGER:
                lo, hi = getattr(self, f.attr)
                if _pow2_exponents(lo, hi) == (0, -1):
                    out.append((f"{base}.{f.name}", f"[{lo}, {hi}] holds no power of two"))
        if self.max_num_batched_tokens[1] < self.max_num_seqs[0]:
            out.append((
                f"{base}.{PARAM_TOKENS}",
                f"max {self.max_num_batched_tokens[1]} is below maxNumSeqs min {self.max_num_seqs[0]}: "
                "vLLM needs maxNumBatchedTokens >= maxNumSeqs, so no config in this space can start",
            ))
        return out

    @classmethod
    def from_spec(cls, space: Any) -> SearchSpace:
        """From `spec.tuning.space`: a pydantic model (snake_case attrs) or a camelCase dict.

        A missing range keeps its default.  Raises SpaceError naming the field.
        """
        def pick(snake: str, camel: str) -> Any:
            if space is None:
                return None
            if isinstance(space, Mapping):
                return space.get(camel, space.get(snake))
            return getattr(space, snake, None)

        kwargs: dict[str, Any] = {}
        for f in TUNED:
            snake, camel, kind = f.attr, f.name, f.type
            value = pick(snake, camel)
            if value is None:
                continue
            try:
                lo, hi = value
                kwargs[snake] = (kind(lo), kind(hi))
            except (TypeError, ValueError):
                raise SpaceError(
                    f"spec.tuning.space.{camel}", f"must be a [min, max] pair of numbers, got {value!r}"
                ) from None
        return cls(**kwargs)

    def as_spec(self) -> dict[str, list[float]]:
        return {f.name: list(getattr(self, f.attr)) for f in TUNED}

    def digest(self) -> str:
        """A short stable hash: a changed space is a new study, never a mix of two."""
        spec: dict[str, Any] = dict(self.as_spec())
        if self.scale != "log" or self.util_step != GPU_UTIL_STEP:
            spec["resolution"] = [self.scale, self.util_step]
        blob = json.dumps(spec, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:10]

    # -- sampling -------------------------------------------------------------------------
    def distributions(self) -> dict[str, BaseDistribution]:
        """The Optuna distributions of a draw, built once and passed to `Study.ask` (as Katib does).
        Token budget first, then the fraction, then the sequence cap: a knob drawn on its own (the
        start-up) is drawn in this order, so the start-up can keep the cap within the budget
        already drawn (`bounds`).  The token budget is still clamped up to the cap (`resolve`)."""
        out: dict[str, BaseDistribution] = {}
        for f in TUNED:
            lo, hi = getattr(self, f.attr)
            if f.type is float:
                out[f.name] = FloatDistribution(*self._util_bounds(), step=self.util_step)
            elif self.scale == "pow2":
                out[LOG2_PREFIX + f.name] = IntDistribution(*_pow2_exponents(lo, hi))
            else:
                out[f.name] = IntDistribution(lo, hi, log=True)
        return out

    def bounds(self) -> dict[str, str]:
        """Trial params that vLLM needs at most another: the sequence cap within the token budget
        (both raw params on the same scale, values or exponents)."""
        prefix = LOG2_PREFIX if self.scale == "pow2" else ""
        return {prefix + PARAM_SEQS: prefix + PARAM_TOKENS}

    def _util_bounds(self) -> tuple[float, float]:
        lo, hi = self.gpu_memory_utilization
        n = int(round((hi - lo) / self.util_step + 1e-9))
        return lo, round(lo + n * self.util_step, 4)

    def resolve(self, raw: Mapping[str, Any]) -> EngineParams:
        """The engine a raw draw becomes: token budget clamped up to the sequence cap."""
        values = dict(raw)
        for f in _INTEGER:
            if LOG2_PREFIX + f.name in values:
                values[f.name] = 2 ** int(values.pop(LOG2_PREFIX + f.name))
        p = EngineParams.from_spec(values)
        return EngineParams(max(p.max_num_batched_tokens, p.max_num_seqs), p.gpu_memory_utilization, p.max_num_seqs)

    def raw_params(self, params: EngineParams) -> dict[str, Any]:
        """The trial params that draw `params` (for enqueuing a known config).  Clips first."""
        p = self.clip(params)
        if self.scale == "log":
            return p.as_spec()
        return {
            LOG2_PREFIX + PARAM_SEQS: int(round(math.log2(p.max_num_seqs))),
            PARAM_GPU_UTIL: p.gpu_memory_utilization,
            LOG2_PREFIX + PARAM_TOKENS: int(round(math.log2(p.max_num_batched_tokens))),
        }

    def clip(self, params: EngineParams) -> EngineParams:
        """The nearest config inside the space (for enqueuing an engine that lies outside it)."""
        def c(v: float, bounds: tuple[float, float]) -> float:
            return min(max(v, bounds[0]), bounds[1])

        seqs = int(c(params.max_num_seqs, self.max_num_seqs))
        tokens = int(c(params.max_num_batched_tokens, self.max_num_batched_tokens))
        if self.scale == "pow2":
            seqs = 2 ** min(max(round(math.log2(seqs)), _pow2_exponents(*self.max_num_seqs)[0]),
                            _pow2_exponents(*self.max_num_seqs)[1])
            tokens = 2 ** min(max(round(math.log2(tokens)), _pow2_exponents(*self.max_num_batched_tokens)[0]),
                              _pow2_exponents(*self.max_num_batched_tokens)[1])
        lo, hi = self._util_bounds()
        util = lo + round((c(params.gpu_memory_utilization, (lo, hi)) - lo) / self.util_step) * self.util_step
        return EngineParams(max(tokens, seqs), min(util, hi), seqs)

    def above_floor(self, params: EngineParams, util_floor: float) -> EngineParams:
        """`params` with its fraction mapped from [min, max] onto [util_floor, max], rounded up to a step.

        Every draw moves, not only those below the floor: clamping would pile every ruled-out
        draw onto the floor itself, the feasible config with the smallest KV cache and usually
        the worst, while the mapping keeps the sampler's spread over what is still possible.
        """
        lo, hi = self._util_bounds()
        if util_floor <= lo + 1e-9:
            return params
        floor = min(util_floor, hi)
        u = floor + (params.gpu_memory_utilization - lo) * (hi - floor) / (hi - lo)
        steps = math.ceil((u - lo) / self.util_step - 1e-6)
        util = min(round(lo + steps * self.util_step, 4), hi)
        return EngineParams(params.max_num_batched_tokens, util, params.max_num_seqs)

    def contains(self, params: EngineParams) -> bool:
        t, u, s = params.max_num_batched_tokens, params.gpu_memory_utilization, params.max_num_seqs
        return (
            self.max_num_batched_tokens[0] <= t <= self.max_num_batched_tokens[1]
            and self.gpu_memory_utilization[0] - 1e-9 <= u <= self.gpu_memory_utilization[1] + 1e-9
            and self.max_num_seqs[0] <= s <= self.max_num_seqs[1]
            and t >= s
        )

    def grid(self, util_step: float = 0.05) -> Iterator[EngineParams]:
        """Powers of two for both integer knobs x the fraction by `util_step`; skips tokens < seqs.

        The grid the quality benchmark searches exhaustively for its optimum.
        """
        def pow2(lo: int, hi: int) -> list[int]:
            a, b = _pow2_exponents(lo, hi)
            return [2**k for k in range(a, b + 1)]

        lo, hi = self.gpu_memory_utilization
        n = int(round((hi - lo) / util_step))
        utils = [round(lo + i * util_step, 2) for i in range(n + 1)]
        for tokens in pow2(*self.max_num_batched_tokens):
            for util in utils:
                for seqs in pow2(*self.max_num_seqs):
                    if tokens >= seqs:
                        yield EngineParams(tokens, util, seqs)
