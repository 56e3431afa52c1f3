"""Workloads for the engine twin: when requests arrive and how long they are.

`Workload.parse(spec)` reads the one workload language every command uses (`SPEC_HELP`, printed by
`kvpilot twin run --help`) and `Workload.generate(...)` draws the requests: everything random from one
numpy Generator seeded by the caller, so the same spec and seed give the same requests, and arrivals
scale exactly with 1/rate (a capacity search compares rates on the same requests).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

# The workload language, as `kvpilot twin run --help` prints it.  Examples: `poisson:rate=10`,
# `chat:rate=12`, `gamma:rate=5,cv=3,prompt=lognormal/1000/0.6,output=200`, `rag`,
# `poisson:rate=2,prompt=4096,output=64..512`, `traces/prod.jsonl`.
SPEC_HELP = """One language for every command that takes a workload (`kvpilot twin run`, `kvpilot tune`, the
benchmarks), written as one string a person can type:

    [BASE][:key=value,key=value,...]      or      PATH.jsonl      (trace replay)

BASE is a preset (`chat`, `rag`, `decode`, `bursty`, `sharegpt`) or an arrival process:
`poisson` (exponential gaps) or `gamma` (bursty: gamma gaps with coefficient of variation `cv`,
default 2; cv=1 is Poisson).  Without a BASE the workload is `sharegpt` traffic; keys override
the base's values:

    rate=R        requests per second (`twin run` needs one; `tune --offline` searches the rate)
    cv=C          burstiness of the arrivals (gamma if C != 1)
    prompt=LEN    prompt tokens
    output=LEN    output tokens
    prefix=N      every prompt starts with the same N-token system prompt (prefix caching)
    prefixes=K    ... one of K different ones, chosen at random (default 1)

LEN is `256` (fixed), `64..2048` (uniform, inclusive), `lognormal/MEDIAN/SIGMA` (rounded; at least
1 and at most 16x the median unless bounds follow: `lognormal/800/0.7/16..6144`), or `sharegpt`
(lognormal fits of ShareGPT conversations as vLLM's benchmark tokenises them: prompts median 150
/ sigma 1.0, outputs median 140 / sigma 0.9).  The colon forms `uniform:LO:HI` and
`lognormal:MEDIAN:SIGMA` of earlier `kvpilot tune` releases are read too.

