"""The engine fields the tuner owns, declared once.

`TUNED` holds each field's names (camelCase in spec.engine and spec.tuning.space, snake_case in
Python), its `vllm serve` flag, type, legal limits and default search range.  The models, the CRD's
rules, the spec rules, the canary annotation's parser, the engine codec and the tuner's
`EngineParams` and `SearchSpace` all read it; `tests/unit/api/test_tuned.py` checks that each does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.api import vllm

# Bounds vLLM itself accepts (or that no real deployment goes past); the tuning space stays inside.
MAX_BATCHED_TOKENS_LIMIT = 1 << 20
MAX_NUM_SEQS_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class TunedField:
    """One tuned engine field."""

    name: str  # camelCase, as in spec.engine, spec.tuning.space and a trial's params
    attr: str  # snake_case, as on EngineSpec, TuningSpace and EngineParams
    flag: str  # the `vllm serve` flag it renders to
    short: str  # in a trial's label (tokens=2048) and `kvpilot tune`'s range flag (--tokens MIN:MAX)
    type: type[int] | type[float]
    low: float  # legal limits of the field, and so of its search range (0 and 1, not 0.0 and 1.0, for a
    high: float  # fraction: the CRD prints the number as written)
    exclusive: bool  # the limits themselves are not legal (a fraction in (0, 1))
    space: tuple[float, float]  # the default search range, spec.tuning.space's default
    # spec.engine's default; None leaves the field unset, and vLLM then uses `unset_means`.
    default: int | float | None
    unset_means: float | None = None
    # The spec.engine field that, when set, overrides this one (vLLM then ignores it).
    overridden_by: str | None = None

    def legal(self, value: float) -> bool:
        if self.exclusive:
            return self.low < value < self.high
        return self.low <= value <= self.high

    @property
    def limits_text(self) -> str:
        """The legal range as a message says it: [1, 1048576], (0, 1)."""
        left, right = "()" if self.exclusive else "[]"
        return f"{left}{self.text(self.low)}, {self.text(self.high)}{right}"

    def text(self, value: float) -> str:
        return f"{value:g}" if self.type is float else str(int(value))

    def shown(self, value: float) -> str:
        """A value in a trial's label: a fraction to its 0.01 grid."""
        return f"{value:.2f}" if self.type is float else str(value)


MAX_NUM_BATCHED_TOKENS = TunedField(
    name="maxNumBatchedTokens", attr="max_num_batched_tokens", flag="--max-num-batched-tokens", short="tokens",
    type=int,
    low=1, high=MAX_BATCHED_TOKENS_LIMIT, exclusive=False, space=(256, 16384), default=2048,
)
GPU_MEMORY_UTILIZATION = TunedField(
    name="gpuMemoryUtilization", attr="gpu_memory_utilization", flag="--gpu-memory-utilization", short="util",
    type=float,
    low=0, high=1, exclusive=True, space=(0.70, 0.95), default=None,
    unset_means=vllm.DEFAULT_GPU_MEMORY_UTILIZATION, overridden_by="kvCacheMemoryBytes",
)
MAX_NUM_SEQS = TunedField(
    name="maxNumSeqs", attr="max_num_seqs", flag="--max-num-seqs", short="seqs", type=int,
    low=1, high=MAX_NUM_SEQS_LIMIT, exclusive=False, space=(64, 1024), default=256,
)

# In this order everywhere: a trial's params, the canary annotation, EngineParams.
TUNED: tuple[TunedField, ...] = (MAX_NUM_BATCHED_TOKENS, GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS)
TUNED_ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in TUNED)
# The fields spec.engine always sets, then those it may leave to vLLM (whose checks say more).
ALWAYS_SET: tuple[TunedField, ...] = tuple(f for f in TUNED if f.unset_means is None)
MAY_BE_UNSET: tuple[TunedField, ...] = tuple(f for f in TUNED if f.unset_means is not None)
