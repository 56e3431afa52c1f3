"""The engine codec: spec.engine <-> `vllm serve` arguments, and the values vLLM resolves itself.

Everything that starts or describes an engine goes through here: the operator renders a pod's
command line with `render_flags`, the tuner's appliers render a trial's flags and read a local
engine command back with `parse_engine_args`, the twin fills what a command leaves out with
`serve_defaults`.  One table, one number format, one set of defaults per GPU class.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from kvpilot.api import serve_args, tracing, tuned, vllm

GiB = 1 << 30

# Bounds vLLM itself accepts (or that no real deployment goes past); the tuned fields' are declared
# with them in kvpilot.api.tuned.
MAX_BATCHED_TOKENS_LIMIT = tuned.MAX_BATCHED_TOKENS_LIMIT
MAX_NUM_SEQS_LIMIT = tuned.MAX_NUM_SEQS_LIMIT
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
    # Where the field lives in spec (for messages); engine.<field> unless said otherwise.
    path: str = ""
    # A list field renders as one flag followed by its values (vLLM's nargs="+").
    many: bool = False

    @property
    def spec_path(self) -> str:
        return self.path or f"engine.{self.field}"

    @classmethod
    def of_tuned(cls, declared: tuned.TunedField) -> EngineFlag:
        return cls(declared.name, declared.flag, declared.type)


# The typed fields, in the order they are rendered.  shutdownTimeoutSeconds lives in spec.rollout and
# the tracing fields in spec.observability.tracing, but they render as engine flags like the others.
ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag.of_tuned(tuned.MAX_NUM_BATCHED_TOKENS),
    EngineFlag.of_tuned(tuned.GPU_MEMORY_UTILIZATION),
    EngineFlag("kvCacheMemoryBytes", "--kv-cache-memory-bytes", int),
    EngineFlag.of_tuned(tuned.MAX_NUM_SEQS),
    EngineFlag("maxModelLen", "--max-model-len", int),
    EngineFlag("tensorParallelSize", "--tensor-parallel-size", int, ("-tp",)),
    EngineFlag("blockSize", "--block-size", int),
    EngineFlag("kvCacheDtype", "--kv-cache-dtype", str),
    EngineFlag("longPrefillTokenThreshold", "--long-prefill-token-threshold", int),
    EngineFlag("shutdownTimeoutSeconds", "--shutdown-timeout", int, path="rollout.shutdownTimeoutSeconds"),
    EngineFlag("otlpTracesEndpoint", "--otlp-traces-endpoint", str,
               path="observability.tracing.otlpTracesEndpoint"),
    EngineFlag("collectDetailedTraces", "--collect-detailed-traces", str,
               path="observability.tracing.collectDetailedTraces", many=True),
)
FLAG_OF: dict[str, str] = {f.field: f.flag for f in ENGINE_FLAGS}
_BY_FLAG: dict[str, EngineFlag] = {name: f for f in ENGINE_FLAGS for name in (f.flag, *f.aliases)}
# Flags the operator always owns, besides the typed ones.
OWNED_FLAGS: tuple[str, ...] = ("--port", "--host", "--served-model-name", "--model")
# Flags extraArgs may not reach either, and why.
REFUSED_EXTRA_FLAGS: dict[str, str] = {
    "--config": "reads flags from a YAML file kvpilot cannot see, so it could set any typed or owned flag; "
    "write the flags themselves in extraArgs",
    "--help": "makes vLLM print its help and exit instead of serving",
    "--uds": "makes vLLM listen on a Unix socket instead of the port the probes and the Service use",
    "--headless": "runs vLLM without its API server: nothing would answer the probes or clients",
    # vLLM V1 builds no stat loggers then, so /metrics carries no vllm: series.
    "--disable-log-stats": "turns off vLLM's metrics, which the SLO alerts and the tuner read",
}
# The model and the served name are arguments of their own; one starting with `-` would be read as a flag.
NOT_A_FLAG_PATTERN = r"^[^-]"
PATTERN_MESSAGES: dict[str, str] = {
    NOT_A_FLAG_PATTERN: "must not start with '-' (vLLM would read it as a flag)",
    tracing.OTLP_ENDPOINT_PATTERN: tracing.OTLP_ENDPOINT_MESSAGE,
}


_TYPED_FIELD_OF: dict[str, str] = {f.flag: f.spec_path for f in ENGINE_FLAGS}
# kvpilot renders these, so the vLLM it runs has them even where the committed option list is older.
_RENDERED: tuple[str, ...] = (*_BY_FLAG, *OWNED_FLAGS, *REFUSED_EXTRA_FLAGS)


_MAX_SHOWN = 12


@lru_cache(maxsize=1024)
def extra_args_problems(args: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    """(index, why) for each of `args` (engine.extraArgs) that vLLM would read as a typed, owned,
    removed or refused flag, or as an ambiguous prefix; read as vLLM reads them (`serve_args`), so
    `--max-num-s=512` and `--gpu_mem 0.5` count as the flags they resolve to."""
    problems: list[tuple[int, str]] = []
    for use in serve_args.vllm_resolver(_RENDERED).resolve(args):
        if use.ambiguous:
            # vLLM's own words; a very short prefix (`--=x` matches every flag) gets the first few only.
            shown = use.ambiguity if len(use.matches) <= _MAX_SHOWN else (
                f"ambiguous option: {use.seen} could match {', '.join(use.matches[:_MAX_SHOWN])}, ... "
                f"({len(use.matches)} flags)")
            problems.append((use.index, f"{shown}: vLLM refuses to start; write the flag in full"))
            continue
        name, seen = use.arg.partition("=")[0], use.seen.partition("=")[0]
        if seen in vllm.REMOVED_FLAGS:  # vLLM no longer has it, so it matches nothing: say why
            problems.append((use.index, f"{name} was {vllm.REMOVED_FLAGS[seen]}"))
            continue
        flag = use.flag
        if flag is None:
            continue  # not a flag this vLLM has: a newer image's, or vLLM says so at start-up
        reading = flag if name == flag else f"{name} (vLLM reads it as {flag})"
        if flag in _TYPED_FIELD_OF:
            problems.append((use.index, f"{reading} is set by the typed field {_TYPED_FIELD_OF[flag]}; "
                                        "set it there instead"))
        elif flag in OWNED_FLAGS:
            problems.append((use.index, f"{reading} is set by kvpilot (the model, port and served name come "
                                        "from spec.model, spec.servedModelName and the Service)"))
        elif flag in REFUSED_EXTRA_FLAGS:
            problems.append((use.index, f"{reading} {REFUSED_EXTRA_FLAGS[flag]}"))
    return tuple(problems)


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
    a field that is absent or None (or an empty list) is left out, so vLLM resolves it.  A list
    field renders as its flag followed by each value (`--collect-detailed-traces model worker`)."""
    unknown = set(values) - set(FLAG_OF)
    if unknown:
        raise KeyError(f"not typed engine fields: {sorted(unknown)}")
    args: list[str] = []
    for f in ENGINE_FLAGS:
        value = values.get(f.field)
        if value is None:
            continue
        if f.many:
            if value:
                args += [f.flag, *(format_value(v) for v in value)]
        else:
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
        if f is not None and f.many:
            items = [text] if eq else []
            while not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                items.append(args[i + 1])
                i += 1
            if not items:
                raise EngineArgsError(f"{name}: needs at least one value")
            values[f.field] = [_typed(f, t) for t in items]
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