The presets: chat (medium prompts and answers), rag (long prompts, short answers: prefill-heavy),
decode (short prompts, long answers: decode-heavy), bursty (chat with gamma arrivals, cv 2.5),
sharegpt (vLLM's benchmark lengths).

A trace is JSON lines `{"arrival_s": 0.12, "prompt_tokens": 512, "output_tokens": 128}`
(optional `"prefix": "key"` and `"prefix_tokens": N`), replayed as recorded; `trace:PATH`
works too."""


class WorkloadError(ValueError):
    """A workload spec or trace the twin cannot read; the message says what is allowed."""


_LEN_FORMS = "N (fixed), LOW..HIGH (uniform), lognormal/MEDIAN/SIGMA[/LOW..HIGH] or sharegpt"


@dataclass(frozen=True, slots=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    a: float  # fixed value, uniform low, lognormal median
    b: float = 0.0  # uniform high, lognormal sigma
    lo: int = 1  # lognormal draws are clipped to [lo, hi]; hi 0 means 16x the median
    hi: int = 0

    @classmethod
    def parse(cls, text: str, field: str) -> LengthDist:
        t = text.strip().lower()
        try:
            if t == "sharegpt":
                return SHAREGPT_PROMPT if field == "prompt" else SHAREGPT_OUTPUT
            if t.startswith("uniform:"):  # earlier `kvpilot tune` spelling
                t = "..".join(t.split(":")[1:3])
            if ".." in t and not t.startswith("lognormal"):
                lo, hi = (int(float(x)) for x in t.split("..", 1))
                if not 1 <= lo <= hi:
                    raise WorkloadError(f"{field}={text}: need 1 <= low <= high")
                return cls("uniform", lo, hi)
            if t.startswith(("lognormal/", "lognormal:")):
                parts = t.replace(":", "/").split("/")
                if len(parts) not in (3, 4):
                    raise ValueError
                m, s = float(parts[1]), float(parts[2])
                if not (m >= 1 and s >= 0 and math.isfinite(m) and math.isfinite(s)):
                    raise WorkloadError(f"{field}={text}: need median >= 1 and sigma >= 0")
                lo, hi = 1, 0
                if len(parts) == 4:
                    lo, hi = (int(x) for x in parts[3].split("..", 1))
                    if not 1 <= lo <= hi:
                        raise WorkloadError(f"{field}={text}: need 1 <= low <= high in the bounds")
                return cls("lognormal", m, s, lo, hi)
            v = float(t)
            if v != int(v) or v < 1:
                raise WorkloadError(f"{field}={text}: a length must be a whole number >= 1")
            return cls("fixed", int(v))
        except WorkloadError:
            raise
        except ValueError:
            raise WorkloadError(f"{field}={text!r}: a length is {_LEN_FORMS}") from None

    @property
    def upper(self) -> float:
        return self.hi if self.hi else 16 * self.a

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        x = rng.lognormal(math.log(self.a), self.b, size=n)
        return np.clip(np.rint(x), self.lo, self.upper).astype(np.int64)

    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a * math.exp(self.b**2 / 2)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}..{int(self.b)}"
        bounds = f"/{self.lo}..{self.hi}" if self.hi else ""
        return f"lognormal/{self.a:g}/{self.b:g}{bounds}"


SHAREGPT_PROMPT = LengthDist("lognormal", 150, 1.0)
SHAREGPT_OUTPUT = LengthDist("lognormal", 140, 0.9)


@dataclass(frozen=True, slots=True)
class RequestBatch:
    """Requests in arrival order (numpy arrays of equal length)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    prefix_keys: list[str | None] | None = None
    prefix_tokens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrival_s)

    def then(self, later: RequestBatch) -> RequestBatch:
        """These requests, then `later`'s, its arrival times shifted to start after the last of these."""
        offset = float(self.arrival_s[-1]) if len(self) else 0.0
        keys = None
        if self.prefix_keys is not None or later.prefix_keys is not None:
            keys = [*(self.prefix_keys or [None] * len(self)), *(later.prefix_keys or [None] * len(later))]
        ptoks = None
        if self.prefix_tokens is not None or later.prefix_tokens is not None:
            ptoks = np.concatenate([b.prefix_tokens if b.prefix_tokens is not None else np.zeros(len(b), np.int64)
                                    for b in (self, later)])
        return RequestBatch(np.concatenate([self.arrival_s, later.arrival_s + offset]),
                            np.concatenate([self.prompt_tokens, later.prompt_tokens]),
                            np.concatenate([self.output_tokens, later.output_tokens]), keys, ptoks)

    def at_rate(self, factor: float) -> RequestBatch:
        """The same requests arriving `factor` times as fast (arrival times divided by it)."""
        return replace(self, arrival_s=self.arrival_s / factor)

    def head(self, n: int) -> RequestBatch:
        """The first `n` requests."""
        return RequestBatch(self.arrival_s[:n], self.prompt_tokens[:n], self.output_tokens[:n],
                            self.prefix_keys[:n] if self.prefix_keys is not None else None,
                            self.prefix_tokens[:n] if self.prefix_tokens is not None else None)


_KEYS = ("rate", "cv", "prompt", "output", "prefix", "prefixes")


