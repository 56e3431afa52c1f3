"""The engine codec: spec.engine <-> `vllm serve` arguments, and the values vLLM resolves itself.

Everything that starts or describes an engine goes through here: the operator renders a pod's
command line with `render_flags`, the tuner's appliers render a trial's flags and read a local
engine command back with `parse_engine_args`, the twin fills what a command leaves out with
`serve_defaults`.  One table, one number format, one set of defaults per GPU class.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvpilot.api import vllm

GiB = 1 << 30

# Bounds vLLM itself accepts (or that no real deployment goes past); the tuning space stays inside.
MAX_BATCHED_TOKENS_LIMIT = 1 << 20
MAX_NUM_SEQS_LIMIT = 1 << 16
MAX_MODEL_LEN_LIMIT = 1 << 24
# --kv-cache-memory-bytes is per GPU; the largest GPUs hold a few hundred GiB.
MAX_KV_CACHE_MEMORY_BYTES = 1 << 40


@dataclass(frozen=True, slots=True)
class EngineFlag:
    """A spec field (camelCase) and the `vllm serve` flag it renders to."""

    field: str
    flag: str
    type: type
    aliases: tuple[str, ...] = ()


# The typed fields, in the order they are rendered.  shutdownTimeoutSeconds lives in spec.rollout
# but renders as an engine flag like the others.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("maxNumBatchedTokens", "--max-num-batched-tokens", int),
    EngineFlag("gpuMemoryUtilization", "--gpu-memory-utilization", float),
    EngineFlag("kvCacheMemoryBytes", "--kv-cache-memory-bytes", int),
    EngineFlag("maxNumSeqs", "--max-num-seqs", int),
    EngineFlag("maxModelLen", "--max-model-len", int),
    EngineFlag("tensorParallelSize", "--tensor-parallel-size", int, ("-tp",)),
    EngineFlag("blockSize", "--block-size", int),
    EngineFlag("kvCacheDtype", "--kv-cache-dtype", str),
    EngineFlag("longPrefillTokenThreshold", "--long-prefill-token-threshold", int),
    EngineFlag("shutdownTimeoutSeconds", "--shutdown-timeout", int),
)
FLAG_OF: dict[str, str] = {f.field: f.flag for f in ENGINE_FLAGS}
_BY_FLAG: dict[str, EngineFlag] = {name: f for f in ENGINE_FLAGS for name in (f.flag, *f.aliases)}
# Flags the operator always owns, besides the typed ones.
OWNED_FLAGS: tuple[str, ...] = ("--port", "--host", "--served-model-name", "--model")


class EngineArgsError(ValueError):
    """An engine command line that cannot be read: names the flag and what it needs."""


def format_value(value: float | int | str) -> str:
    """The one text form of a flag value: ints as ints, floats as the shortest text that reads back
    as the same float (0.9, never 0.9000000000000000222), strings as they are."""
    if isinstance(value, bool):
        raise TypeError("engine flags take numbers or words, not booleans")
    if isinstance(value, int | str):
        return str(value)
    return repr(float(value))


def render_flags(values: Mapping[str, Any]) -> list[str]:
    """`[flag, value, ...]` for the typed fields in `values` (camelCase keys), in table order;
    a field that is absent or None is left out, so vLLM resolves it."""
    unknown = set(values) - set(FLAG_OF)
    if unknown:
        raise KeyError(f"not typed engine fields: {sorted(unknown)}")
    args: list[str] = []
    for f in ENGINE_FLAGS:
        value = values.get(f.field)
        if value is not None:
            args += [f.flag, format_value(value)]
    return args


@dataclass(frozen=True)
class EngineArgs:
    """A `vllm serve` command line read back: the typed values it sets, its port, and the rest."""

    values: dict[str, Any] = field(default_factory=dict)
    port: int | None = None
    rest: list[str] = field(default_factory=list)


def _typed(f: EngineFlag, text: str) -> Any:
    try:
        return f.type(text)
    except ValueError:
        kind = {int: "a whole number", float: "a number", str: "a word"}[f.type]
        raise EngineArgsError(f"{f.flag}: expected {kind}, got {text!r}") from None


def parse_engine_args(argv: Sequence[str], only: Collection[str] | None = None) -> EngineArgs:
    """Read the typed flags (or `only` those fields) and `--port` out of an engine command line
    (`--flag V` and `--flag=V` forms, and the short aliases); everything else stays in `rest`, in order."""
    values: dict[str, Any] = {}
    port: int | None = None
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        name, eq, text = args[i].partition("=")
        f = _BY_FLAG.get(name)
        if f is not None and only is not None and f.field not in only:
            f = None
        if f is None and name != "--port":
            rest.append(args[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args):
                raise EngineArgsError(f"{name}: needs a value")
            text = args[i + 1]
            i += 1
        if f is None:
            try:
                port = int(text)
            except ValueError:
                raise EngineArgsError(f"--port: expected a whole number, got {text!r}") from None
        else:
            values[f.field] = _typed(f, text)
        i += 1
    return EngineArgs(values, port, rest)


# ---- what vLLM resolves when a flag is absent -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServeDefaults:
    """The values `vllm serve` (vLLM 0.33, the OpenAI server) resolves when the flags are absent."""

    maxNumBatchedTokens: int  # camelCase: the keys read like spec.engine
    maxNumSeqs: int
    gpuMemoryUtilization: float = vllm.DEFAULT_GPU_MEMORY_UTILIZATION
    blockSize: int = vllm.DEFAULT_BLOCK_SIZE
    longPrefillTokenThreshold: int = vllm.DEFAULT_LONG_PREFILL_TOKEN_THRESHOLD

    def as_spec(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def is_large_gpu(gpu_name: str, gpu_memory_bytes: int) -> bool:
    """vLLM's GPU class for its serve defaults: 70 GiB or more and not an A100 (H100, H200, B200, ...)."""
    return gpu_memory_bytes >= 70 * GiB and "a100" not in gpu_name.lower()


def serve_defaults(gpu_name: str, gpu_memory_bytes: int) -> ServeDefaults:
    """vLLM's defaults on one GPU of this name and memory size."""
    if is_large_gpu(gpu_name, gpu_memory_bytes):
        return ServeDefaults(vllm.DEFAULT_BATCHED_TOKENS_LARGE_GPU, vllm.DEFAULT_MAX_NUM_SEQS_LARGE_GPU)
    return ServeDefaults(vllm.DEFAULT_BATCHED_TOKENS_SMALL_GPU, vllm.DEFAULT_MAX_NUM_SEQS_SMALL_GPU)


def resolve(values: Mapping[str, Any], defaults: ServeDefaults) -> dict[str, Any]:
    """The effective engine: `values` (camelCase; None = unset) with every unset default filled in.
    A fixed KV-cache size (kvCacheMemoryBytes) replaces the memory fraction, as in vLLM."""
    out = {k: v for k, v in values.items() if v is not None}
    for key, value in defaults.as_spec().items():
        out.setdefault(key, value)
    if out.get("kvCacheMemoryBytes") is not None:
        out.pop("gpuMemoryUtilization", None)
    return out