@dataclass(frozen=True, slots=True)
class Workload:
    arrival: str = "poisson"  # poisson | gamma | trace
    rate: float | None = None  # requests per second; None: the caller chooses (a capacity search)
    cv: float = 1.0
    prompt: LengthDist = SHAREGPT_PROMPT
    output: LengthDist = SHAREGPT_OUTPUT
    prefix_tokens: int = 0
    num_prefixes: int = 1
    trace_path: str | None = None
    name: str = "custom"

    @classmethod
    def parse(cls, spec: str) -> Workload:
        text = spec.strip()
        if text.startswith("trace:"):
            return cls(arrival="trace", trace_path=text[len("trace:"):], name=text)
        if text.endswith((".jsonl", ".json")) or "/" in text.split(":", 1)[0]:
            return cls(arrival="trace", trace_path=text, name=text)
        head, _, rest = text.partition(":")
        base_name = head.strip().lower()
        if "=" in base_name:  # no base: keys only (the earlier `kvpilot tune` form)
            base_name, rest = "", text
        if base_name in PRESETS:
            base = PRESETS[base_name]
        elif base_name in ("poisson", "gamma"):
            base = cls(arrival=base_name, cv=2.0 if base_name == "gamma" else 1.0, name=base_name)
        elif base_name:
            raise WorkloadError(
                f"workload {spec!r}: start with a preset ({', '.join(PRESETS)}) or an arrival process "
                "(poisson:, gamma:), e.g. poisson:rate=10,prompt=sharegpt; or give a .jsonl trace path"
            )
        else:
            base = replace(PRESETS["sharegpt"], name="custom")
        return base._with(spec, rest, explicit_arrival=base_name in ("poisson", "gamma"))

    def _with(self, spec: str, text: str, *, explicit_arrival: bool) -> Workload:
        fields: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq:
                raise WorkloadError(f"workload {spec!r}: {item!r} is not key=value")
            if key == "requests":
                raise WorkloadError(
                    f"workload {spec!r}: requests=N is not part of a workload; `kvpilot tune` measures each "
                    "rate in steady state (--probe-seconds S) and `kvpilot twin run` takes --num-requests N"
                )
            if key == "preset":
                raise WorkloadError(f"workload {spec!r}: write the preset first, e.g. {value}:rate=5")
            if key not in _KEYS:
                raise WorkloadError(
                    f"workload {spec!r}: unknown key {key!r}; allowed: {', '.join(_KEYS)}")
            fields[key] = value.strip()
        try:
            rate = float(fields["rate"]) if "rate" in fields else self.rate
            cv = float(fields["cv"]) if "cv" in fields else self.cv
            prefix = int(fields.get("prefix", self.prefix_tokens))
            prefixes = int(fields.get("prefixes", self.num_prefixes))
        except ValueError as exc:
            raise WorkloadError(f"workload {spec!r}: {exc}") from None
        if rate is not None and not (rate > 0 and math.isfinite(rate)):
            raise WorkloadError(f"workload {spec!r}: rate must be a positive number")
        if not (cv > 0 and math.isfinite(cv)):
            raise WorkloadError(f"workload {spec!r}: cv must be a positive number")
        if prefix < 0 or prefixes < 1:
            raise WorkloadError(f"workload {spec!r}: prefix must be >= 0 and prefixes >= 1")
        arrival = self.arrival
        if "cv" in fields and not explicit_arrival:
            arrival = "poisson" if cv == 1 else "gamma"
        if arrival == "poisson":
            cv = 1.0
        return replace(
            self, arrival=arrival, rate=rate, cv=cv,
            prompt=LengthDist.parse(fields["prompt"], "prompt") if "prompt" in fields else self.prompt,
            output=LengthDist.parse(fields["output"], "output") if "output" in fields else self.output,
            prefix_tokens=prefix, num_prefixes=prefixes,
            name=self.name if not fields else f"{self.name}:{','.join(f'{k}={v}' for k, v in fields.items())}",
        )

    def with_rate(self, rate: float) -> Workload:
        return replace(self, rate=rate)

    def _gaps(self, rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
        # Unit-rate gaps divided by the rate: the same seed gives the same requests at every rate.
        if self.arrival == "poisson":
            return rng.exponential(1.0, size=n) / rate
        shape = 1.0 / (self.cv**2)
        return rng.gamma(shape, 1.0 / shape, size=n) / rate

    def generate(self, *, duration_s: float | None = None, num_requests: int | None = None,
                 seed: int | Sequence[int] = 0) -> RequestBatch:
        """The requests arriving in [0, duration_s), or the first `num_requests` (both: whichever
        ends first).  Same spec + seed (an int, or a sequence of ints as numpy takes it) -> same requests."""
        if duration_s is None and num_requests is None:
            raise WorkloadError("give a duration or a number of requests")
        if self.arrival == "trace":
            return self._replay(duration_s, num_requests)
        if self.rate is None:
            raise WorkloadError(f"workload {self.name!r}: give rate=R (requests per second), e.g. "
                                f"{self.name.split(':')[0]}:rate=10")
        rate = self.rate
        rng = np.random.default_rng(seed)
        if num_requests is not None:
            n = num_requests
            arrivals = np.cumsum(self._gaps(rng, n, rate))
        else:
            assert duration_s is not None
            chunks, t = [], 0.0
            while t < duration_s:
                size = max(64, int((duration_s - t) * rate * 1.2) + 16)
                g = np.cumsum(self._gaps(rng, size, rate)) + t
                chunks.append(g)
                t = float(g[-1])
            arrivals = np.concatenate(chunks)
        if duration_s is not None:
            arrivals = arrivals[arrivals < duration_s]
        n = len(arrivals)
        prompts = self.prompt.sample(rng, n)
        outputs = self.output.sample(rng, n)
        keys: list[str | None] | None = None
        ptoks = None
        if self.prefix_tokens:
            which = rng.integers(0, self.num_prefixes, size=n)
            keys = [f"prefix-{k}" for k in which.tolist()]
            ptoks = np.full(n, self.prefix_tokens, dtype=np.int64)
            prompts = prompts + self.prefix_tokens
        return RequestBatch(arrivals, prompts, outputs, keys, ptoks)

    def _replay(self, duration_s: float | None, num_requests: int | None) -> RequestBatch:
        path = Path(self.trace_path or "")
        rows = []
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise WorkloadError(f"cannot read trace {str(path)!r}: {exc.strerror}") from None
        for no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                row = (float(obj["arrival_s"]), int(obj["prompt_tokens"]), int(obj["output_tokens"]),
                       obj.get("prefix"), int(obj.get("prefix_tokens", 0)))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise WorkloadError(
                    f"{path}:{no}: each line must be a JSON object with arrival_s, prompt_tokens and "
                    f"output_tokens ({type(exc).__name__}: {exc})"
                ) from None
            if row[0] < 0 or row[1] < 1 or row[2] < 1:
                raise WorkloadError(f"{path}:{no}: arrival_s must be >= 0 and token counts >= 1")
            rows.append(row)
        rows.sort(key=lambda r: r[0])
        if duration_s is not None:
            rows = [r for r in rows if r[0] < duration_s]
        if num_requests is not None:
            rows = rows[:num_requests]
        has_prefix = any(r[3] for r in rows)
        return RequestBatch(
            np.array([r[0] for r in rows], dtype=float),
            np.array([r[1] for r in rows], dtype=np.int64),
            np.array([r[2] for r in rows], dtype=np.int64),
            [r[3] for r in rows] if has_prefix else None,
            np.array([r[4] for r in rows], dtype=np.int64) if has_prefix else None,
        )

    def describe(self) -> dict[str, object]:
        if self.arrival == "trace":
            return {"arrival": "trace", "path": self.trace_path}
        d: dict[str, object] = {"name": self.name, "arrival": self.arrival, "prompt": str(self.prompt),
                                "output": str(self.output)}
        if self.rate is not None:
            d["rate"] = self.rate
        if self.arrival == "gamma":
            d["cv"] = self.cv
        if self.prefix_tokens:
            d["prefix"] = self.prefix_tokens
            d["prefixes"] = self.num_prefixes
        return d


_CHAT = (LengthDist("lognormal", 512, 0.8, 16, 6144), LengthDist("lognormal", 160, 0.7, 8, 1024))
PRESETS: dict[str, Workload] = {
    "chat": Workload(prompt=_CHAT[0], output=_CHAT[1], name="chat"),
    "rag": Workload(prompt=LengthDist("lognormal", 2048, 0.5, 256, 7168),
                    output=LengthDist("lognormal", 96, 0.5, 8, 512), name="rag"),
    "decode": Workload(prompt=LengthDist("lognormal", 256, 0.6, 16, 2048),
                       output=LengthDist("lognormal", 400, 0.5, 32, 1536), name="decode"),
    "bursty": Workload(arrival="gamma", cv=2.5, prompt=_CHAT[0], output=_CHAT[1], name="bursty"),
    "sharegpt": Workload(name="sharegpt"),
}
